"""E-VESPO (DESIGN.md section 7): which objective survives N stale optimizer steps per batch?

A `Protocol` holds a testbed's numbers (task, the Ns, optimizer steps, evaluation cadence,
mini-batch, lr, seeds); DEFAULT is the matrix below, SWEEP the long N sweep that
`scripts/vespo_sweep.py` runs (issue 30), CHAIN its long-response sweep (`--task chain`).

The paper's protocol (its scripts: optimizer mini-batch 256, rollout batch 256 x N, lr 1e-6,
8 samples per prompt), scaled to the tiny testbed:
1. A fixed optimizer mini-batch of MINIBATCH_PROMPTS = 16 prompts x GROUP = 8 samples = 128
   responses; a rollout batch of N mini-batches (`rollout.prompts_per_step=16N`,
   `train.minibatches=N`). The i-th mini-batch is trained i versions after it was sampled,
   so a larger N means more stale updates on the same-size mini-batch, not smaller, noisier
   ones. (4 x 8 was tried first: the on-policy reference lost accuracy at every lr tried,
   its few groups with a correct answer too few for Adam's steps; docs/experiments.md,
   "E-VESPO's testbed".)
2. The same number of optimizer steps for every N: `opt_steps` = 128, so `train.steps` (rollout
   batches) = 128 / N: N = 1 trains on 128 batches, N = 64 on 2.
3. Trainer-side evaluation every `eval_every` = 64 optimizer steps for every N (or every
   N, when N is larger: a rollout batch is the finest cadence) (`eval.every` =
   64 / N rollout batches; checkpoints on the same cadence): at versions 0, 64 and 128, held
   out and sampled like the rollouts (`eval.samples=4`: `eval/accuracy_sampled`,
   `eval/reward_sampled`). The headline and the collapse test read these (analysis
   `trainer_headline`); the report's curves put optimizer steps (`version`) on the x axis.
4. Responses long enough for sequence weights to matter: Countdown whose answer writes its
   steps (`task.answer=steps`, 4 numbers: 3 steps, 20.5 tokens on average with eos,
   `rollout.max_new_tokens=48`; configs/countdown_steps.yaml), from a cached 1200-step warm
   start on it (held-out accuracy 0.21 greedy, 0.18-0.20 sampled). The 5-number task
   (27 tokens) started at 0.07 sampled, where the reference did not learn. `task="chain"`
   is the long-response testbed instead (configs/chain.yaml: 60-111 tokens, where the
   length normalisations differ; a 360-step warm start, sampled held-out 0.70).
5. W = prod pi_theta/pi_old, without rho, as the paper's scripts (the `vespo` default); the
   generator is fp32, so rho = 1 anyway: all the mismatch here is staleness.
6. Collapse, read at the largest N: the final trainer-side value below half its best
   (`collapsed_trainer`; the generator-side batch reward has only 2 points at N = 64).
   The lowest trainer-side value (`lowest_trainer`) shows a fall that recovers by the end.
   Retention: a method's last-3 trainer-side mean over its N = 1 twin's (`vs_n1`, with a
   95% bootstrap interval over both sides' seeds) and the seeds that keep >= 80% of it
   (`kept_80`).

At N = 1, pi_old is the training forward itself (r = W = 1 exactly) and the six objectives
are two gradients (tests/estimators, `test_on_policy_the_vespo_objectives_are_two_gradients`):
the token-mean policy gradient (grpo; vespo with any length_norm, phi(1) = 1) and its
per-sequence mean (gspo, sapo). N = 1 runs one of each (N1_TWIN), as E-DLC skips identical
cells. Matrix: N1 x {grpo (the reference, 5 seeds), sapo (3)} + N64 x {grpo, gspo, sapo,
vespo, vespo / T, vespo / sqrt T} x 3 seeds = 26 cells.

What it cuts to fit 60 minutes on 2 cores (the runner's 2 cells at a time, one thread each).
Measured with two cells sharing the 2 cores: 1.17 s per optimizer step at N = 1, a cell
165-190 s; an N = 64 cell 255-300 s (a batch of 8192 responses generates in 55 s); about
8 s per evaluation. 8 x 180 + 18 x 280 = 6480 cell-seconds, 54 minutes on 2 workers.
- N in {1, 64}: the ends (on-policy and the paper's largest N); N = 8 would add 18 cells
  (about 30 minutes). `--only` adds no new N; a wider sweep is SWEEP's (scripts/vespo_sweep.py).
- 128 optimizer steps (N = 64 sees 2 rollout batches) and 3 trainer-side evaluations.
- No MoE routing-replay (R2) rows: the MoE model would need its own warm start on the
  steps task and its rows more cells; they do not fit.
- The learning rate: LR's comment.
- Each cell's N keys (`train.steps`, `eval.every`, ...) apply after `--set`: a Protocol's
  numbers change here (or in scripts/vespo_sweep.py), not with `--set train.steps=...`.

Beside the default (`Experiment.extra`, run with `--only`, and in SWEEP):
- the (k, lambda) ablation at the largest N: `vespo_flat` (k = lambda = 0, phi = 1: the
  same objective with no weight at all) and `vespo_narrow` (both 4x: the same peaks,
  k / lambda, at a quarter of the width);
- the race: an fp8 generator in the asynchronous loop (one rollout worker, admission bound
  eta = RACE_ETA) at N = RACE_N (a Protocol's race_n and race_eta set a harder one), where
  grpo, sapo, vespo and `vespo_rho` (W = prod pi_theta / mu: `include_rho`, as the paper's
  fully-async script feeds the rollout log-probs in as pi_old) train on what the race gives.
`claims` computes the paper's three claims' verdicts, and whether the ablated (k, lambda)
matter, from the 95% intervals (`tables` prints them in `tether report`);
`diagnostics.seq_weights` logs log W and phi(W) quantiles every step, which the report's
distribution table reads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tether.errors import InputError
from tether.experiments.analysis import bootstrap_ci, cell_rows, ratio, series
from tether.experiments.runner import EVAL_SEED, Cell, Experiment
from tether.experiments.verdicts import (
    all_met,
    contrast,
    interval_text,
    interval_verdict,
    seed_names,
    seed_values,
)

QUESTION = ("With a fixed optimizer mini-batch and N of them per rollout batch (more stale "
            "updates as N grows), which objective keeps the trained policy's reward, and does "
            "VESPO stay stable to N = {top} without length normalisation?")

# The issue asks for a per-version token k3 of about 1e-3 (scripts/vespo-calibrate-lr.sh):
# 1.5e-4 gives 8.2e-4, but there the on-policy reference loses accuracy (0.182 -> 0.168, 5
# seeds). 1e-4 is the largest lr tried at which it still gains (-> 0.207, +0.025; k3 3.7e-4);
# 5e-5 meets the +0.03 bar (-> 0.226) at k3 1.3e-4. docs/experiments.md has the table.
LR = 1e-4
WARMSTART_STEPS = 1200
CHAIN_WARMSTART_STEPS = 360  # sampled held-out 0.70; 240 gave 0.04, 600 0.95 (docs/experiments.md)
CHAIN_LR = 4e-5  # per-version k3 1.2e-4; the reference gains +0.034 in 256 steps (docs/experiments.md)

# The testbeds' task keys and their cached warm starts, with a correctness-only reward, as the
# paper's: at format_weight 0.1 the on-policy reference traded correct chains for well-formed
# misses (docs/experiments.md, "E-VESPO's testbed").
TASKS = {
    "steps": [f"model.warmstart_steps={WARMSTART_STEPS}", "task.answer=steps", "task.num_numbers=4",
              "task.use_all=true", "task.format_weight=0", "rollout.max_new_tokens=48"],
    "chain": [f"model.warmstart_steps={CHAIN_WARMSTART_STEPS}", "task.name=chain",
              "task.format_weight=0", "rollout.max_new_tokens=120"],
}
METHODS = {
    "grpo": ["train.estimator=grpo"],
    "gspo": ["train.estimator=gspo"],
    "sapo": ["train.estimator=sapo"],
    "vespo": ["train.estimator=vespo"],
    "vespo_T": ["train.estimator=vespo", "train.estimator_params={length_norm: T}"],
    "vespo_sqrtT": ["train.estimator=vespo", "train.estimator_params={length_norm: sqrtT}"],
    # The (k, lambda) ablation: no weight at all (phi = 1), and the paper's peaks 4x narrower.
    "vespo_flat": ["train.estimator=vespo",
                   "train.estimator_params={k_pos: 0, lam_pos: 0, k_neg: 0, lam_neg: 0}"],
    "vespo_narrow": ["train.estimator=vespo",
                     "train.estimator_params={k_pos: 8, lam_pos: 12, k_neg: 12, lam_neg: 8}"],
    "vespo_rho": ["train.estimator=vespo", "train.estimator_params={include_rho: true}"],
}
# The method whose N = 1 run stands for each method's (module docstring): the same gradient.
# vespo_rho's is grpo's too: at N = 1 on an exact generator rho = 1 and W = 1.
N1_TWIN = {"grpo": "grpo", "vespo": "grpo", "vespo_T": "grpo", "vespo_sqrtT": "grpo",
           "vespo_flat": "grpo", "vespo_narrow": "grpo", "vespo_rho": "grpo",
           "gspo": "sapo", "sapo": "sapo"}
KEEP = 0.8  # retention bar: a seed keeps >= 80% of its N = 1 twin's last-3 mean
BASELINES = ("grpo", "gspo", "sapo")  # the objectives the paper says degrade as N grows
NORMALISED = ("vespo_T", "vespo_sqrtT")  # the length normalisations it says destabilise
ABLATION = ("vespo_flat", "vespo_narrow")
RACE_METHODS = ("grpo", "sapo", "vespo", "vespo_rho")
RACE_N, RACE_ETA = 4, 4  # the race's defaults: N mini-batches per rollout batch, admission bound eta

CURVE_X = "version"  # the report's curves: optimizer steps, comparable across N
CURVE_POINTS = 9  # the report's curve table: at most this many optimizer steps, first and last kept


@dataclass(frozen=True)
class Protocol:
    """One testbed's numbers (module docstring)."""

    task: str = "steps"  # a TASKS key
    ns: tuple[int, ...] = (1, 64)
    opt_steps: int = 128  # optimizer steps for every N (train.steps = opt_steps / N)
    eval_every: int = 64  # trainer-side evaluation every this many optimizer steps (or N)
    prompts: int = 16  # prompts per optimizer mini-batch
    group: int = 8  # samples per prompt (the paper's 8)
    lr: float = LR
    seeds: int = 3
    reference_seeds: int = 5  # the N1 x grpo reference: sigma needs more seeds than a claim
    methods: tuple[str, ...] = ("grpo", "gspo", "sapo", "vespo", "vespo_T", "vespo_sqrtT")
    extra_methods: tuple[str, ...] = ABLATION  # at the largest N, outside the default
    race: bool = False  # the race rows in the matrix itself (else in `extra`)
    race_n: int = RACE_N  # the race's N (at most the largest of `ns`)
    race_eta: int = RACE_ETA  # the race's admission bound
    seq_weights: bool = False  # diagnostics.seq_weights: log W and phi(W) quantiles per step


DEFAULT = Protocol()
# The issue-30 sweep: every N from the paper's README, 512 optimizer steps, evaluation every
# 16 of them, a 32 x 8 mini-batch, the ablation and the race in the matrix.
SWEEP = Protocol(ns=(1, 4, 8, 16, 64), opt_steps=512, eval_every=16, prompts=32, race=True,
                 seq_weights=True)
# The long-response sweep on chains (60-111 tokens, where /T and /sqrt T differ most from the
# true product): N in {1, 16}, the length normalisations and grpo, at CHAIN_LR, and 256
# optimizer steps, as a chain step costs several Countdown steps (docs/experiments.md).
CHAIN = replace(SWEEP, task="chain", ns=(1, 16), opt_steps=256, lr=CHAIN_LR, reference_seeds=3,
                methods=("grpo", "vespo", "vespo_T", "vespo_sqrtT"), extra_methods=(), race=False)
SWEEPS = {p.task: p for p in (SWEEP, CHAIN)}  # scripts/vespo_sweep.py --task: each testbed's sweep


def staleness_keys(n: int, prompts: int, opt_steps: int, eval_every: int) -> list[str]:
    """Scenario N: a rollout batch of N mini-batches of `prompts` prompts, `opt_steps`
    optimizer steps in all, evaluation and checkpoints every max(`eval_every`, N) optimizer
    steps (a rollout batch is the finest cadence)."""
    every = max(eval_every, n)
    if opt_steps % n or every % n:
        raise ValueError(f"N={n} must divide opt_steps={opt_steps} and eval_every={every}")
    return [f"rollout.prompts_per_step={prompts * n}", f"train.minibatches={n}",
            f"train.steps={opt_steps // n}", f"eval.every={every // n}",
            f"run.checkpoint_every={every // n}"]


def race_keys(eta: int) -> list[str]:
    """The race: an fp8 generator in the asynchronous loop, one rollout worker, at most eta
    versions behind (what the race gives, on top of each mini-batch's own N staleness)."""
    return ["rollout.precision=fp8", "loop.mode=async", "loop.workers=1",
            f"loop.max_staleness={eta}"]


def race_scenario(n: int, eta: int) -> str:
    """`N4_race`, or `N16_race_eta32` away from the default bound: a harder race is its own
    group, so a resumed run never takes its cells for the default race's."""
    return f"N{n}_race" + ("" if eta == RACE_ETA else f"_eta{eta}")


def build(quick: bool = False, seeds: int | None = None, protocol: Protocol = DEFAULT) -> Experiment:
    p = protocol
    if quick:  # 2 prompts x 4 samples per mini-batch, 4 optimizer steps, 16 held-out problems
        p = replace(p, ns=(1, 4), methods=("grpo", "vespo"), extra_methods=(), race=False,
                    seeds=seeds or 1, reference_seeds=seeds or 1, group=4, prompts=2,
                    opt_steps=4, eval_every=4)
        # A smoke test, not a measurement: a short warm start unless --model gives one.
        extra = ["task.eval_size=16", "eval.samples=2", "model.warmstart_steps=20"]
    else:
        p = replace(p, seeds=seeds or p.seeds, reference_seeds=max(seeds or 0, p.reference_seeds))
        extra = ["eval.samples=4"]
    base = TASKS[p.task] + ["sync.policy=every:1", f"train.lr={p.lr:g}",
                            f"rollout.group_size={p.group}", f"eval.seed={EVAL_SEED}",
                            "diagnostics.monitor_every=0", *extra]
    if p.seq_weights:
        base.append("diagnostics.seq_weights=true")

    def keys(n: int) -> tuple[str, ...]:
        return tuple(staleness_keys(n, p.prompts, p.opt_steps, p.eval_every))

    def cells_of(groups: list[tuple[str, str, tuple[str, ...]]]) -> list[Cell]:
        return [Cell(scen, m, seed, k + tuple(METHODS[m]))
                for seed in range(max(p.seeds, p.reference_seeds)) for scen, m, k in groups
                if seed < (p.reference_seeds if (scen, m) == ("N1", "grpo") else p.seeds)]

    top, race_n = max(p.ns), min(p.race_n, max(p.ns))
    if p.race_eta < race_n:  # measured: N16 at eta 8 ran with staleness 0 versions
        raise InputError(
            f"race_eta={p.race_eta} is under the race's N={race_n}: a batch takes N versions, so "
            f"the admission rule keeps one batch in flight and the race never lags (a synchronous "
            f"run with an fp8 generator); use race_eta >= {race_n} ({race_n}: one batch ahead, "
            f"{2 * race_n}: two)")
    race_name = race_scenario(race_n, p.race_eta)
    main = [(f"N{n}", m, keys(n)) for n in p.ns for m in p.methods if n > 1 or N1_TWIN[m] == m]
    side = [(f"N{top}", m, keys(top)) for m in p.extra_methods]
    race = [(race_name, m, keys(race_n) + tuple(race_keys(p.race_eta))) for m in RACE_METHODS]
    cells = cells_of(main + side + race if p.race else main)
    notes = [(f"staleness N: a rollout batch of N optimizer mini-batches of {p.prompts} x {p.group} "
              f"responses; {p.opt_steps} optimizer steps for every N (train.steps = "
              f"{p.opt_steps}/N); task {p.task}, lr {p.lr:g}"),
             (f"trainer-side evaluation every max({p.eval_every}, N) optimizer steps; curves "
              "against optimizer steps (version)"),
             (f"reference for deviations: N1 x grpo, {p.reference_seeds} seeds; at N = 1 each "
              "objective is grpo's gradient or sapo's (N1_TWIN), so only those two run there"),
             ("collapse: final trainer-side value < half its best; retention: last-3 mean over "
              "the N = 1 twin's, 95% interval over seeds"),
             "vespo: W = prod pi_theta/pi_old, without rho, as the paper's scripts (vespo_rho: with it)",
             f"{race_name}: fp8 generator, asynchronous loop, 1 rollout worker, eta = {p.race_eta}"]
    return Experiment("vespo", QUESTION.format(top=top), base, cells, ("N1", "grpo"), notes,
                      extra=[] if quick or p.race else cells_of(side + race))


def extend(out: Path | None, summary: dict) -> None:
    """Add to each group its N = 1 twin (`n1_twin`), its last-3 trainer-side mean over the
    twin's (`vs_n1`, with a 95% bootstrap interval over both sides' seeds), the seeds whose
    last-3 mean keeps >= KEEP of it (`kept_80`); then the claims (`claims`) and, with an
    output directory, the sequence-weight quantiles (`weight_spread`)."""
    for g in summary["groups"]:
        twin = N1_TWIN.get(g["method"])
        ref = seed_values(summary, "N1", twin, "last3_trainer") if twin else []
        own = seed_values(summary, g["scenario"], g["method"], "last3_trainer")
        mean_ref = float(np.mean(ref)) if ref else float("nan")
        g["n1_twin"] = f"N1 {twin}" if ref else None
        g["vs_n1"] = float(np.mean(own)) / mean_ref if mean_ref > 0 else float("nan")
        g["vs_n1_lo"], g["vs_n1_hi"] = bootstrap_ci(own, ref, ratio) if ref else (float("nan"),) * 2
        g["kept_80"] = sum(v >= KEEP * mean_ref for v in own) if mean_ref > 0 else None
    summary["claims"] = claims(summary)
    if out is not None:
        summary["weight_spread"] = weight_spread(Path(out), summary)
        summary["curve"] = curve_table(Path(out), summary)


def _n(scenario: str) -> int:
    return int(scenario[1:].split("_")[0])


def _retention(g: dict | None) -> str:
    return "n/a" if g is None else interval_verdict(g["vs_n1_lo"], g["vs_n1_hi"], lambda v: v >= KEEP)


def _kept_text(method: str, g: dict) -> str:
    """`method 0.95× [lo, hi] (k collapsed)`: a group's retention, as a claim row quotes it."""
    return (f"{method} {g['vs_n1']:.2f}× {interval_text(g['vs_n1_lo'], g['vs_n1_hi'])} "
            f"({g['collapsed_trainer']} collapsed)")


def claims(summary: dict) -> list[dict]:
    """The paper's three claims, one row per N (> 1) or race, each verdict read from 95%
    intervals: (1) vespo keeps >= KEEP of its twin while every baseline that ran (grpo, gspo,
    sapo) does not, 'in part' when some of them keep it; (2) vespo - vespo_T and
    vespo - vespo_sqrtT (last-3) both > 0; (3) in the race, vespo and vespo_rho keep >= KEEP
    while grpo or sapo does not. Beside them, where the ABLATION ran: the (k, lambda) shape
    matters when vespo - each variant excludes 0, 'in part' for one of the two, and does not
    when each interval lies within +- the reference's last-3 sigma (a seed's noise)."""
    by = {(g["scenario"], g["method"]): g for g in summary["groups"]}
    sigma, rows = summary["reference_last3_sigma"], []
    for scen in dict.fromkeys(g["scenario"] for g in summary["groups"]):
        if _n(scen) == 1:
            continue
        race = "_race" in scen
        stable = ("vespo", "vespo_rho") if race else ("vespo",)
        degrade = [m for m in (("grpo", "sapo") if race else BASELINES) if (scen, m) in by]
        if all((scen, m) in by for m in stable) and degrade:
            keeps = [_retention(by[scen, m]) for m in stable]
            kept = [_retention(by[scen, m]) for m in degrade]
            flip = {"met": "not met", "not met": "met"}  # below KEEP: the retention bar's converse
            if race:  # its baselines are the control: one that drops (not all keep) is enough
                verdict = all_met(*keeps, flip.get(all_met(*kept), "unresolved"))
            else:  # the N sweep's shape is that the others collapse, all of them
                drops = [flip.get(v, "unresolved") for v in kept]
                verdict = all_met(*keeps, *drops)
                if verdict != "met" and all_met(*keeps) == "met" and "met" in drops:
                    verdict = "in part"  # vespo holds and a baseline falls, but not each one
            value = "; ".join(_kept_text(m, by[scen, m]) for m in (*stable, *degrade))
            rows.append({"claim": "vespo holds under mismatch and async" if race else
                         "vespo stable while grpo/gspo/sapo degrade as N grows", "scenario": scen,
                         "value": value, "bar": f"{'/'.join(stable)} ≥ {KEEP:g}× twin, and "
                         f"{'a baseline' if race else 'each baseline'} below it (95% intervals)",
                         "verdict": verdict})
        pairs = [contrast(summary, scen, "vespo", m) for m in NORMALISED]
        if not race and all(pairs):
            sides = [interval_verdict(c["difference_lo"], c["difference_hi"], lambda v: v > 0) for c in pairs]
            rows.append({"claim": "÷T and ÷√T destabilise", "scenario": scen, "value": _differences(pairs),
                         "bar": "vespo − each > 0 (last-3, 95% interval)", "verdict": all_met(*sides)})
        ablated = [contrast(summary, scen, "vespo", m) for m in ABLATION]
        if not race and all(ablated):
            apart = [c["difference_lo"] > 0 or c["difference_hi"] < 0 for c in ablated]
            level = all(interval_verdict(c["difference_lo"], c["difference_hi"], lambda v: abs(v) < sigma) == "met"
                        for c in ablated)
            rows.append({"claim": "the (k, λ) shape matters", "scenario": scen, "value": _differences(ablated),
                         "bar": f"vespo − each ≠ 0; not met: each within ±{sigma:.3f} (reference σ)",
                         "verdict": "met" if all(apart) else "in part" if any(apart)
                         else "not met" if level else "unresolved"})
    return rows


def _differences(pairs: list[dict]) -> str:
    """`vespo − vespo_T +0.024 [+0.007, +0.035]; ...`: contrasts as a claim row quotes them."""
    return "; ".join(f"vespo − {c['b']} {c['difference']:+.3f} "
                     f"{interval_text(c['difference_lo'], c['difference_hi'], '+.3f')}" for c in pairs)


SPREAD_KEYS = ("staleness/seq_log_ratio", "total/seq_log_ratio", "objective/coef_seq")


def _quarter(values: np.ndarray, part: str) -> np.ndarray:
    """The first or the last quarter of a run's steps (at least one)."""
    k = max(1, len(values) // 4)
    return values[:k] if part == "first" else values[-k:]


def weight_spread(out: Path, summary: dict) -> list[dict]:
    """Per group with `diagnostics.seq_weights` rows: the median over its seeds and steps of
    each quantile of log W (staleness; total for vespo_rho's W) and of phi(W), over the first
    and the last quarter of training, and phi's top-5% share at the last quarter: where the
    weight mass sits as a run goes (or collapses)."""
    rows = []
    for g in summary["groups"]:
        runs = [cell_rows(out, n) for n in seed_names(summary, g["scenario"], g["method"])]
        if not any(series(r, "objective/coef_seq/q50")[1].size for r in runs):
            continue
        row = {"scenario": g["scenario"], "method": g["method"]}
        quantiles = [f"{k}/{s}" for k in SPREAD_KEYS for s in ("q05", "q50", "q95")]
        for name in [*quantiles, "objective/coef_seq/top_share"]:
            for part in ("first", "last"):
                vals = np.concatenate([_quarter(series(r, name)[1], part) for r in runs])
                row[f"{name}/{part}"] = float(np.median(vals)) if vals.size else float("nan")
        rows.append(row)
    return rows


def curve_table(out: Path, summary: dict) -> list[dict]:
    """The curves' values: per group, the seed mean of the trainer-side metric at the
    optimizer steps (`version`) where every finished cell evaluated (every 64 when N = 64
    runs), thinned evenly to CURVE_POINTS; `at/<step>` keys."""
    metric = summary.get("trainer_metric")
    names = list(summary["cells"])
    if metric is None or not names:
        return []
    points = {n: dict(zip(*(a.tolist() for a in series(cell_rows(out, n), metric, x=CURVE_X))))
              for n in names}
    steps = sorted(set.intersection(*(set(p) for p in points.values())))
    if not steps:
        return []
    if len(steps) > CURVE_POINTS:  # thinned evenly, the first and the last kept
        steps = [steps[round(i)] for i in np.linspace(0, len(steps) - 1, CURVE_POINTS)]
    rows = []
    for g in summary["groups"]:
        own = seed_names(summary, g["scenario"], g["method"])
        rows.append({"scenario": g["scenario"], "method": g["method"], "seeds": len(own),
                     **{f"at/{s}": float(np.mean([points[n][s] for n in own])) for s in steps}})
    return rows


def tables(summary: dict) -> list[tuple[str, list[dict], list[tuple[str, str]]]]:
    """The report's tables beside the groups': the claims' verdicts, the curves' values, and
    the sequence weights' spread where it was logged."""
    spread_cols = [("scenario", "N"), ("method", "method")] + [
        (f"{k}/{s}/{part}", f"{label} {s} ({part} ¼)")
        for k, label in (("staleness/seq_log_ratio", "log W"), ("total/seq_log_ratio", "log W·ρ"),
                         ("objective/coef_seq", "φ(W)"))
        for s in ("q05", "q50", "q95") for part in ("first", "last")] + [
        ("objective/coef_seq/top_share/last", "φ top-5% share (last ¼)")]
    out = [("The paper's claims, each verdict read from 95% intervals (bootstrap over seeds):",
            summary.get("claims", []), [("claim", "claim"), ("scenario", "N"),
                                        ("value", "value [95%]"), ("bar", "bar"),
                                        ("verdict", "verdict")])]
    if summary.get("curve"):
        steps = [k for k in summary["curve"][0] if k.startswith("at/")]
        title = (f"Trainer-side {summary['trainer_metric']}, seed mean, at optimizer steps "
                 "every group evaluated (the curves' values):")
        out.append((title, summary["curve"],
                    [("scenario", "N"), ("method", "method"), ("seeds", "seeds")]
                    + [(k, f"step {k[3:]}") for k in steps]))
    if summary.get("weight_spread"):  # only runs with diagnostics.seq_weights log them
        out.append((("Sequence weights over training (median over seeds and steps of each "
                     "quantile; diagnostics.seq_weights):"), summary["weight_spread"], spread_cols))
    return out


COLUMNS = [("scenario", "N"), ("method", "method"), ("seeds", "seeds"),
           ("last3_trainer", "last-3 trainer-side"), ("best_trainer", "best trainer-side"),
           ("lowest_trainer", "lowest trainer-side"),
           ("collapsed_trainer", "collapsed seeds (trainer-side)"),
           ("n1_twin", "N = 1 twin"), ("vs_n1", "last-3 × N = 1 twin [95%]"),
           ("kept_80", "seeds ≥ 0.8× twin"),
           ("final_reward", "final batch reward (generator-side)"),
           ("final_accuracy", "final greedy acc"), ("min_ess", "min ESS"),
           ("staleness_k3", "staleness k3 (mean over steps)"),
           ("mean_staleness", "staleness (versions)"),
           ("probe_kl_to_ref", "probe KL to N1 grpo")]
