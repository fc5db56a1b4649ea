"""Verdicts read from intervals (issue 29): a bar is met only when its whole 95% bootstrap
interval over seeds passes it, and two groups differ only when the interval of their
difference excludes 0. The experiments' claims and controls tables are built from these."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tether.experiments.analysis import bootstrap_ci


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


def contrast(summary: dict, scenario: str, a: str, b: str, key: str = "last3_trainer") -> dict | None:
    """Methods a - b in one scenario: the difference of their seed means of a per-cell `key`,
    its 95% bootstrap interval over seeds, the same in the reference's sigma, and which side the
    interval puts higher. None when either group has no finished cell."""
    va, vb = (seed_values(summary, scenario, m, key) for m in (a, b))
    if not va or not vb:
        return None
    diff, sigma = float(np.mean(va) - np.mean(vb)), summary["reference_last3_sigma"]
    lo, hi = bootstrap_ci(va, vb, lambda x, y: x.mean(-1) - y.mean(-1))  # row-wise over resamples
    return {"scenario": scenario, "a": a, "b": b, "difference": diff, "difference_lo": lo,
            "difference_hi": hi, "difference_sigma": diff / sigma if sigma > 0 else float("nan"),
            "verdict": (f"{a} higher" if lo > 0 else f"{b} higher" if hi < 0
                        else f"not resolved at {min(len(va), len(vb))} seeds")}
