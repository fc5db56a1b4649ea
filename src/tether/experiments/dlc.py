"""E-DLC (DESIGN.md section 7): does DLC keep an fp8, lagging generator on the on-policy path?

Matrix: generator {exact (fp32), fp8, lag k (fp32), fp8 + lag k} x method {naive,
reweight, tis, tis + ESS re-sync, dlc without re-sync, dlc, dlc under a PPO clip} x seeds,
on the dense tiny model.
- `reweight` is the paper's plain-reweighting baseline: token IS by pi_theta/mu, capped
  at 2, no clip, no centering, no re-sync.
- `tis` is PPO-clip + truncated IS; `tis_ess` adds the ESS < 0.5 re-sync.
- `dlc_noresync` is the dlc estimator (staleness IS capped at 2 + centering) with
  `sync.policy=every:1`: every step a routine delivery of the weights of k versions ago,
  never a re-sync; `dlc` adds the ESS < 0.5 re-sync (`ess:0.5`, the tripping batch
  trained on).
- `dlc_clip` is centering under a PPO clip around pi_old (with the ESS re-sync): does the
  clip, which anchors every update to pi_old, explain why tis held the path better?
- Controls, under lag k only: `reweight_cap5` and `reweight_uncapped` (plain reweighting
  with its cap at 5 and none: does the cap at 2 explain its small drift?), `dlc_schedule`
  (dlc's re-syncs on a fixed schedule of the same count, `resync:RESYNC_EVERY`: does the
  ESS's timing matter?), `stale_is_ess` (staleness IS with the ESS re-sync, no centering:
  what does centering add on top of the re-sync?).
- Centering is exact: K = V = 21, the whole vocabulary.
The on-policy reference is exact x naive (fp32, lag 0, REINFORCE), with 5 seeds.
Headlines are the trainer's: held-out accuracy sampled like the rollouts, every 5 steps.

Beside the simulated lag, a real race: `fp8_async<k>` is the fp8 generator in the
asynchronous loop (`loop.mode=async`, one rollout worker process, admission bound
eta = `loop.max_staleness` = k, `sync.lag=0`), where staleness is what the race gives,
up to k versions. naive publishes lazily under `bounded:k` (the generator runs up to k
versions behind, as at lag k), dlc keeps its `ess:0.5` (lazy, plus a publish when the
ESS trips) with the fixed window: the batches already in flight at a trip are trained.
`dlc_window` lets the ESS govern the window (`loop.window=ess`, ceiling k) and trains a
batch in flight at a trip only within the shrunken window (`loop.after_trip=window`);
`dlc_regen` drops every batch sampled before the re-sync (`loop.after_trip=regenerate`).
`extend` computes the race's verdicts: dlc's mean staleness against naive's, and the
last-3 evaluations' mean against the reference's, in its sigma.

What it simplifies, to fit 60 minutes on 2 cores: cells that are provably the same run
are not repeated. With lag 0 there is no staleness, so the re-sync variants equal their
base method, reweight equals tis without the clip, and only naive, tis and dlc are run;
on `exact` only naive (the reference) and dlc (does centering cost anything on-policy?).
mis is left out (tis stands for the truncation family). From the 71-cell run (RESULTS.md):
fp8 x tis is cut (fp8 alone moved no method), and fp8 + lag k x {dlc_clip, dlc_noresync}
(they ended as under lag k alone), to make room for the controls. Timed alone, that 74-cell
matrix's cells took 71 minutes (RESULTS.md), so three groups moved out of the default into
`Experiment.extra` (`--only` runs them): fp8 x dlc (at lag 0 fp8 moved no method, naive
included, so centering has no numerical drift to correct there; exact x dlc stays for what
centering costs on-policy), lag k x dlc_clip (the clip question, answered in two runs:
level with dlc or above it within the seeds' spread) and fp8_async k x dlc_window (issue
28's alternative after_trip rule; `regenerate`, the default, stays). 65 cells, timed alone at 57 min 27 s (RESULTS.md). The bf16 generator is left out: fp8
is the larger numerical push, and in the 74-cell run bf16 x {naive, tis, dlc} moved no method
while its cells cost the most (128-149 s against 74-100 s on 2 AVX2 cores; RESULTS.md).
The testbed is the calibrated one (WARMSTART_STEPS, LR; docs/experiments.md): lag 32,
60 steps of 32 x 8 at lr 2e-4.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tether.experiments.analysis import bootstrap_ci, deviation, ratio
from tether.experiments.runner import EVAL_SEED, Cell, Experiment
from tether.experiments.verdicts import (
    all_met,
    contrast,
    interval_verdict,
    paired,
    power,
    seed_values,
    unresolved,
)

QUESTION = ("Under an fp8 generator lagging k versions, does plain reweighting drift off the "
            "on-policy trajectory while DLC (staleness IS + centering + ESS re-sync) stays on it?")

TASK = ["task.use_all=true", "task.format_weight=0.1"]
# dlc re-synced 4.7 and 5.0 times in a 60-step run under lag 32 and fp8 + lag 32 (RESULTS.md):
# resync:12 re-syncs after steps 12, 24, 36, 48 and 60, the same count on a fixed schedule.
RESYNC_EVERY = 12
METHODS = {
    "naive": ["train.estimator=naive", "sync.policy=every:1"],
    "reweight": ["train.estimator=reweight", "sync.policy=every:1"],
    "tis": ["train.estimator=tis", "sync.policy=every:1"],
    "tis_ess": ["train.estimator=tis", "sync.policy=ess:0.5"],
    "dlc_noresync": ["train.estimator=dlc", "sync.policy=every:1"],
    "dlc": ["train.estimator=dlc", "sync.policy=ess:0.5"],
    "dlc_clip": ["train.estimator=dlc_clip", "sync.policy=ess:0.5"],
    # Controls (issue 29). Plain reweighting with a looser cap and none: is its cap at 2 what
    # keeps it near the path? dlc's re-syncs on a fixed schedule of the same count: does the
    # ESS's timing matter? Staleness IS with the ESS re-sync and no centering: what does
    # centering add on top of the re-sync?
    "reweight_cap5": ["train.estimator=reweight", "train.estimator_params.cap=5", "sync.policy=every:1"],
    "reweight_uncapped": ["train.estimator=reweight", "train.estimator_params.cap=.inf",
                          "sync.policy=every:1"],
    "dlc_schedule": ["train.estimator=dlc", f"sync.policy=resync:{RESYNC_EVERY}"],
    "stale_is_ess": ["train.estimator=stale_is+none", "sync.policy=ess:0.5"],
    # The asynchronous race only: the window the ESS governs, and the two after_trip rules.
    "dlc_window": ["train.estimator=dlc", "sync.policy=ess:0.5", "loop.window=ess",
                   "loop.after_trip=window"],
    "dlc_regen": ["train.estimator=dlc", "sync.policy=ess:0.5", "loop.window=ess",
                  "loop.after_trip=regenerate"],
}
ASYNC_ONLY = ("dlc_window", "dlc_regen")
CONTROLS = ("reweight_cap5", "reweight_uncapped", "dlc_schedule", "stale_is_ess")
ASYNC_METHODS = ["naive", "dlc", *ASYNC_ONLY]
# The paper's comparison under lag, and the controls under pure staleness (lag 32, fp32).
PAPER_METHODS = [m for m in METHODS if m not in ASYNC_ONLY + CONTROLS]
STALE_METHODS = PAPER_METHODS + list(CONTROLS)
# fp8 + lag 32: dlc_clip ended level with dlc, and dlc_noresync at 0.159, under both lagged
# generators in the 71-cell run (RESULTS.md): lag 32 answers both questions; cut here.
BOTH_METHODS = [m for m in PAPER_METHODS if m not in ("dlc_clip", "dlc_noresync")]
# Lag 0: no staleness to correct or re-sync on. fp8 x naive shows what fp8 alone moves,
# exact x dlc what centering costs on-policy; fp8 x {tis, dlc} are cut (module docstring).
REFERENCE_SEEDS = 5  # the on-policy sigma needs them (DESIGN.md section 7)
# The calibrated testbed (docs/experiments.md, "Calibration"): the warm start and learning
# rate at which the on-policy reference itself learns, with a small seed-to-seed sigma.
# At lr 1e-4 and lag 16 the reference learns (+0.028, sigma 0.014) but nothing is pushed off
# the path (RESULTS.md, the slice): the default is the stronger push, lr 2e-4 (reference
# +0.050, sigma 0.025 in the calibration) and lag 32.
WARMSTART_STEPS = 900
LR = 2e-4
LAG = 32
STEPS = 60


def scenarios(lag: int) -> dict[str, list[str]]:
    return {
        "exact": ["rollout.precision=fp32", "sync.lag=0"],
        "fp8": ["rollout.precision=fp8", "sync.lag=0"],
        f"lag{lag}": ["rollout.precision=fp32", f"sync.lag={lag}"],
        f"fp8_lag{lag}": ["rollout.precision=fp8", f"sync.lag={lag}"],
        f"fp8_async{lag}": ["rollout.precision=fp8", "sync.lag=0", "loop.mode=async",
                            "loop.workers=1", f"loop.max_staleness={lag}"],
    }


def method_overrides(scenario: str, method: str, lag: int) -> list[str]:
    """A method's keys in a scenario: in the async one naive publishes lazily (bounded:k)."""
    keys = METHODS[method]
    if scenario.startswith("fp8_async") and method == "naive":
        keys = [k for k in keys if not k.startswith("sync.policy=")] + [f"sync.policy=bounded:{lag}"]
    return keys


def build(quick: bool = False, seeds: int | None = None) -> Experiment:
    if quick:
        lag, n_seeds, n_ref = 2, seeds or 1, seeds or 1
        base = TASK + ["model.warmstart_steps=120", "train.steps=4", "train.lr=5e-4",
                       "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "task.eval_size=16", "eval.every=2",
                       "eval.samples=2", "diagnostics.monitor_every=2",
                       "diagnostics.monitor_prompts=4", "run.checkpoint_every=0"]
        # One tiny async cell: the race through the runner (its rollout worker is a child
        # of the cell's process), not a measurement.
        plan = {"exact": ["naive", "dlc"], f"fp8_lag{lag}": ["naive", "reweight", "dlc"],
                f"fp8_async{lag}": ["dlc_window"]}
    else:
        lag, n_seeds = LAG, seeds or 3
        n_ref = max(n_seeds, REFERENCE_SEEDS)
        base = TASK + [f"model.warmstart_steps={WARMSTART_STEPS}", f"train.steps={STEPS}",
                       f"train.lr={LR}", "rollout.prompts_per_step=32", "rollout.group_size=8",
                       "rollout.max_new_tokens=12", "eval.every=5", "eval.samples=4",
                       f"eval.seed={EVAL_SEED}",
                       "diagnostics.monitor_every=5", "run.checkpoint_every=10"]
        plan = {"exact": ["naive", "dlc"], "fp8": ["naive", "dlc"], f"lag{lag}": STALE_METHODS,
                f"fp8_lag{lag}": BOTH_METHODS, f"fp8_async{lag}": ASYNC_METHODS}
    scen = scenarios(lag)

    def cells_of(plan: dict[str, list[str]]) -> list[Cell]:
        return [Cell(s, m, seed, tuple(scen[s] + method_overrides(s, m, lag)))
                for seed in range(max(n_seeds, n_ref)) for s, methods in plan.items() for m in methods
                if seed < (n_ref if (s, m) == ("exact", "naive") else n_seeds)]
    # Cut from the default to fit the hour (module docstring); `--only` still runs them.
    cut = {} if quick else {"fp8": ["dlc"], f"lag{lag}": ["dlc_clip"], f"fp8_async{lag}": ["dlc_window"]}
    cells = cells_of({s: [m for m in methods if m not in cut.get(s, [])] for s, methods in plan.items()})
    extra = cells_of(cut)
    notes = [f"lag k = {lag}; identical cells skipped (module docstring)",
             f"on-policy reference: exact x naive (fp32 generator, lag 0, REINFORCE), {n_ref} seeds",
             "dlc centers over the whole vocabulary (K = V = 21: rollout.logprobs_topk auto)",
             (f"fp8_async{lag}: the asynchronous loop, 1 rollout worker, eta = {lag}; "
              "its reward is the lagged generator's, as under lag"),
             "sampled evaluations share their draws across cells (eval.seed)"]
    return Experiment("dlc", QUESTION, base, cells, ("exact", "naive"), notes, extra)


# The race's bars (issue 28): dlc's mean staleness at most half naive's; dlc within 2 sigma
# of the reference and >= 0.9x it (last-3 mean, common draws); naive still collapses.
STALENESS_SHARE, WITHIN_SIGMA, KEEP, COLLAPSED = 0.5, 2.0, 0.9, 0.5


def extend(out: Path, summary: dict) -> None:
    """Each async group's verdicts against the race's bars: `staleness_vs_naive` (its mean
    staleness over naive's in the same race), `on_path` (within WITHIN_SIGMA and >= KEEP of
    the reference, last-3 mean), and for naive `collapses` (last-3 <= COLLAPSED x reference)."""
    naive = {g["scenario"]: g["mean_staleness"] for g in summary["groups"] if g["method"] == "naive"}
    for g in summary["groups"]:
        if not g["scenario"].startswith("fp8_async"):
            continue
        base = naive.get(g["scenario"], float("nan"))
        g["staleness_vs_naive"] = g["mean_staleness"] / base if base > 0 else float("nan")
        if g["method"] == "naive":
            g["collapses"] = bool(g["last3_ratio"] <= COLLAPSED)
        else:
            g["staleness_met"] = bool(g["staleness_vs_naive"] <= STALENESS_SHARE)
            g["on_path"] = bool(g["last3_dev_sigma"] <= WITHIN_SIGMA and g["last3_ratio"] >= KEEP)
    summary["claims"] = claims(summary)
    summary["contrasts"] = contrasts(summary)


# The paper's claims under lag (bars: DESIGN.md section 7, issue 29): plain reweighting drifts
# >= DRIFT sigma (the paper: 115); dlc stays within ON_PATH_SIGMA and >= ON_PATH_KEEP of the
# reference; the ESS falls below 0.5 before a run leaves the +-2 sigma band. Each verdict reads
# the 95% interval, paired by seed with the reference (verdicts module docstring): "met" when
# all of it clears the bar, "not met" when none does.
DRIFT, ON_PATH_SIGMA, ON_PATH_KEEP = 10.0, 2.0, 0.85
REWEIGHTS = ("reweight", "reweight_cap5", "reweight_uncapped")
# Paired questions under lag k, each the difference of last-3 means (a - b) over seeds:
# (question, a, b). At fp32 reweight is stale_is+none (mu = pi_old), so dlc_noresync - reweight
# is centering alone, without a re-sync.
CONTRAST_PAIRS = (("the ESS's timing: dlc against its re-syncs on a fixed schedule", "dlc", "dlc_schedule"),
                  ("centering with the ESS re-sync", "dlc", "stale_is_ess"),
                  ("centering without a re-sync", "dlc_noresync", "reweight"),
                  ("the ESS re-sync under dlc", "dlc", "dlc_noresync"),
                  ("plain reweighting's cap at 2 against none", "reweight", "reweight_uncapped"))
# The race's (issue 73): paired in seed and draws, not in timing, which the machine decides.
RACE_PAIRS = (("dlc against naive in the race", "dlc", "naive"),
              ("the ESS window in the race (regenerate)", "dlc_regen", "dlc"),
              ("the ESS window in the race (train within the window)", "dlc_window", "dlc"))


def _on_path_claims(summary: dict, g: dict, where: str) -> list[dict]:
    """Against the reference, paired by seed: reweighting's drift (a bound where the testbed
    cannot reach DRIFT: zero accuracy is `ceiling` sigma off) and the strongest claim the
    testbed can test in its place, that it ends off the path dlc must hold; dlc's on-path bar.
    Each with the power of its ratio bar, from the per-seed x - ON_PATH_KEEP y."""
    x, y = paired(summary, (g["scenario"], g["method"]), summary["reference"])
    if not len(x):
        return []
    keep = power(x - ON_PATH_KEEP * y)
    rat = float(ratio(x, y))
    dev = float(deviation(x, y)) if len(x) > 1 else float("nan")  # sigma needs 2 reference seeds
    (r_lo, r_hi), (d_lo, d_hi) = (bootstrap_ci(x, y, stat, paired=True) for stat in (ratio, deviation))
    common = {"group": where, "collapsed": g["collapsed_trainer"], "seeds_run": len(x)}
    if g["method"] == "dlc":
        verdict = all_met(interval_verdict(d_lo, d_hi, lambda v: v <= ON_PATH_SIGMA),
                          interval_verdict(r_lo, r_hi, lambda v: v >= ON_PATH_KEEP))
        return [{"claim": "dlc stays near on-policy", **common, "value": rat, "value_lo": r_lo,
                 "value_hi": r_hi, "bar": f"<= {ON_PATH_SIGMA:g} σ and >= {ON_PATH_KEEP:g}x (last-3)",
                 **keep, "verdict": verdict if verdict != "unresolved" else unresolved(len(x), keep["needs_zero"])}]
    sigma = summary["reference_last3_sigma"]
    ceiling = summary["reference_last3"] / sigma if sigma > 0 else float("nan")
    drift = (f"bound: unreachable on this testbed (zero accuracy is {ceiling:.1f} σ)"
             if ceiling < DRIFT else interval_verdict(d_lo, d_hi, lambda v: v >= DRIFT))
    leaves = interval_verdict(r_lo, r_hi, lambda v: v < ON_PATH_KEEP)
    return [{"claim": "plain reweighting drifts far", **common, "value": dev, "value_lo": d_lo,
             "value_hi": d_hi, "bar": f"last-3 dev >= {DRIFT:g} σ", "verdict": drift},
            {"claim": "plain reweighting leaves the path dlc must hold", **common, "value": rat,
             "value_lo": r_lo, "value_hi": r_hi, "bar": f"< {ON_PATH_KEEP:g}x the reference (last-3)", **keep,
             "verdict": leaves if leaves != "unresolved" else unresolved(len(x), keep["needs_zero"])}]


def claims(summary: dict) -> list[dict]:
    """One row per (claim, group) under lag: value, 95% interval, bar, power and verdict."""
    rows = []
    for g in summary["groups"]:
        if "lag" not in g["scenario"]:
            continue
        where = f"{g['scenario']} x {g['method']}"
        if g["method"] in REWEIGHTS or g["method"] == "dlc":
            rows += _on_path_claims(summary, g, where)
        left = [(e, b) for e, b in zip(g["ess_below_0.5_per_seed"], g["leaves_band_per_seed"], strict=True)
                if b is not None]
        if left:
            first = sum(e is not None and e <= b for e, b in left)
            rows.append({"claim": "ESS < 0.5 marks the onset", "group": where,
                         "value": f"{first} of {len(left)} seeds", "bar": "ESS < 0.5 no later than "
                         "leaving ±2σ, in every seed that leaves", "collapsed": g["collapsed_trainer"],
                         "verdict": "met" if first == len(left) else "not met"})
    return rows


def contrasts(summary: dict) -> list[dict]:
    """CONTRAST_PAIRS under each lagged scenario and RACE_PAIRS in each race holding both
    groups: a - b of the last-3 means, paired by seed, its 95% bootstrap interval, in the
    reference's sigma too, the power figures, and which side wins."""
    rows = []
    scenarios = dict.fromkeys(c["scenario"] for c in summary["cells"].values())
    for scen in scenarios:
        pairs = CONTRAST_PAIRS if scen.startswith("lag") else RACE_PAIRS if scen.startswith("fp8_async") else ()
        for question, a, b in pairs:
            row = contrast(summary, scen, a, b)
            if row is None:
                continue
            syncs = [np.mean(seed_values(summary, scen, m, "resyncs")) for m in (a, b)]
            rows.append({"question": question, **row, "resyncs": f"{syncs[0]:.1f} vs {syncs[1]:.1f}"})
    return rows


POWER = [("seeds_run", "seeds (paired)"), ("sd_paired", "paired σ"),
         ("needs_zero", "seeds to decide"), ("needs_half", "seeds to ±0.01")]


CLAIMS_TITLE = ("The paper's claims, each verdict read from its 95% interval (bootstrap over seeds, "
                "paired by seed with the reference); seeds to decide: for the ratio bar, at the "
                "effect observed:")
CONTROLS_TITLE = ("The controls: a − b of the last-3 trainer-side means, paired by seed, 95% interval "
                  "over seeds (the race's pairs share seed and draws, not timing); seeds to decide: "
                  "to exclude 0 at the effect observed:")


def tables(summary: dict) -> list[tuple[str, list[dict], list[tuple[str, str]]]]:
    """The report's tables beside the groups': the claims' verdicts and the controls' contrasts."""
    return [(CLAIMS_TITLE, summary.get("claims", []),
             [("claim", "claim"), ("group", "group"), ("value", "value [95%]"), ("bar", "bar"),
              ("collapsed", "collapsed seeds"), *POWER[:3], ("verdict", "verdict")]),
            (CONTROLS_TITLE, summary.get("contrasts", []),
             [("question", "question"), ("scenario", "generator"), ("a", "a"), ("b", "b"),
              ("difference", "a − b [95%]"), ("difference_sigma", "a − b (σ)"),
              ("resyncs", "re-syncs a vs b"), *POWER, ("verdict", "verdict")])]


COLUMNS = [("scenario", "generator"), ("method", "method"), ("seeds", "seeds"),
           ("final_trainer", "final trainer-side"), ("trainer_dev_sigma", "trainer dev (σ)"),
           ("trainer_ratio", "× reference"), ("last3_trainer", "last-3 trainer-side"),
           ("last3_dev_sigma", "last-3 dev (σ)"), ("last3_ratio", "last-3 × reference"),
           ("leaves_band_step", "leaves ±2σ step"),
           ("final_accuracy", "final greedy acc"),
           ("final_reward", "final batch reward (generator-side)"),
           ("reward_dev_sigma", "reward dev (σ)"), ("accuracy_dev_sigma", "acc dev (σ)"),
           ("probe_dev_sigma", "probe dev (σ)"), ("ess_below_0.5_step", "ESS<0.5 step"),
           ("ess_below_0.5_per_seed", "ESS<0.5 step per seed"),
           ("leaves_band_per_seed", "leaves ±2σ step per seed"),
           ("min_ess", "min ESS"), ("resyncs", "re-syncs"),
           ("mean_staleness", "staleness (versions)"),
           ("staleness_vs_naive", "staleness / naive's"), ("samples_per_s", "samples/s"),
           ("trained_per_generated", "trained / generated"), ("staleness_met", "≤ half naive's"),
           ("on_path", "on path (≤ 2σ, ≥ 0.9×)"), ("collapses", "naive collapses"),
           ("collapsed_trainer", "collapsed seeds"),
           ("rare_kl_share_max", "rare KL share (max)"), ("numerical_k3", "numerical k3"),
           ("total_k3", "k3 on old prefixes"), ("monitor_k3", "k3 on own samples")]
