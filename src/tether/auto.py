"""`train.correction=auto`: each cause's correction chosen online from what each step measured.

tether.advice judges a whole run once (`tether probe`, `tether inspect`); the controller
judges every step's logged split with the same rules and thresholds, so the probe, inspect
and the run agree (docs/probe.md derives them):

    numerical  material: sequence chi2(pi_old || mu) > 1/N.  Correction: icepop when the
               step's |log rho| peak leaves [1/2, 2] (a heavy tail) or MoE routing moves
               more than 5% of tokens, else cis (its cap loosens on low-confidence tokens,
               where TIS's fixed cap biases most; tis is never the better choice here).
    staleness  material: lowest token ESS of pi_theta / pi_old < 0.7 (ESS_TAU + margin).
               Handling (`dlc`), DLC's: each token weighted by the capped ratio
               pi_theta / pi_old (the objective's own ratio: ppo, gspo, vespo, ...; stale_is
               for one without, pg), the score centered over the generator's top-K head, the
               ESS re-sync's schedule (async: with the ESS window). Only then is the engine
               asked for its top-K. Centering is DLC's numerical correction and persists
               after any re-sync, so while staleness is handled it stands in for the
               numerical cap (advice: dlc, for staleness alone or both); the cap stays where
               centering cannot be (an objective without a top-K head weight, or an engine
               without top-K).

The re-sync itself is not switched: its trigger (one batch's ESS < ESS_TAU = 0.5, DLC's drift
point) is armed in either choice, as dlc's is (tether.weights.policy.Switched). One step's
ESS past the drift point is the evidence DLC acts on, and a re-sync removes the cause rather
than trading bias for variance; it costs nothing until it trips. The token ESS is a minimum
over a batch and flickers: under lag it dips below 0.7 on some steps and not the next, so the
k-step streak came late or never, and with the re-sync behind it auto re-synced 0.7 times per
race where dlc did 3.3 (E-AUTO at 6 seeds, RESULTS.md).

Hysteresis. A cause switches a correction on (or to another kind) after ON_AFTER = k = 3
consecutive steps call for it, and off after OFF_AFTER = m = 6 consecutive steps call for
none. Why: one step's figure is one batch's estimate; three exceedances in a row make a
spurious switch p^3 at a per-step false-alarm rate p (1e-3 at p = 0.1), and cost at most
two uncorrected steps, while DLC's drift builds over tens. Off asks for twice the evidence:
leaving a needed correction off lets a bias compound, keeping an unneeded one a few steps
costs bounded variance. A window w > k (`window`: k of the last w steps) is for evidence that
fires on some steps only, near its threshold; measured (E-AUTO, RESULTS.md) at k = 3 of 5
with m = 10 it was not better than k in a row, so the default stays k in a row.

Pooled evidence (`pool`: w steps). One step's figure is one batch's estimate of a cause that
is constant (a precision) or builds (a lag): near its threshold it fires on some steps only.
With `pool`, each step is judged on the last w steps' rows pooled as `tether inspect` pools a
whole run (tether.advice.evidence_from_rows: the mean sequence chi2, the lowest token ESS, the
tail on most steps), and the hysteresis counts those judgements.

A re-sync removes staleness's evidence along with its cause: after one, the batches are
fresh and their ESS is high until the lag builds back. So under dlc's handling, a negligible
step counts towards switching off only when its batch is at least as many versions stale
as the last material one was (the lag has built back and no longer matters); a fresher one
is no evidence either way. Staleness at float rounding (no lag at all) always counts.

Pure: no tensors, no processes. `Controller.observe` takes one step's logged row;
tether.loops.autocorrect applies the choices to a run, tether.api and the TRL plug-in
to any loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tether.advice import (
    EVIDENCE_KEYS,
    ROUTING_SHARE,
    Evidence,
    evidence_from_rows,
    numerical_finding,
    staleness_finding,
)
from tether.estimators import Estimator, build_estimator
from tether.estimators.registry import OBJECTIVES

ON_AFTER = 3  # k: steps calling for a correction (in a row, or of the last w) to switch it on
OFF_AFTER = 6  # m: consecutive steps calling for none before it is switched off

# The choices, in the order of their codes in the metrics (auto/numerical, auto/staleness).
NUMERICAL = ("none", "cis", "icepop", "center")
STALENESS = ("plain", "dlc")


@dataclass
class Switch:
    """One cause's active choice under the hysteresis rule: `update` with the step's target."""

    active: str
    recent: list[str] = field(default_factory=list)  # the last targets since the last change
    quiet: int = 0  # consecutive steps calling for none

    def update(self, target: str | None, off: str, on_after: int, off_after: int,
               window: int) -> bool:
        """The step's target choice; True when the active choice changed. Turning to `off`
        needs `off_after` consecutive steps; any other choice, `on_after` of the last `window`
        steps since the last change (from off: calling for any correction, the kind the most
        called for, the latest on a tie). `target` None: the step is no evidence either way."""
        if target is None:
            return False
        self.recent = (self.recent + [target])[-window:]
        self.quiet = self.quiet + 1 if target == off else 0
        new = off if self.active != off and self.quiet >= off_after else self._called_for(off, on_after)
        if new is None:
            return False
        self.active, self.recent, self.quiet = new, [], 0
        return True

    def _called_for(self, off: str, on_after: int) -> str | None:
        """The correction the window calls for instead of the active one, if any."""
        called = [t for t in self.recent if t != off]
        if self.active == off:
            if len(called) < on_after:
                return None
            return max(reversed(called), key=called.count)  # the most called for, latest first
        others = [t for t in called if t != self.active and called.count(t) >= on_after]
        return others[-1] if others else None


@dataclass(frozen=True)
class Change:
    """A switch: after `step` (1-based, the step whose figures completed the streak), from the
    next step on."""

    step: int
    cause: str
    old: str
    new: str
    evidence: str  # the finding's figures and threshold

    @property
    def line(self) -> str:
        return (f"tether: auto: {self.cause} {self.old} -> {self.new} from step {self.step + 1} "
                f"({self.evidence})")


def targets(e: Evidence | None) -> tuple[str, str, dict[str, str]]:
    """The choice each cause calls for on one step's evidence, and each finding's line."""
    if e is None:  # nothing logged this step: no evidence for a correction
        return "none", "plain", {}
    num, stale = numerical_finding(e), staleness_finding(e)
    numerical = "none"
    if num.level == "material":
        moved = e.routing_any is not None and e.routing_any > ROUTING_SHARE
        numerical = "icepop" if e.heavy or moved else "cis"
    staleness = "dlc" if stale.level == "material" else "plain"
    return numerical, staleness, {"numerical": num.line, "staleness": stale.line}


@dataclass
class Controller:
    """Both causes' switches. `observe(row, step)` after each step; `numerical` and
    `staleness` are the choices in force for the next one."""

    batch: int  # N: responses per optimizer step (the numerical 1/N bar)
    on_after: int = ON_AFTER
    off_after: int = OFF_AFTER
    window: int | None = None  # w: count k over the last w steps; None: k in a row (w = k)
    pool: int | None = None  # judge each step on the last `pool` steps' rows pooled; None: its own
    num: Switch = field(default_factory=lambda: Switch("none"))
    stale: Switch = field(default_factory=lambda: Switch("plain"))
    stale_versions: float | None = None  # how stale (versions) the last material batch was
    evidence: dict[str, float] = field(default_factory=dict)  # the last step's, for its row
    pooled: list[dict[str, float]] = field(default_factory=list)  # the rows `pool` judges

    def __post_init__(self) -> None:
        problem = window_problem(self.on_after, self.window)
        if problem:
            raise ValueError(f"auto: on_after={problem}")
        if self.pool is not None and self.pool < 1:
            raise ValueError(f"auto: pool={self.pool} must be at least 1 step")

    @property
    def numerical(self) -> str:
        return self.num.active

    @property
    def staleness(self) -> str:
        return self.stale.active

    def observe(self, row: dict[str, Any], step: int) -> list[Change]:
        """One step's logged metrics (1-based `step`); the switches they completed."""
        self.pooled = (self.pooled + [_evidence_of(row)])[-(self.pool or 1):]
        e = evidence_from_rows(self.pooled, self.batch)
        numerical, staleness, lines = targets(e)
        staleness = self._staleness_evidence(staleness, row, e)
        self.evidence = _figures(e, self.batch)
        changes = []
        for cause, switch, target, off in (("numerical", self.num, numerical, "none"),
                                           ("staleness", self.stale, staleness, "plain")):
            old = switch.active
            if switch.update(target, off, self.on_after, self.off_after,
                             self.window or self.on_after):
                changes.append(Change(step, cause, old, switch.active, lines.get(cause, "")))
        return changes

    def _staleness_evidence(self, target: str, row: dict[str, Any],
                            e: Evidence | None) -> str | None:
        """A re-sync removes staleness's evidence with its cause until the lag builds back:
        under dlc's handling, a negligible batch fresher (in versions) than the last material one
        tells nothing (None). Staleness at float rounding (no lag at all) still counts."""
        versions = _versions(row)
        if target == "dlc":
            self.stale_versions = versions
            return target
        fresher = (versions is not None and self.stale_versions is not None
                   and versions < self.stale_versions)
        lagging = e is not None and staleness_finding(e).level == "negligible"
        return None if self.stale.active == "dlc" and fresher and lagging else target

    def state_dict(self) -> dict[str, Any]:
        return {"num": asdict(self.num), "stale": asdict(self.stale),
                "stale_versions": self.stale_versions, "pooled": self.pooled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num, self.stale = Switch(**state["num"]), Switch(**state["stale"])
        self.stale_versions = state["stale_versions"]
        self.pooled = state.get("pooled", [])  # absent: a checkpoint from before `pool`


def window_problem(on_after: int, window: int | None) -> str | None:
    """Why k = `on_after` steps can never be counted in the last `window` (None: k in a row,
    always possible); None when they can. The config names its key before it."""
    if window is None or 1 <= on_after <= window:
        return None
    return f"{on_after} steps of the last window={window} can never be counted: set k <= w"


def _evidence_of(row: dict[str, Any]) -> dict[str, float]:
    """What `pool` keeps of a row: the metrics evidence_from_rows reads (EVIDENCE_KEYS)."""
    return {k: row[k] for k in EVIDENCE_KEYS if k in row}


def _versions(row: dict[str, Any]) -> float | None:
    """How many versions behind the trainer the step's batch was sampled (its oldest token):
    the async loop's max, else the synchronous loop's (and TRL's) batch figure."""
    for key in ("staleness/versions/max", "staleness/versions/batch"):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None


def _figures(e: Evidence | None, batch: int) -> dict[str, float]:
    """The evidence behind a step's targets, as metrics (docs/metrics.md, auto/*)."""
    if e is None:
        return {}
    out = {"auto/numerical/chi2_seq": e.numerical_chi2_seq, "auto/numerical/bar": 1.0 / batch,
           "auto/numerical/heavy": float(e.heavy)}
    if e.ess is not None:
        out["auto/staleness/ess"] = e.ess
    return out


# --- what a choice trains with --------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    """The user's estimator under auto: its objective and parameters are kept; the correction
    and centering are auto's. `check` says why an estimator cannot be one."""

    objective: str
    params: dict[str, Any]

    @classmethod
    def of(cls, estimator: str, params: dict[str, Any]) -> Base:
        e = build_estimator(estimator, **params)
        problem = cls.check(e)
        if problem:
            raise ValueError(problem)
        return cls(e.objective.name, dict(e.params))

    @staticmethod
    def check(e: Estimator) -> str | None:
        if e.correction.name != "none" or e.centering:
            return (f"train.correction=auto chooses the correction itself: train.estimator must "
                    f"name an objective without one (grpo, gspo, sapo, cispo, vespo, naive, or "
                    f"an objective such as ppo), not {e.name!r}")
        if e.objective.corrects == "both":
            return (f"train.correction=auto: {e.name!r} already weights the numerical ratio in "
                    "its objective; use grpo, gspo, sapo, cispo, vespo or naive")
        return None

    @property
    def can_center(self) -> bool:
        """Whether the objective (or stale_is, which auto substitutes) has a top-K head weight."""
        return OBJECTIVES.get(self._objective("dlc")).head_weight is not None

    def estimator(self, numerical: str, staleness: str) -> Estimator:
        """The estimator of a choice: `numerical` in NUMERICAL ("center" only with staleness
        handled), `staleness` in STALENESS."""
        objective = self._objective(staleness)
        params = self.params if objective == self.objective else {"agg": self.params["agg"]}
        if numerical == "center":
            return build_estimator(objective=objective, centering=True, **params)
        return build_estimator(objective=objective, correction=numerical, **params)

    def _objective(self, staleness: str) -> str:
        """The user's objective, or stale_is where staleness is handled and the objective has
        no ratio pi_theta / pi_old of its own (pg)."""
        if staleness == "dlc" and OBJECTIVES.get(self.objective).corrects == "neither":
            return "stale_is"
        return self.objective


# --- what a run chose -------------------------------------------------------------------------


def timeline(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, str]]]:
    """Per cause, the spans of steps (first, last, choice) from a run's auto/* metrics."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for cause, names in (("numerical", NUMERICAL), ("staleness", STALENESS)):
        spans: list[tuple[int, int, str]] = []
        for r in rows:
            if f"auto/{cause}" not in r:
                continue
            name = names[int(r[f"auto/{cause}"])]
            if spans and spans[-1][2] == name:
                spans[-1] = (spans[-1][0], r["step"], name)
            else:
                spans.append((r["step"], r["step"], name))
        if spans:
            out[cause] = spans
    return out


def format_timeline(rows: list[dict[str, Any]]) -> str | None:
    """What auto chose, cause by cause, as step spans; None for a run without auto."""
    spans = timeline(rows)
    if not spans:
        return None
    lines = ["what train.correction=auto trained with, by step:"]
    for cause, runs in spans.items():
        lines.append(f"  {cause:<10} " + ", ".join(
            f"{name} {a}" if a == b else f"{name} {a}-{b}" for a, b, name in runs))
    return "\n".join(lines)
