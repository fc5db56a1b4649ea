"""E-VESPO (DESIGN.md section 7): which objective survives N optimizer steps per rollout batch?

Matrix: staleness N in {1, 4, 8, 16, 32, 64} (`train.minibatches=N`: one rollout batch of
32 x 8 = 256 responses, N sequential optimizer steps on disjoint slices, so the i-th
slice is trained i versions after it was sampled) x {grpo, gspo, sapo, vespo} plus
vespo with length normalisation of log W by T and by sqrt(T), on the dense tiny model.
The reference (for the deviation columns) is N = 1 x grpo. Routing replay R2 rows: on
the MoE tiny model (`model.moe=true`, its own warm start), N in {8, 32} x {grpo, vespo},
each without and with `train.routing_replay=r2` (the experts of the logp_old forward
replayed in the N stale logp forwards), scenario `moe_N<n>`.

What it simplifies: one seed by default and 30 steps (36 cells must fit 60 minutes on 2
cores); lr 1e-4 per optimizer step, so a larger N also means more, smaller steps per
batch, as in the paper (N = gbs / mbs at a fixed batch).
"""

from __future__ import annotations

from tether.experiments.runner import Cell, Experiment

QUESTION = ("As one rollout batch is split into N sequential optimizer steps, which objective "
            "keeps its reward, and does VESPO stay stable to N = 64 without length normalisation?")

TASK = ["task.use_all=true", "task.format_weight=0.1", "sync.policy=every:1"]
METHODS = {
    "grpo": ["train.estimator=grpo"],
    "gspo": ["train.estimator=gspo"],
    "sapo": ["train.estimator=sapo"],
    "vespo": ["train.estimator=vespo"],
    "vespo_T": ["train.estimator=vespo", "train.estimator_params={length_norm: T}"],
    "vespo_sqrtT": ["train.estimator=vespo", "train.estimator_params={length_norm: sqrtT}"],
}


R2_METHODS = ("grpo", "vespo")  # on the MoE model, each without and with routing replay R2


def build(quick: bool = False, seeds: int | None = None) -> Experiment:
    if quick:
        # (no MoE rows: their own warm start would dominate a quick run)
        ns, methods, n_seeds, moe_ns = (1, 4), ["grpo", "vespo"], seeds or 1, ()
        base = TASK + ["model.warmstart_steps=120", "train.steps=4", "train.lr=1e-4",
                       "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "task.eval_size=16", "eval.every=0",
                       "eval.samples=0", "diagnostics.monitor_every=0",
                       "run.checkpoint_every=0"]
    else:
        ns, methods, n_seeds, moe_ns = (1, 4, 8, 16, 32, 64), list(METHODS), seeds or 1, (8, 32)
        base = TASK + ["model.warmstart_steps=200", "train.steps=30", "train.lr=1e-4",
                       "rollout.prompts_per_step=32", "rollout.group_size=8",
                       "rollout.max_new_tokens=12", "eval.every=10", "eval.samples=0",
                       "diagnostics.monitor_every=10", "run.checkpoint_every=10"]
    cells = [Cell(f"N{n}", m, seed, tuple([f"train.minibatches={n}"] + METHODS[m]))
             for seed in range(n_seeds) for n in ns for m in methods]
    cells += [Cell(f"moe_N{n}", m + suffix, seed,
                   (f"train.minibatches={n}", "model.moe=true", *METHODS[m], *replay))
              for seed in range(n_seeds) for n in moe_ns for m in R2_METHODS
              for suffix, replay in (("", []), ("_r2", ["train.routing_replay=r2"]))]
    notes = ["staleness N = train.minibatches on one rollout batch",
             "reference for deviations: N1 x grpo",
             "moe_N<n>: the MoE tiny model; <method>_r2 replays the logp_old forward's experts",
             "vespo: W = prod pi_theta/pi_old, without rho, as the paper's scripts"]
    return Experiment("vespo", QUESTION, base, cells, ("N1", "grpo"), notes)


COLUMNS = [("scenario", "N"), ("method", "method"), ("seeds", "seeds"),
           ("final_trainer", "final trainer-side"),
           ("final_reward", "final batch reward (generator-side)"), ("best_reward_smoothed", "best reward (smoothed)"),
           ("collapsed", "collapsed seeds"), ("final_accuracy", "final acc"),
           ("min_ess", "min ESS"), ("probe_kl_to_ref", "probe KL to N1 grpo")]
