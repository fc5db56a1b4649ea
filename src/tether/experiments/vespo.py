"""E-VESPO (DESIGN.md section 7): which objective survives N stale optimizer steps per batch?

The paper's protocol (its scripts: optimizer mini-batch 256, rollout batch 256 x N, lr 1e-6,
8 samples per prompt), scaled to the tiny testbed:
1. A fixed optimizer mini-batch of MINIBATCH_PROMPTS = 4 prompts x GROUP = 8 samples = 32
   responses; a rollout batch of N mini-batches (`rollout.prompts_per_step=4N`,
   `train.minibatches=N`). The i-th mini-batch is trained i versions after it was sampled,
   so a larger N means more stale updates on the same-size mini-batch, not smaller, noisier
   ones (the previous version of this experiment split a fixed batch of 256 into N).
2. The same number of optimizer steps for every N: OPT_STEPS = 128, so `train.steps` (rollout
   batches) = 128 / N: N = 1 trains on 128 batches, N = 64 on 2.
3. Trainer-side evaluation every EVAL_EVERY = 64 optimizer steps for every N (`eval.every` =
   64 / N rollout batches; checkpoints on the same cadence): at versions 0, 64 and 128, held
   out and sampled like the rollouts (`eval.samples=4`: `eval/accuracy_sampled`,
   `eval/reward_sampled`). The headline and the collapse test read these (analysis
   `trainer_headline`); the report's curves put optimizer steps (`version`) on the x axis.
4. Responses long enough for sequence weights to matter: Countdown whose answer writes its
   steps (`task.answer=steps`, 5 numbers: 23-31 characters, `rollout.max_new_tokens=48`;
   configs/countdown_steps.yaml), from its cached 900-step warm start (the same task keys,
   so the same cache entry).
5. W = prod pi_theta/pi_old, without rho, as the paper's scripts (the `vespo` default); the
   generator is fp32, so rho = 1 anyway: all the mismatch here is staleness.
6. Collapse, read at the largest N: the final trainer-side value below half its best
   (`collapsed_trainer`; the generator-side batch reward has only 2 points at N = 64).

Matrix: N in {1, 8, 64} x {grpo, gspo, sapo, vespo, vespo / T, vespo / sqrt T} x 3 seeds =
54 cells; the reference is N1 x grpo.

What it cuts to fit 60 minutes on 2 cores (the runner's 2 cells at a time, one thread each).
Measured with one thread, on cores shared with other jobs: 0.65 s per optimizer step at N = 1
(no old-log-prob forward) and N = 4, 0.72 s at N = 2, 0.83 s at N = 64 (one batch of 2048
responses, 53 s, under a load of 4.7 on the 2 cores); about 5 s to start a cell and 7.5 s
per evaluation (200 problems greedy + 4 x 200 sampled). A cell: 5 + 3 x 7.5 + 128 x 0.7 =
117 s; 54 cells on 2 workers: 54 x 117 / 2 = 53 minutes (60 at 0.83 s a step).
- N in {1, 8, 64}, not {1, 4, 8, 16, 32, 64}: each N costs 18 cells, about 17.5 minutes.
  The ends (on-policy and the paper's largest N) and one point between them. `--only` adds
  no new N; a wider sweep is a change of NS (or a longer hour).
- 128 optimizer steps (N = 64 sees 2 rollout batches) and 3 trainer-side evaluations; more
  evaluations for N = 64 than one per rollout batch are not possible, and more batches at
  N = 64 cost 64 optimizer steps each for every N.
- No MoE routing-replay (R2) rows: the MoE model would need its own warm start on the
  steps task (about 20 minutes to build) and its rows 1/3 more cells; they do not fit.
- The learning rate LR is calibrated to a per-version k3 of about 1e-3 (its comment).
- Each cell's N keys (`train.steps`, `eval.every`, ...) apply after `--set`: OPT_STEPS and
  EVAL_EVERY are changed here, not with `--set train.steps=...`.
"""

from __future__ import annotations

from tether.experiments.runner import Cell, Experiment

QUESTION = ("With a fixed optimizer mini-batch and N of them per rollout batch (more stale "
            "updates as N grows), which objective keeps the trained policy's reward, and does "
            "VESPO stay stable to N = 64 without length normalisation?")

# Calibrated to a per-version token k3 of about 1e-3 (issue 13): `staleness/k3_kl/mean` at
# N = 2 averages mini-batch 0 (k3 = 0) and mini-batch 1 (one version stale), so per version
# it is 2 x the logged value. `bash scripts/vespo-calibrate-lr.sh 1e-4 5e-5` (this task's
# 900-step warm start, correctness-only reward, vespo, 8 rollout batches of 8 x 8 at N = 2):
# lr 1e-4 -> median 7.9e-4 (0 to 1.1e-3: a batch with no correct response does not move);
# lr 5e-5 -> 9.3e-5. (At format_weight 0.1: 7.5e-4 and 2.2e-4.) The paper's 1e-6 is for 7B.
LR = 1e-4

GROUP = 8  # samples per prompt (the paper's 8)
MINIBATCH_PROMPTS = 4  # prompts per optimizer mini-batch: 4 x 8 = 32 responses
OPT_STEPS = 128  # optimizer steps for every N (train.steps = OPT_STEPS / N rollout batches)
EVAL_EVERY = 64  # trainer-side evaluation (and checkpoint) every this many optimizer steps
NS = (1, 8, 64)
SEEDS = 3

# The steps task of configs/countdown_steps.yaml and its cached 900-step warm start, with
# a correctness-only reward, as the paper's: at format_weight 0.1 the on-policy reference
# traded correct chains for well-formed misses (held-out sampled accuracy 0.073 -> 0.008 in
# 128 steps, 2 seeds, every objective alike; RESULTS.md, E-VESPO).
TASK = ["model.warmstart_steps=900", "task.answer=steps", "task.num_numbers=5",
        "task.use_all=true", "task.format_weight=0", "rollout.max_new_tokens=48",
        "sync.policy=every:1"]
METHODS = {
    "grpo": ["train.estimator=grpo"],
    "gspo": ["train.estimator=gspo"],
    "sapo": ["train.estimator=sapo"],
    "vespo": ["train.estimator=vespo"],
    "vespo_T": ["train.estimator=vespo", "train.estimator_params={length_norm: T}"],
    "vespo_sqrtT": ["train.estimator=vespo", "train.estimator_params={length_norm: sqrtT}"],
}

CURVE_X = "version"  # the report's curves: optimizer steps, comparable across N


def staleness_keys(n: int, prompts: int, opt_steps: int, eval_every: int) -> list[str]:
    """Scenario N: a rollout batch of N mini-batches of `prompts` prompts, `opt_steps`
    optimizer steps in all, evaluation and checkpoints every `eval_every` optimizer steps."""
    if opt_steps % n or eval_every % n:
        raise ValueError(f"N={n} must divide opt_steps={opt_steps} and eval_every={eval_every}")
    return [f"rollout.prompts_per_step={prompts * n}", f"train.minibatches={n}",
            f"train.steps={opt_steps // n}", f"eval.every={eval_every // n}",
            f"run.checkpoint_every={eval_every // n}"]


def build(quick: bool = False, seeds: int | None = None) -> Experiment:
    if quick:  # 2 prompts x 4 samples per mini-batch, 4 optimizer steps, 16 held-out problems
        ns, methods, n_seeds = (1, 4), ["grpo", "vespo"], seeds or 1
        group, prompts, opt_steps, eval_every = 4, 2, 4, 4
        # A smoke test, not a measurement: a short warm start unless --model gives one.
        extra = ["task.eval_size=16", "eval.samples=2", "model.warmstart_steps=20"]
    else:
        ns, methods, n_seeds = NS, list(METHODS), seeds or SEEDS
        group, prompts, opt_steps, eval_every = GROUP, MINIBATCH_PROMPTS, OPT_STEPS, EVAL_EVERY
        extra = ["eval.samples=4"]
    base = TASK + [f"train.lr={LR:g}", f"rollout.group_size={group}",
                   "diagnostics.monitor_every=0", *extra]
    cells = [Cell(f"N{n}", m, seed, tuple(staleness_keys(n, prompts, opt_steps, eval_every)
                                          + METHODS[m]))
             for seed in range(n_seeds) for n in ns for m in methods]
    notes = [(f"staleness N: a rollout batch of N optimizer mini-batches of {prompts} x {group} "
              f"responses; {opt_steps} optimizer steps for every N (train.steps = {opt_steps}/N)"),
             (f"trainer-side evaluation every {eval_every} optimizer steps; curves against "
              "optimizer steps (version)"),
             "reference for deviations: N1 x grpo; collapse: final trainer-side value < half its best",
             "vespo: W = prod pi_theta/pi_old, without rho, as the paper's scripts"]
    return Experiment("vespo", QUESTION, base, cells, ("N1", "grpo"), notes)


COLUMNS = [("scenario", "N"), ("method", "method"), ("seeds", "seeds"),
           ("final_trainer", "final trainer-side"), ("best_trainer", "best trainer-side"),
           ("collapsed_trainer", "collapsed seeds (trainer-side)"),
           ("final_reward_sampled", "final trainer-side reward"),
           ("final_reward", "final batch reward (generator-side)"),
           ("final_accuracy", "final acc"), ("min_ess", "min ESS"),
           ("probe_kl_to_ref", "probe KL to N1 grpo")]
