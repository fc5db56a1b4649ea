"""E-AUTO (issue 72): does the correction chosen online (`train.correction=auto`) do as well as
the best fixed preset in each scenario, and better than any one preset over all of them?

Scenarios, on E-DLC's calibrated testbed (dense tiny model, warm start 900, 60 steps of
32 x 8 at lr 2e-4):
1. `exact`: fp32 generator, lag 0. Nothing is material.
2. `fp8_lag32`: fp8 generator 32 versions behind. Staleness is material (fp8 alone moved no
   method in E-DLC, and its per-step chi2 stays under 1/N).
3. `noise`: fp32 generator with Student-t logit noise (scale 0.12, dof 3: E-CIS's injected
   generator), lag 0. The numerical mismatch is material and heavy-tailed.
4. `fp8_lag32_from30`: fp8 generator whose updates stop arriving after step 30 (`sync.lag=32`,
   `sync.lag_from=30`): on-policy for the first half, its weights 0-30 versions old in the
   second. A choice fixed at the start is wrong for one half.
5. `fp8_async32`: the asynchronous race, fp8, one rollout worker, eta = 32.

Methods: the fixed presets naive, tis, cis and dlc, and `auto` (grpo's objective, ppo, with
`train.correction=auto`: plain grpo while nothing is material, cis or icepop for the
numerical part, and for staleness DLC's handling, centering under grpo's clipped ratio (the
form of E-DLC's dlc_clip), with the ESS re-sync at 0.5 armed throughout). Each runs with its own sync
policy: every:1 (async: bounded:32, publishing lazily), dlc ess:0.5 (async: with the ESS
window and after_trip=regenerate, issue 28's best). The on-policy reference is exact x naive,
5 seeds; the others 3.

What it simplifies, to fit 65 minutes on 2 cores: exact x tis and exact x cis are not run.
At fp32 with lag 0 both weights are 1 to rounding (numerical k3 ~1e-13) and one optimizer
step per batch keeps the PPO ratio at 1, inside the clip: their gradient is naive's, so
their rows are naive's (`ALIASES`).

Verdicts (`extend`), each computed from its bar:
- per scenario, auto's last-3 mean within (or above) the 95% interval of the best fixed
  preset's last-3 mean (bootstrap over seeds);
- the worst case: auto's lowest last-3 ratio to the reference over the scenarios, at least
  every fixed preset's lowest;
- scenario 4: auto above every preset that was cheap at its start (no re-sync, no top-K:
  naive, tis, cis), with the interval of each difference;
- scenario 1: auto applied no correction, no re-sync and requested no top-K in any step.
"""

from __future__ import annotations

import numpy as np

from tether.experiments.analysis import cell_rows
from tether.experiments.runner import EVAL_SEED, Cell, Experiment
from tether.experiments.verdicts import contrast, interval_verdict, seed_values

QUESTION = ("Does the correction chosen online from the measured causes match the best fixed "
            "preset in each scenario, and beat every fixed preset over all of them?")

TASK = ["task.use_all=true", "task.format_weight=0.1"]
WARMSTART_STEPS, LR, STEPS, LAG, SWITCH = 900, 2e-4, 60, 32, 30  # E-DLC's testbed
NOISE = ["rollout.logit_noise=0.12", "rollout.logit_noise_dof=3"]  # E-CIS's injected generator
PRESETS = ("naive", "tis", "cis", "dlc")
CHEAP = ("naive", "tis", "cis")  # no re-sync, no top-K: cheap at the start of scenario 4
METHODS = {"naive": ["train.estimator=naive"], "tis": ["train.estimator=tis"],
           "cis": ["train.estimator=cis"], "dlc": ["train.estimator=dlc"],
           "auto": ["train.estimator=grpo", "train.correction=auto"]}
# Not run: the same gradient as naive's (module docstring); their rows are naive's.
ALIASES = {("exact", "tis"): ("exact", "naive"), ("exact", "cis"): ("exact", "naive")}
REFERENCE_SEEDS = 5


def scenarios(lag: int, switch: int) -> dict[str, list[str]]:
    return {
        "exact": ["rollout.precision=fp32", "sync.lag=0"],
        f"fp8_lag{lag}": ["rollout.precision=fp8", f"sync.lag={lag}"],
        "noise": ["rollout.precision=fp32", "sync.lag=0", *NOISE],
        f"fp8_lag{lag}_from{switch}": ["rollout.precision=fp8", f"sync.lag={lag}",
                                       f"sync.lag_from={switch}"],
        f"fp8_async{lag}": ["rollout.precision=fp8", "sync.lag=0", "loop.mode=async",
                            "loop.workers=1", f"loop.max_staleness={lag}"],
    }


def method_overrides(scenario: str, method: str, lag: int) -> list[str]:
    """A method's keys and its sync policy in a scenario (module docstring)."""
    race = "async" in scenario
    if method == "dlc":
        return METHODS[method] + (["sync.policy=ess:0.5", "loop.window=ess",
                                   "loop.after_trip=regenerate"] if race else ["sync.policy=ess:0.5"])
    return METHODS[method] + [f"sync.policy=bounded:{lag}" if race else "sync.policy=every:1"]


def build(quick: bool = False, seeds: int | None = None) -> Experiment:
    if quick:
        lag, switch, n_seeds, n_ref = 2, 2, seeds or 1, seeds or 1
        base = TASK + ["model.warmstart_steps=120", "train.steps=4", "train.lr=5e-4",
                       "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "task.eval_size=16", "eval.every=2",
                       "eval.samples=2", "diagnostics.monitor_every=0", "run.checkpoint_every=0",
                       "train.auto_on_after=1", "train.auto_off_after=1"]
        plan = {"exact": ["naive", "auto"], f"fp8_lag{lag}_from{switch}": ["naive", "auto"],
                f"fp8_async{lag}": ["auto"]}
    else:
        lag, switch, n_seeds = LAG, SWITCH, seeds or 3
        n_ref = max(n_seeds, REFERENCE_SEEDS)
        base = TASK + [f"model.warmstart_steps={WARMSTART_STEPS}", f"train.steps={STEPS}",
                       f"train.lr={LR}", "rollout.prompts_per_step=32", "rollout.group_size=8",
                       "rollout.max_new_tokens=12", "eval.every=5", "eval.samples=4",
                       f"eval.seed={EVAL_SEED}", "diagnostics.monitor_every=0",
                       "run.checkpoint_every=10"]
        every = [*PRESETS, "auto"]
        plan = {s: [m for m in every if (s, m) not in ALIASES] for s in scenarios(lag, switch)}
    scen = scenarios(lag, switch)
    cells = [Cell(s, m, seed, tuple(scen[s] + method_overrides(s, m, lag)))
             for seed in range(max(n_seeds, n_ref)) for s, methods in plan.items() for m in methods
             if seed < (n_ref if (s, m) == ("exact", "naive") else n_seeds)]
    notes = [f"lag k = {lag}; scenario 4's lag starts after step {switch}",
             f"on-policy reference: exact x naive (fp32 generator, lag 0, REINFORCE), {n_ref} seeds",
             "exact x tis and exact x cis are naive's rows (the same gradient; module docstring)",
             "auto: grpo's objective (ppo) with train.correction=auto (k = 3, m = 6 unless --set)",
             "sampled evaluations share their draws across cells (eval.seed)"]
    return Experiment("auto", QUESTION, base, cells, ("exact", "naive"), notes)


def _group(summary: dict, scenario: str, method: str) -> dict | None:
    scenario, method = ALIASES.get((scenario, method), (scenario, method))
    return next((g for g in summary["groups"]
                 if (g["scenario"], g["method"]) == (scenario, method)), None)


def _values(summary: dict, scenario: str, method: str) -> list[float]:
    scenario, method = ALIASES.get((scenario, method), (scenario, method))
    return [float(v) for v in seed_values(summary, scenario, method, "last3_trainer")]


def mean_interval(values: list[float], draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 95% bootstrap interval of the mean over seeds (nan under 2 seeds)."""
    if len(values) < 2:
        return float("nan"), float("nan")
    v = np.asarray(values)
    means = v[np.random.default_rng(seed).integers(0, len(v), (draws, len(v)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def extend(out, summary: dict) -> None:
    """Auto's timeline per cell, and the verdicts of the module docstring."""
    for name, c in summary["cells"].items():
        if c["method"] == "auto":
            c.update(auto_usage(cell_rows(out, name)))
    for g in summary["groups"]:
        if g["method"] == "auto":
            members = [c for c in summary["cells"].values()
                       if (c["scenario"], c["method"]) == (g["scenario"], "auto")]
            for key in ("corrected_steps", "dlc_steps", "centered_steps", "topk_steps",
                        "first_dlc_step"):
                vals = [m[key] for m in members if m.get(key) is not None]
                g[key] = float(np.mean(vals)) if vals else None
    summary["verdicts"] = verdicts(summary)


def auto_usage(rows: list[dict]) -> dict:
    """How many steps auto corrected the numerical part, handled staleness (dlc's handling),
    centered, requested top-K; the first step under dlc's handling."""
    steps = [r for r in rows if "auto/numerical" in r]
    handled = [r["step"] for r in steps if r["auto/staleness"] > 0]
    return {"corrected_steps": sum(r["auto/numerical"] > 0 for r in steps),
            "dlc_steps": len(handled), "centered_steps": sum(r["auto/numerical"] == 3 for r in steps),
            "topk_steps": sum(r.get("auto/topk", 0) > 0 for r in steps),
            "first_dlc_step": min(handled) if handled else None}


def verdicts(summary: dict) -> list[dict]:
    """One row per bar (module docstring): value, bar and the verdict computed from it."""
    scen = list(dict.fromkeys(c["scenario"] for c in summary["cells"].values()))
    ref = summary["reference_last3"]
    rows = []
    lowest: dict[str, tuple[float, str]] = {}  # over the scenarios where every method ran
    for s in scen:
        fixed = {m: _values(summary, s, m) for m in PRESETS}
        fixed = {m: v for m, v in fixed.items() if v}
        auto = _values(summary, s, "auto")
        if len(fixed) == len(PRESETS) and auto and ref > 0:
            for m, v in [*fixed.items(), ("auto", auto)]:
                if float(np.mean(v)) / ref < lowest.get(m, (np.inf, ""))[0]:
                    lowest[m] = (float(np.mean(v)) / ref, s)
        if not fixed or not auto:
            continue
        best = max(fixed, key=lambda m: np.mean(fixed[m]))
        lo, hi = mean_interval(fixed[best])
        a = float(np.mean(auto))
        rows.append({"bar": f"{s}: auto within the best preset's 95% interval",
                     "value": f"auto {a:.3f}; best {best} {np.mean(fixed[best]):.3f} [{lo:.3f}, {hi:.3f}]",
                     "verdict": "n/a" if not np.isfinite(lo) else "met" if a >= lo else "not met"})
    if "auto" in lowest and len(lowest) > 1:
        worst, where = lowest["auto"]
        beaten = {m: v for m, v in lowest.items() if m != "auto" and v[0] > worst}
        rows.append({"bar": "worst case: auto's lowest ratio to the reference >= every preset's",
                     "value": "; ".join(f"{m} {v:.3f} ({w})" for m, (v, w) in lowest.items()),
                     "verdict": "met" if not beaten else
                     f"not met ({', '.join(beaten)} higher; auto's lowest is {where})"})
    switch = next((s for s in scen if "_from" in s), None)
    for m in CHEAP if switch else ():
        row = contrast(summary, switch, "auto", m)
        if row is None:
            continue
        lo, hi = row["difference_lo"], row["difference_hi"]
        rows.append({"bar": f"{switch}: auto above {m} (cheap at its start)",
                     "value": f"{row['difference']:+.4f} [{lo:.4f}, {hi:.4f}]",
                     "verdict": ("met" if row["difference"] > 0 else "not met") +
                     f" (interval: {interval_verdict(lo, hi, lambda v: v > 0)})"})
    exact = _group(summary, "exact", "auto")
    if exact is not None:
        cost = [exact.get(k) or 0.0 for k in ("corrected_steps", "dlc_steps", "topk_steps")]
        rows.append({"bar": "exact: auto applies no correction, no re-sync, no top-K",
                     "value": "corrected {:.0f}, dlc's handling {:.0f}, top-K {:.0f} steps".format(*cost)
                     + f"; re-syncs {exact['resyncs']:.0f}",
                     "verdict": "met" if not any(cost) and not exact["resyncs"] else "not met"})
    return rows


def tables(summary: dict) -> list[tuple[str, list[dict], list[tuple[str, str]]]]:
    title = ("The bars, each verdict computed from its figures (last-3 trainer-side means; "
             "intervals: 95% bootstrap over seeds):")
    return [(title, summary.get("verdicts", []),
             [("bar", "bar"), ("value", "value"), ("verdict", "verdict")])]


COLUMNS = [("scenario", "generator"), ("method", "method"), ("seeds", "seeds"),
           ("last3_trainer", "last-3 trainer-side"), ("last3_ratio", "last-3 × reference"),
           ("last3_dev_sigma", "last-3 dev (σ)"), ("final_accuracy", "final greedy acc"),
           ("resyncs", "re-syncs"), ("mean_staleness", "staleness (versions)"),
           ("min_ess", "min ESS"), ("numerical_k3", "numerical k3"),
           ("corrected_steps", "auto: steps corrected"), ("dlc_steps", "auto: steps under dlc"),
           ("centered_steps", "auto: steps centered"), ("first_dlc_step", "auto: dlc from step"),
           ("collapsed_trainer", "collapsed seeds"), ("wall_seconds", "cell s")]
