"""Sync policies and staleness: which weight version the generator holds (DESIGN.md section 4).

Two independent choices make the data stale:
- `sync.lag` k (DLC's stale generator): a routine delivery hands the generator the
  weights of k versions ago, never the current ones, so in steady state it samples
  k versions behind. `train.minibatches` N (VESPO's N) adds staleness inside a batch:
  its i-th mini-batch is trained i versions after it was sampled.
- `sync.policy`, when deliveries happen:
    every:K         a routine delivery after every K-th step.
    bounded:K       a routine delivery only when the next batch would otherwise start
                    training more than K versions after the one that sampled it
                    (AReaL's bound, in the synchronous loop); needs lag <= K.
    ess:TAU[:max=M] DLC's trigger: a routine delivery every step, and a re-sync to the
                    trainer's *current* weights as soon as the normalised token ESS of the
                    staleness ratio r = pi_theta / pi_old on the incoming batch, at the
                    weights its training starts from, falls below TAU (default 0.5); with
                    max=M also whenever M steps passed since the last re-sync to current
                    weights. After a re-sync the lag resumes from the new version.
    auto            the estimator preset's policy (`dlc`: ess:0.5), otherwise every:1.
  The batch that trips the ESS threshold is the stalest one: `sync.on_trip=train` trains
  on it (the estimator caps its weights) and re-syncs after the step, `regenerate` re-syncs
  at once, drops it and samples the same prompts again from the synced generator.

`Synchronizer` applies all of it for the loop, keeps the `SnapshotStore` down to the
versions still needed and reports what happened as metrics (`sync/...`, `snapshots/...`).
`RolloutQueue` and `BoundedK.admits` are the hooks an asynchronous loop uses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tether.estimators.ess import ess_token
from tether.snapshots import SnapshotStore

ON_TRIP = ("train", "regenerate")
# Presets whose method includes a sync policy; `sync.policy: auto` picks it.
PRESET_POLICIES = {"dlc": "ess:0.5"}
DEFAULT_POLICY = "every:1"


class SyncPolicy(Protocol):
    spec: str
    measures_ess: bool  # the loop must measure ESS on incoming batches

    def routine(self, step: int, trainer_version: int, generator_version: int) -> bool:
        """Whether a routine (lagged) delivery happens after `step` (0-based)."""
        ...

    def trips(self, ess: float) -> bool:
        """Whether an incoming batch with this ESS forces a re-sync to current weights."""
        ...

    def overdue(self, steps_since_resync: int) -> bool:
        """Whether so many steps passed since the last re-sync that one is forced now."""
        ...


@dataclass(frozen=True)
class EveryK:
    """`every:K`: a routine delivery after every K-th step."""

    k: int = 1
    measures_ess = False

    @property
    def spec(self) -> str:
        return f"every:{self.k}"

    def routine(self, step: int, trainer_version: int, generator_version: int) -> bool:
        return (step + 1) % self.k == 0

    def trips(self, ess: float) -> bool:
        return False

    def overdue(self, steps_since_resync: int) -> bool:
        return False


@dataclass(frozen=True)
class BoundedK:
    """`bounded:K`: deliver only when the generator would otherwise be more than K versions behind."""

    k: int = 1
    measures_ess = False

    @property
    def spec(self) -> str:
        return f"bounded:{self.k}"

    def routine(self, step: int, trainer_version: int, generator_version: int) -> bool:
        return not self.admits(generator_version, trainer_version)

    def admits(self, sampled_version: int, trained_version: int) -> bool:
        """Async hook: may a batch sampled at `sampled_version` be trained at `trained_version`?"""
        return trained_version - sampled_version <= self.k

    def trips(self, ess: float) -> bool:
        return False

    def overdue(self, steps_since_resync: int) -> bool:
        return False


@dataclass(frozen=True)
class EssTrigger:
    """`ess:TAU[:max=M]`: re-sync to current weights when the incoming batch's ESS < TAU.

    ESS = (sum m r)^2 / (sum m * sum m r^2) over the batch's valid tokens, r untruncated
    (tether.estimators.ess_token). An ESS exactly equal to TAU does not trip.
    """

    tau: float = 0.5
    max_interval: int | None = None  # force a re-sync after this many steps without one
    measures_ess = True

    @property
    def spec(self) -> str:
        return f"ess:{self.tau:g}" + (f":max={self.max_interval}" if self.max_interval else "")

    def routine(self, step: int, trainer_version: int, generator_version: int) -> bool:
        return True

    def trips(self, ess: float) -> bool:
        return ess < self.tau

    def overdue(self, steps_since_resync: int) -> bool:
        return self.max_interval is not None and steps_since_resync >= self.max_interval


_FORMS = "every:K, bounded:K, ess:TAU[:max=M] (e.g. ess:0.5:max=8), auto"


def resolve_policy_spec(spec: str, estimator: str = "grpo") -> str:
    """`auto` -> the estimator preset's policy (dlc: ess:0.5) or every:1; others unchanged."""
    return PRESET_POLICIES.get(estimator, DEFAULT_POLICY) if spec == "auto" else spec


def _int(spec: str, text: str, what: str, lo: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"sync policy {spec!r}: {what} must be an integer, got {text!r}") from None
    if value < lo:
        raise ValueError(f"sync policy {spec!r}: {what} must be >= {lo}, got {value}")
    return value


def parse_sync_policy(spec: str, estimator: str = "grpo") -> SyncPolicy:
    """`"every:2"` -> EveryK(2), `"ess:0.5:max=8"` -> EssTrigger(0.5, 8). ValueError lists the forms."""
    spec = resolve_policy_spec(spec, estimator)
    name, _, rest = spec.partition(":")
    args = rest.split(":") if rest else []
    if name in ("every", "bounded"):
        if len(args) != 1:
            raise ValueError(f"sync policy {spec!r}: expected {name}:K; valid forms: {_FORMS}")
        return EveryK(_int(spec, args[0], "K", 1)) if name == "every" else \
            BoundedK(_int(spec, args[0], "K", 0))
    if name == "ess":
        if not 1 <= len(args) <= 2:
            raise ValueError(f"sync policy {spec!r}: expected ess:TAU[:max=M]; valid forms: {_FORMS}")
        try:
            tau = float(args[0])
        except ValueError:
            raise ValueError(f"sync policy {spec!r}: TAU must be a number in (0, 1], "
                             f"got {args[0]!r}") from None
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"sync policy {spec!r}: TAU must be in (0, 1] (ESS is normalised), "
                             f"got {tau}")
        max_interval = None
        if len(args) == 2:
            key, eq, value = args[1].partition("=")
            if key != "max" or not eq:
                raise ValueError(f"sync policy {spec!r}: unknown option {args[1]!r}; "
                                 "the only option is max=M (steps), e.g. ess:0.5:max=8")
            max_interval = _int(spec, value, "max", 1)
        return EssTrigger(tau, max_interval)
    raise ValueError(f"unknown sync policy {spec!r}; valid forms: {_FORMS}")


class RolloutQueue:
    """Rollout batches waiting for the trainer, each with the weight version that sampled it.

    The hook for an asynchronous loop: the snapshot store keeps every version a queued
    batch needs. The synchronous loop trains each batch at once and leaves it empty.
    """

    def __init__(self) -> None:
        self._items: deque[tuple[int, Any]] = deque()

    def push(self, version: int, item: Any) -> None:
        self._items.append((version, item))

    def pop(self) -> tuple[int, Any]:
        return self._items.popleft()

    def versions(self) -> set[int]:
        return {v for v, _ in self._items}

    def max_staleness(self, trainer_version: int) -> int:
        """Versions between the trainer and the oldest queued batch (0 when empty)."""
        return max((trainer_version - v for v, _ in self._items), default=0)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return iter(self._items)


class Synchronizer:
    """Owns the generator's weight version for the loop; one `check` and one `after_step` a step.

    `trainer` needs `.model`, `.version`, `.score_old(batch, model)` and, for ESS policies
    with on_trip=train, `.last_logp` (the training forward's logp, None if incomplete);
    `generator` needs `.version` and `.load_weights(state_dict, version)`.
    """

    def __init__(self, policy: SyncPolicy, generator: Any, trainer: Any,
                 snapshots: SnapshotStore, lag: int = 0, on_trip: str = "train",
                 queue: RolloutQueue | None = None, minibatches: int = 1):
        if on_trip not in ON_TRIP:
            raise ValueError(f"sync.on_trip={on_trip!r}; valid: {', '.join(ON_TRIP)}")
        if lag < 0:
            raise ValueError(f"sync.lag must be >= 0, got {lag}")
        self.policy, self.generator, self.trainer = policy, generator, trainer
        self.snapshots, self.lag, self.on_trip = snapshots, lag, on_trip
        self.queue = queue if queue is not None else RolloutQueue()
        self.steps_since_resync = 0
        self.minibatches = minibatches  # train.minibatches: the first one is trained unchanged
        self._pending: tuple[Any, torch.Tensor, bool] | None = None
        self._resync_after_step = False
        self._synced = False
        self._metrics: dict[str, float] = {}
        self.snapshots.put(generator.version, trainer.model.state_dict())

    def old_model(self, version: int) -> Any:
        """The fp32 model at `version` (the trainer's own model when current) for `logp_old`."""
        return self.trainer.model if version == self.trainer.version else self.snapshots.model_at(version)

    def check(self, batch: Any, logp_old: torch.Tensor, batch_version: int) -> bool:
        """Before training on a batch: measure it, maybe re-sync; True = drop it and regenerate.

        The ESS of r = pi_theta / pi_old is taken at the weights the batch's training starts
        from. With on_trip=train it is read off the training forward of the first mini-batch
        (`trainer.last_logp`, in `after_step`): no extra compute. With on_trip=regenerate the
        decision must come before training, so the batch is scored now (one no-grad forward).
        A fresh batch has r = 1 and ESS = 1 without any forward.
        """
        V = self.trainer.version
        self._metrics["staleness/versions/batch"] = float(V - batch_version)
        self._pending = None
        if not self.policy.measures_ess:
            return False
        if self.on_trip == "train":
            self._pending = (batch, logp_old, batch_version == V)
            return False
        ess = 1.0 if batch_version == V else self._ess_now(batch, logp_old, None)
        regenerate = self._record_ess(ess)
        self._metrics["sync/regenerated"] = float(regenerate)
        if regenerate:
            self._resync()
            self._metrics["staleness/versions/batch"] = 0.0
        return regenerate

    def after_step(self, step: int) -> dict[str, float]:
        """After the optimizer step(s): deliver weights per policy and lag, free snapshots.

        Returns this step's sync metrics (including those `check` recorded).
        """
        if self._pending is not None:  # on_trip=train: measured on the training forward
            batch, logp_old, fresh = self._pending
            ess = 1.0 if fresh else self._ess_now(batch, logp_old, getattr(self.trainer, "last_logp", None))
            self._resync_after_step = self._record_ess(ess)
            self._pending = None
        V = self.trainer.version
        g = self.generator.version
        if self.lag > 0 and V > g:
            self.snapshots.put(V, self.trainer.model.state_dict())  # a later lagged delivery
        self.steps_since_resync += 1
        forced = not self._resync_after_step and self.policy.overdue(self.steps_since_resync)
        if self._resync_after_step or forced:
            self._resync()
        elif self.policy.routine(step, V, g):
            target = self._lagged_target(V)
            if target is not None:
                self._deliver(target)
                if target == V:
                    self.steps_since_resync = 0
        freed = self.snapshots.release(self._needed())
        out = {
            **self._metrics,
            "sync/synced": float(self._synced),
            "sync/forced": float(forced),
            "snapshots/count": float(len(self.snapshots)),
            "snapshots/bytes": float(self.snapshots.nbytes),
            "snapshots/freed": float(len(freed)),
        }
        self._metrics, self._resync_after_step, self._synced = {}, False, False
        return out

    # -- internals ---------------------------------------------------------------------

    def _ess_now(self, batch: Any, logp_old: torch.Tensor, logp_trained: torch.Tensor | None) -> float:
        """Token ESS of pi_theta / pi_old at the weights training started from.

        `logp_trained` (B, T): the training forward's logp; its first mini-batch was scored
        before any update of this step, so only those rows are used. None: score now.
        """
        mask = batch.response_mask
        if logp_trained is None:
            logp_now, _ = self.trainer.score_old(batch, self.trainer.model)
        else:
            rows = mask.shape[0] // self.minibatches
            logp_now, logp_old, mask = logp_trained[:rows], logp_old[:rows], mask[:rows]
        # float64, as the diagnostics compute the logged staleness/ess/token
        return float(ess_token(logp_now.double() - logp_old.double(), mask))

    def _record_ess(self, ess: float) -> bool:
        tripped = self.policy.trips(ess)
        self._metrics["sync/ess/token"] = ess
        self._metrics["sync/tripped"] = float(tripped)
        return tripped

    def _lagged_target(self, V: int) -> int | None:
        """The newest kept version <= V - lag that is newer than the generator's, if any."""
        if self.lag == 0:
            return V if V > self.generator.version else None
        ready = [v for v in self.snapshots.versions if self.generator.version < v <= V - self.lag]
        return max(ready) if ready else None

    def _deliver(self, version: int) -> None:
        if version == self.trainer.version:
            self.snapshots.put(version, self.trainer.model.state_dict())
        self.generator.load_weights(self.snapshots.state(version), version)
        self._synced = True

    def _resync(self) -> None:
        """Copy the trainer's current weights to the generator."""
        self._deliver(self.trainer.version)
        self.steps_since_resync = 0

    def _needed(self) -> set[int]:
        """Versions still needed: the generator's, queued batches', pending lagged deliveries."""
        g = self.generator.version
        keep = {g} | self.queue.versions()
        if self.lag > 0:
            V = self.trainer.version
            newer = [v for v in self.snapshots.versions if v > g]
            ready = [v for v in newer if v <= V - self.lag]
            floor = max(ready) if ready else g + 1  # older ready ones are superseded by it
            keep |= {v for v in newer if v >= floor}
        return keep

    # -- checkpoint hooks (sync state) -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able sync state; the weights are `snapshots.state(v)` for v in snapshot_versions."""
        return {"generator_version": self.generator.version,
                "steps_since_resync": self.steps_since_resync,
                "snapshot_versions": self.snapshots.versions}

    def load_state_dict(self, state: dict[str, Any],
                        snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore from `state_dict()` and the kept weights; reloads the generator's version."""
        for v, sd in snapshots.items():
            self.snapshots.put(int(v), sd)
        self.snapshots.release({int(v) for v in state["snapshot_versions"]})
        g = int(state["generator_version"])
        self.generator.load_weights(self.snapshots.state(g), g)
        self.steps_since_resync = int(state["steps_since_resync"])
