"""The synchronous loop's weight bookkeeping: which version the generator holds.

Two independent choices make the data stale in the synchronous loop:
- `sync.lag` k (DLC's stale generator): a routine delivery hands the generator the
  weights of k versions ago, never the current ones, so in steady state it samples
  k versions behind. `train.minibatches` N (VESPO's N) adds staleness inside a batch:
  its i-th mini-batch is trained i versions after it was sampled.
- `sync.policy` (tether.weights.policy), when deliveries happen. In this loop `bounded:K`
  delivers only when the next batch would otherwise start training more than K versions
  after the one that sampled it (needs lag <= K), and `ess:TAU` delivers every step,
  lagged, plus a re-sync to the trainer's *current* weights when the incoming batch's ESS
  falls below TAU; after a re-sync the lag resumes from the new version.
  The batch that trips the ESS threshold is the stalest one: `sync.on_trip=train` trains
  on it (the estimator caps its weights) and re-syncs after the step, `regenerate` re-syncs
  at once, drops it and samples the same prompts again from the synced generator.

`Synchronizer` applies the policy, hands versions to the engine through a publisher,
keeps the `SnapshotStore` down to the versions still needed and reports what happened as
metrics (`sync/...`, `snapshots/...`). It never calls the trainer: the loop passes the
trainer's version, weights and log-probs in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tether.weights.policy import ON_TRIP, SyncPolicy, staleness_ess, trained_ess
from tether.weights.publisher import Publisher
from tether.weights.snapshots import SnapshotStore


class Synchronizer:
    """Owns the generator's weight version for the synchronous loop: one `check` and one
    `after_step` a step. `publisher.version` is the version the generator holds."""

    def __init__(self, policy: SyncPolicy, publisher: Publisher, snapshots: SnapshotStore,
                 weights: dict[str, torch.Tensor], lag: int = 0, on_trip: str = "train",
                 minibatches: int = 1):
        if on_trip not in ON_TRIP:
            raise ValueError(f"sync.on_trip={on_trip!r}; valid: {', '.join(ON_TRIP)}")
        if lag < 0:
            raise ValueError(f"sync.lag must be >= 0, got {lag}")
        self.policy, self.publisher = policy, publisher
        self.snapshots, self.lag, self.on_trip = snapshots, lag, on_trip
        self.steps_since_resync = 0
        self.minibatches = minibatches  # train.minibatches: the first one is trained unchanged
        self._pending: tuple[Any, torch.Tensor, bool, Callable[[], torch.Tensor]] | None = None
        self._resync_after_step = False
        self._synced = False
        self._metrics: dict[str, float] = {}
        self.snapshots.put(publisher.version, weights)

    @property
    def generator_version(self) -> int:
        return self.publisher.version

    def check(self, batch: Any, logp_old: torch.Tensor, batch_version: int, trainer_version: int,
              score_now: Callable[[], torch.Tensor]) -> bool:
        """Before training on a batch: measure it, maybe re-sync; True = drop it and regenerate.

        The ESS of r = pi_theta / pi_old is taken at the weights the batch's training starts
        from. With on_trip=train it is read off the training forward of the first mini-batch
        (passed to `after_step`): no extra compute. With on_trip=regenerate the decision
        must come before training, so `score_now()` scores the batch at the current weights
        (one no-grad forward); the re-sync then needs the current weights, which the caller
        delivers by calling `resync` when this returns True. A fresh batch has r = 1 and
        ESS = 1 without any forward.
        """
        self._metrics["staleness/versions/batch"] = float(trainer_version - batch_version)
        self._pending = None
        if not self.policy.measures_ess:
            return False
        if self.on_trip == "train":
            self._pending = (batch, logp_old, batch_version == trainer_version, score_now)
            return False
        ess = 1.0 if batch_version == trainer_version else staleness_ess(score_now(), logp_old,
                                                                 batch.response_mask)
        regenerate = self._record_ess(ess)
        self._metrics["sync/regenerated"] = float(regenerate)
        if regenerate:
            self._metrics["staleness/versions/batch"] = 0.0
        return regenerate

    def resync(self, trainer_version: int, weights: dict[str, torch.Tensor]) -> None:
        """Deliver the trainer's current weights to the generator."""
        self._deliver(trainer_version, trainer_version, weights)
        self.steps_since_resync = 0

    def after_step(self, step: int, trainer_version: int, weights: dict[str, torch.Tensor],
                   logp_trained: torch.Tensor | None) -> dict[str, float]:
        """After the optimizer step(s): deliver weights per policy and lag, free snapshots.

        `weights`: the trainer's state dict (not copied unless kept); `logp_trained` (B, T):
        the training forward's logp (None when a step stopped before scoring every row).
        Returns this step's sync metrics (including those `check` recorded).
        """
        if self._pending is not None:  # on_trip=train: measured on the training forward
            batch, logp_old, fresh, score_now = self._pending
            ess = 1.0 if fresh else trained_ess(logp_trained, logp_old, batch.response_mask,
                                                self.minibatches, score_now)
            self._resync_after_step = self._record_ess(ess)
            self._pending = None
        V, g = trainer_version, self.publisher.version
        if self.lag > 0 and V > g:
            self.snapshots.put(V, weights)  # a later lagged delivery
        self.steps_since_resync += 1
        forced = not self._resync_after_step and self.policy.overdue(self.steps_since_resync)
        if self._resync_after_step or forced:
            self.resync(V, weights)
        elif self.policy.routine(step, V, g):
            target = self._lagged_target(V)
            if target is not None:
                self._deliver(target, V, weights)
                if target == V:
                    self.steps_since_resync = 0
        freed = self.snapshots.release(self._needed(V))
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

    def _record_ess(self, ess: float) -> bool:
        tripped = self.policy.trips(ess)
        self._metrics["sync/ess/token"] = ess
        self._metrics["sync/tripped"] = float(tripped)
        return tripped

    def _lagged_target(self, V: int) -> int | None:
        """The newest kept version <= V - lag that is newer than the generator's, if any."""
        if self.lag == 0:
            return V if V > self.publisher.version else None
        ready = [v for v in self.snapshots.versions if self.publisher.version < v <= V - self.lag]
        return max(ready) if ready else None

    def _deliver(self, version: int, trainer_version: int, weights: dict[str, torch.Tensor]) -> None:
        if version == trainer_version:
            self.snapshots.put(version, weights)
        self.publisher.publish(version, self.snapshots.state(version))
        self._synced = True

    def _needed(self, V: int) -> set[int]:
        """Versions still needed: the generator's, and pending lagged deliveries."""
        g = self.publisher.version
        keep = {g}
        if self.lag > 0:
            newer = [v for v in self.snapshots.versions if v > g]
            ready = [v for v in newer if v <= V - self.lag]
            floor = max(ready) if ready else g + 1  # older ready ones are superseded by it
            keep |= {v for v in newer if v >= floor}
        return keep

    # -- checkpoint hooks (sync state) -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able sync state; the weights are `snapshots.state(v)` for v in snapshot_versions."""
        return {"generator_version": self.publisher.version,
                "steps_since_resync": self.steps_since_resync,
                "snapshot_versions": self.snapshots.versions}

    def load_state_dict(self, state: dict[str, Any],
                        snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore from `state_dict()` and the kept weights; reloads the generator's version."""
        for v, sd in snapshots.items():
            self.snapshots.put(int(v), sd)
        self.snapshots.release({int(v) for v in state["snapshot_versions"]})
        g = int(state["generator_version"])
        self.publisher.publish(g, self.snapshots.state(g))
        self.steps_since_resync = int(state["steps_since_resync"])
