"""Sync policies: pure decisions about when the generator gets new weights (DESIGN.md section 4).

A policy sees versions and ESS values and answers yes or no; it holds no weights and calls
nothing. The synchronous loop applies it through `tether.weights.Synchronizer`; the
asynchronous loop through its publish rule (docs/async.md).

The forms and what each does are written once, in `FORMS` (`tether config --fields` prints
them for `sync.policy`); `EveryK`, `BoundedK`, `EssTrigger` and `ResyncK` implement them, each with
its rule for the asynchronous loop's publishing (`publishes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tether.estimators.ess import ess_token
from tether.estimators.presets import DEFAULT_SYNC_POLICY, PRESETS
from tether.lazy import torch

ON_TRIP = ("train", "regenerate")


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

    def publishes(self, behind: int, blocked: bool, tripped: bool) -> bool:
        """The asynchronous loop, after a step: publish the trainer's weights now? `behind`:
        versions since the last publish; `blocked`: no further rollout batch can be admitted
        without one; `tripped`: the staleness gate tripped on the batch just trained."""
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

    def publishes(self, behind: int, blocked: bool, tripped: bool) -> bool:
        return behind >= self.k


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
        """May a batch sampled at `sampled_version` be trained at `trained_version`?"""
        return trained_version - sampled_version <= self.k

    def trips(self, ess: float) -> bool:
        return False

    def overdue(self, steps_since_resync: int) -> bool:
        return False

    def publishes(self, behind: int, blocked: bool, tripped: bool) -> bool:
        return blocked  # lazily: the generator runs up to K versions behind


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

    def publishes(self, behind: int, blocked: bool, tripped: bool) -> bool:
        return blocked or tripped or self.overdue(behind)


@dataclass(frozen=True)
class ResyncK:
    """`resync:K`: every step lagged, plus a re-sync to current weights every K steps since the
    last one: the ESS trigger's re-syncs on a fixed schedule (its control in E-DLC)."""

    k: int = 1
    measures_ess = False

    @property
    def spec(self) -> str:
        return f"resync:{self.k}"

    def routine(self, step: int, trainer_version: int, generator_version: int) -> bool:
        return True

    def trips(self, ess: float) -> bool:
        return False

    def overdue(self, steps_since_resync: int) -> bool:
        return steps_since_resync >= self.k

    def publishes(self, behind: int, blocked: bool, tripped: bool) -> bool:
        return blocked or self.overdue(behind)


@dataclass
class Switched:
    """train.correction=auto: the configured policy (`plain`), or the ESS re-sync (`resync`)
    while auto handles staleness (`on`, set by tether.loops.autocorrect). The gate, the
    synchronizer and the scheduler share this one object, so a switch reaches all three.

    The re-sync's trigger is armed throughout: a batch whose ESS falls below its TAU re-syncs
    the generator whatever auto's choice, as dlc's does. A step past DLC's drift point is its
    own evidence; waiting for the k-step streak that switches the handling on let the lag
    build on (E-AUTO, RESULTS.md). It costs nothing until it trips: a batch sampled at the
    trainer's weights has ESS 1 without a forward, a stale one is read off the training
    forward (sync.on_trip=train)."""

    plain: SyncPolicy
    resync: SyncPolicy
    on: bool = False

    @property
    def current(self) -> SyncPolicy:
        return self.resync if self.on else self.plain

    @property
    def spec(self) -> str:
        return self.current.spec

    measures_ess = True  # the trigger is armed in either choice

    def routine(self, step: int, trainer_version: int, generator_version: int) -> bool:
        return self.current.routine(step, trainer_version, generator_version)

    def trips(self, ess: float) -> bool:
        return self.resync.trips(ess)

    def overdue(self, steps_since_resync: int) -> bool:
        return self.current.overdue(steps_since_resync)

    def publishes(self, behind: int, blocked: bool, tripped: bool) -> bool:
        return tripped or self.current.publishes(behind, blocked, tripped)


# The forms of a policy spec: (syntax, an example or "", what it does). The one statement of
# the syntax: parse errors list the forms, config's `sync.policy` help is `describe_forms()`.
FORMS = (
    ("every:K", "", "after every K-th step"),
    ("bounded:K", "", "only when it would otherwise be more than K versions behind"),
    ("ess:TAU[:max=M]", "ess:0.5:max=8",
     ("every step, lagged, plus a re-sync to the current weights when the token ESS of "
      "pi_theta/pi_old on the incoming batch falls below TAU; max=M: also after M steps without one")),
    ("resync:K", "", ("every step, lagged, plus a re-sync to the current weights after every "
                      "K steps without one: ess's re-syncs on a fixed schedule")),
    ("auto", "", "the estimator preset's"),
)
_FORMS = ", ".join(f"{form} (e.g. {example})" if example else form for form, example, _ in FORMS)


def describe_forms() -> str:
    """Each form with what it does; `auto` names the presets' own policies (Preset.sync_policy)."""
    own: dict[str, list[str]] = {}
    for preset in PRESETS.values():
        if preset.sync_policy != DEFAULT_SYNC_POLICY:
            own.setdefault(preset.sync_policy, []).append(preset.name)
    presets = "; ".join(f"{', '.join(names)} -> {spec}" for spec, names in own.items())
    auto = f": {presets}, else {DEFAULT_SYNC_POLICY}"
    return ", ".join(f"{form} ({meaning}{auto if form == 'auto' else ''})"
                     for form, _, meaning in FORMS)


def resolve_policy_spec(spec: str, estimator: str = "grpo") -> str:
    """`auto` -> the estimator preset's `sync_policy` (not a preset: every:1); others unchanged."""
    if spec != "auto":
        return spec
    preset = PRESETS.get(estimator)
    return preset.sync_policy if preset else DEFAULT_SYNC_POLICY


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
    if name in ("every", "bounded", "resync"):
        if len(args) != 1:
            raise ValueError(f"sync policy {spec!r}: expected {name}:K; valid forms: {_FORMS}")
        if name == "bounded":
            return BoundedK(_int(spec, args[0], "K", 0))
        return (EveryK if name == "every" else ResyncK)(_int(spec, args[0], "K", 1))
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


def staleness_ess(logp_now: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> float:
    """What `ess:TAU` compares with TAU: the normalised token ESS of r = pi_theta / pi_old,
    in float64 as the diagnostics compute staleness/ess/token."""
    return float(ess_token(logp_now.double() - logp_old.double(), mask))


def trained_ess(logp_trained: torch.Tensor | None, logp_old: torch.Tensor, mask: torch.Tensor,
                minibatches: int, score_now: Callable[[], torch.Tensor]) -> float:
    """`staleness_ess` at the weights a batch's training started from (on_trip=train).

    Read off the training forward's first mini-batch, scored before any update of the step
    (the later ones drift by the mini-batch source, which no re-sync removes); no extra
    compute. `logp_trained` None (a step cut short): `score_now()` scores the whole batch.
    """
    if logp_trained is None:
        return staleness_ess(score_now(), logp_old, mask)
    rows = mask.shape[0] // minibatches
    return staleness_ess(logp_trained[:rows], logp_old[:rows], mask[:rows])
