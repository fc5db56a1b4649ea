"""Verdicts read from intervals (issue 29): a bar is met only when its whole 95% bootstrap
interval over seeds passes it, and two groups differ only when the interval of their
difference excludes 0. The experiments' claims and controls tables are built from these.

Contrasts are paired (issue 73): a method's cell at seed s shares with every other cell at
seed s the run seed (so the prompt order and the sampling streams) and, through
`eval.seed`, the evaluation draws. A contrast therefore keeps the seeds both groups
finished and bootstraps the seeds jointly, so the spread that is common to both runs of a
seed cancels. The asynchronous race is paired in those too, but not in its timing, which
the machine decides. The power of a contrast is read from the same pairs: with per-seed
differences of sample standard deviation sd, a 95% interval on their mean is about
+-Z sd / sqrt(n) wide (normal approximation), so `seeds_needed(sd, h)` = ceil((Z sd / h)^2)
seeds bring it to +-h: h = |effect| to exclude 0 at the effect observed, h = HALF_WIDTH to
resolve the smallest effect worth reporting here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tether.experiments.analysis import bootstrap_ci

Z = 1.959964  # the normal quantile of analysis.CI_LEVEL (0.95), two-sided
HALF_WIDTH = 0.01  # accuracy: the smallest effect worth reporting on this testbed (issue 73)


def interval_verdict(lo: float, hi: float, holds: Callable[[float], bool]) -> str:
    """A bar read from a 95% interval: 'met' when all of it holds, 'not met' when none does."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    return "met" if holds(lo) and holds(hi) else "not met" if not (holds(lo) or holds(hi)) else "unresolved"


def interval_text(lo: float, hi: float, spec: str = ".2f") -> str:
    """`[lo, hi]` in `spec`, or why there is none: the bootstrap needs 2 seeds on each side
    (a group with one seed, or with no N = 1 twin, has none)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "(no interval: under 2 seeds a side)"
    return f"[{lo:{spec}}, {hi:{spec}}]"


def all_met(*verdicts: str) -> str:
    """Bars that must all hold: 'met' when every one is, 'not met' when any one is not."""
    return "met" if all(v == "met" for v in verdicts) else "not met" if "not met" in verdicts else "unresolved"


def seed_names(summary: dict, scenario: str, method: str) -> list[str]:
    """The finished cells of one group, by name."""
    return [n for n, c in summary["cells"].items() if (c["scenario"], c["method"]) == (scenario, method)]


def seed_values(summary: dict, scenario: str, method: str, key: str) -> list:
    """A per-cell number of one group, one entry per finished seed."""
    return [summary["cells"][n][key] for n in seed_names(summary, scenario, method)]


def paired(summary: dict, a: tuple[str, str], b: tuple[str, str],
           key: str = "last3_trainer") -> tuple[np.ndarray, np.ndarray]:
    """Groups a and b ((scenario, method) each): their per-cell `key` on the seeds both
    finished, aligned by seed (module docstring: what a seed shares)."""
    def by_seed(group: tuple[str, str]) -> dict[int, float]:
        return {c["seed"]: c[key] for c in summary["cells"].values()
                if (c["scenario"], c["method"]) == tuple(group)}
    va, vb = by_seed(a), by_seed(b)
    seeds = sorted(set(va) & set(vb))
    return np.array([va[s] for s in seeds], dtype=float), np.array([vb[s] for s in seeds], dtype=float)


def seeds_needed(sd: float, half_width: float) -> int | None:
    """Seeds for the 95% interval of a paired mean with per-seed sd `sd` to be +-half_width
    wide (module docstring); None when either is not a number or the width is nil (an effect
    of 0, up to rounding, is decided by no number of seeds)."""
    if not (math.isfinite(sd) and math.isfinite(half_width)) or half_width <= 1e-9:
        return None
    return max(2, math.ceil((Z * sd / half_width) ** 2))


def power(d: np.ndarray) -> dict:
    """What the paired differences `d` say about seeds: their sd, and the seeds an interval
    needs to exclude 0 at the mean observed (`needs_zero`) and to be +-HALF_WIDTH
    (`needs_half`)."""
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else float("nan")
    effect = float(np.mean(d)) if len(d) else float("nan")
    return {"sd_paired": sd, "seeds_run": len(d), "needs_zero": seeds_needed(sd, abs(effect)),
            "needs_half": seeds_needed(sd, HALF_WIDTH)}


def unresolved(n: int, needs: int | None) -> str:
    return f"not resolved at {n} seeds" + (f" (needs ~{needs})" if needs else "")


def contrast(summary: dict, scenario: str, a: str, b: str, key: str = "last3_trainer") -> dict | None:
    """Methods a - b in one scenario, paired by seed: the mean of the per-seed differences of
    `key`, its 95% bootstrap interval over seeds, the same in the reference's sigma, which side
    the interval puts higher, and the power figures (`power`). None when either group has no
    finished cell."""
    if not seed_values(summary, scenario, a, key) or not seed_values(summary, scenario, b, key):
        return None
    va, vb = paired(summary, (scenario, a), (scenario, b), key)
    diff, sigma = float(np.mean(va - vb)) if len(va) else float("nan"), summary["reference_last3_sigma"]
    lo, hi = bootstrap_ci(va, vb, lambda x, y: x.mean(-1) - y.mean(-1), paired=True)
    pw = power(va - vb)
    return {"scenario": scenario, "a": a, "b": b, "difference": diff, "difference_lo": lo,
            "difference_hi": hi, "difference_sigma": diff / sigma if sigma > 0 else float("nan"), **pw,
            "verdict": (f"{a} higher" if lo > 0 else f"{b} higher" if hi < 0
                        else unresolved(len(va), pw["needs_zero"]))}
