"""tether against TRL's GRPOTrainer on the same work, side by side in one run, and what
tether's TRL plug-in (tether.integrations.trl) adds to TRL's step.

    .venv/bin/python benchmarks/vs_trl.py                      # 10 steps each, prints the table
    .venv/bin/python benchmarks/vs_trl.py --steps 20 --json out.json
    .venv/bin/python benchmarks/vs_trl.py --learn tis --generator bf16 --seeds 3 --steps 60 \
        --lr 3e-4 --plot docs/trl_vs_tether.png     # reward curves: tether vs TRL + tether

Timing (default): tether, TRL, and TRL with the plug-in logging the split (its default: no
loss change, TRL's own generation), the TRL sides alternating `--rounds` times. The plug-in's
overhead is its step time over plain TRL's, minus 1.
Learning (--learn ESTIMATOR): tether with train.estimator=ESTIMATOR and
rollout.precision=GENERATOR against TRL with the plug-in's estimator=ESTIMATOR and
generator=GENERATOR (tether's engine samples in TRL's place), `--seeds` seeds each; the
held-out accuracy is not compared (TRL has no evaluation): the batch reward is.

The same model directory (tether's tiny Qwen3, 2.4 M parameters), the same Countdown
prompts in the same order (training problems 0, 1, 2, ...), the same reward (tether's
Countdown parser), group size, batch, response length, sampling, learning rate, optimizer
and step count; fp32, one torch thread each, run one after the other on the same machine.

| setting | tether | TRL GRPOConfig |
|---|---|---|
| prompts x group | rollout.prompts_per_step=32, group_size=8 | per_device_train_batch_size=256, num_generations=8 |
| response length | rollout.max_new_tokens=12 | max_completion_length=12 |
| sampling | temperature 1, no top-k/top-p | temperature=1.0, top_k=0, top_p=1.0 |
| loss | grpo: PPO clip (0.2, 0.28), token-mean | loss_type=dapo (token-mean), epsilon=0.2, epsilon_high=0.28 |
| advantages | (r - mean) / std per group | scale_rewards=group |
| KL to a reference | none | beta=0.0 |
| optimizer | AdamW lr 1e-4, betas (0.9, 0.999), wd 0, clip 1.0 | the same (TrainingArguments) |
| updates per batch | 1 (train.minibatches=1) | num_iterations=1, steps_per_generation=1 |
| extras off | diagnostics.monitor_every=0, eval.every=0, no checkpoints | logging every step, no saves |

TRL (a dev dependency: `make install` brings it) runs in a child process of the same
environment, imports tether's task code for the reward, and reports its step times to this
script as JSON. A step's time is wall time from its start
to its end (generation, scoring, loss, optimizer step); the first step (warm-up) is left
out of the means. docs/performance.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import ROOT, model_path, train_run, use_threads

SETTINGS = {"prompts": 32, "group": 8, "max_new_tokens": 12, "temperature": 1.0, "lr": 1e-4}


def run_tether(model_dir: str, steps: int, seed: int, lr: float = SETTINGS["lr"],
               estimator: str = "grpo", precision: str = "fp32") -> dict:
    """tether's synchronous loop; step times from its metrics (time/step and phases)."""
    run = train_run([
        f"model.path={model_dir}", f"train.steps={steps}", f"train.lr={lr}",
        f"train.estimator={estimator}", f"rollout.precision={precision}",
        f"rollout.prompts_per_step={SETTINGS['prompts']}",
        f"rollout.group_size={SETTINGS['group']}",
        f"rollout.max_new_tokens={SETTINGS['max_new_tokens']}",
        f"rollout.temperature={SETTINGS['temperature']}", "task.format_weight=0.0",
        "diagnostics.monitor_every=0", "eval.every=0", "eval.samples=0", "eval.batch_size=8",
        "task.eval_size=8", "run.checkpoint_every=0", "run.progress=false", use_threads(1),
        f"run.seed={seed}"])
    rows = [r for r in run.rows if r.get("step", 0) > 0]
    phases = ("generate", "old_logprob", "train", "diagnostics", "sync")
    return {"step_s": [r["time/step"] for r in rows], "reward": [r["reward/mean"] for r in rows],
            "tokens": [r["response/length_mean"] * SETTINGS["prompts"] * SETTINGS["group"] for r in rows],
            "phases_s": {p: [r[f"time/{p}"] for r in rows] for p in phases}}


def run_trl(model_dir: str, steps: int, seed: int, lr: float = SETTINGS["lr"],
            plugin: bool = False, estimator: str | None = None,
            generator: str | None = None) -> dict:
    """TRL's GRPOTrainer, or with `plugin` tether's TetherGRPOTrainer (split logged; with
    `estimator`/`generator`, tether's loss and engine), in a child process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tether.tasks import CountdownTask

    use_threads(1)
    task = CountdownTask(format_weight=0.0)
    n = steps * SETTINGS["prompts"]
    problems = [task.train_problem(i) for i in range(n)]
    by_prompt = {p.prompt: p for p in problems}
    data = Dataset.from_dict({"prompt": [p.prompt for p in problems]})

    def countdown_reward(prompts, completions, **_):
        return [task.reward(by_prompt[p], c).total for p, c in zip(prompts, completions, strict=True)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self.t0 = 0.0

        def on_step_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.t0)

    clock = Clock()
    batch = SETTINGS["prompts"] * SETTINGS["group"]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch,
            num_generations=SETTINGS["group"], max_completion_length=SETTINGS["max_new_tokens"],
            temperature=SETTINGS["temperature"], top_k=0, top_p=1.0, learning_rate=lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
            num_iterations=1, steps_per_generation=1, use_cpu=True, bf16=False, fp16=False,
            logging_steps=1, save_strategy="no", report_to=[], seed=seed, shuffle_dataset=False,
            dataloader_num_workers=0, disable_tqdm=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        kwargs = {"model": model, "reward_funcs": countdown_reward, "args": args,
                  "train_dataset": data, "processing_class": tokenizer, "callbacks": [clock]}
        if plugin:
            from tether.integrations.trl import TetherGRPOTrainer

            trainer = TetherGRPOTrainer(**kwargs, estimator=estimator, generator=generator)
        else:
            trainer = GRPOTrainer(**kwargs)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"step_s": clock.times, "reward": [h["reward"] for h in logs],
            "tokens": [h.get("completions/mean_length", 0.0) * batch for h in logs],
            "plugin_s": [h["time/tether"] for h in logs if "time/tether" in h]}


def summary(side: dict) -> dict:
    steps = side["step_s"][1:] or side["step_s"]  # without the warm-up step
    tok = side["tokens"][1:] or side["tokens"]
    return {"step_s": statistics.mean(steps), "tokens_per_s": sum(tok) / sum(steps),
            "reward_first": side["reward"][0], "reward_last": side["reward"][-1]}


def child(model: str, steps: int, seed: int, lr: float, side: str,
          estimator: str | None = None, generator: str | None = None) -> dict:
    """One TRL side in a fresh process (its own torch and TRL state)."""
    cmd = [sys.executable, __file__, "--side", side, "--model", model, "--steps", str(steps),
           "--seed", str(seed), "--lr", str(lr)]
    cmd += ["--learn", estimator] if estimator else []
    cmd += ["--generator", generator] if generator else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                              "TRL_EXPERIMENTAL_SILENCE": "1"})
    if out.returncode:
        sys.exit(f"the {side} side failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def timing(args: argparse.Namespace) -> None:
    tether_side = run_tether(args.model, args.steps, args.seed, args.lr)
    trl_runs, plugin_runs = [], []
    for _ in range(args.rounds):  # alternating, so a drift of the machine hits both
        trl_runs.append(child(args.model, args.steps, args.seed, args.lr, "trl"))
        plugin_runs.append(child(args.model, args.steps, args.seed, args.lr, "plugin"))
    t = summary(tether_side)
    r = [summary(x) for x in trl_runs]
    p = [summary(x) for x in plugin_runs]
    mean = lambda xs, k: statistics.mean(x[k] for x in xs)
    print(f"{args.steps} steps of {SETTINGS['prompts']} prompts x {SETTINGS['group']}, "
          f"<= {SETTINGS['max_new_tokens']} new tokens, fp32, 1 thread; model {args.model}; "
          f"TRL sides {args.rounds} rounds each, alternating")
    print(f"{'':22} {'s/step':>8} {'tokens/s':>9} {'reward first -> last':>22}")
    for name, s in (("tether", t), ("TRL", r[0]), ("TRL + tether plug-in", p[0])):
        print(f"{name:22} {s['step_s']:8.3f} {s['tokens_per_s']:9.0f} "
              f"{s['reward_first']:10.3f} -> {s['reward_last']:.3f}")
    phases = {k: statistics.mean(v[1:] or v) for k, v in tether_side["phases_s"].items()}
    print("tether phases (s/step): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print(f"tether step time / TRL step time: {t['step_s'] / mean(r, 'step_s'):.2f}")
    print("TRL s/step by round: " + ", ".join(f"{x['step_s']:.3f}" for x in r)
          + "; with the plug-in: " + ", ".join(f"{x['step_s']:.3f}" for x in p))
    own = statistics.mean(t for x in plugin_runs for t in x["plugin_s"][1:])
    print(f"plug-in overhead (split logged every step): {mean(p, 'step_s') / mean(r, 'step_s') - 1:+.1%} "
          f"of TRL's step time between the runs; its own work (time/tether) {own * 1e3:.1f} ms "
          f"a step, {own / mean(p, 'step_s'):.2%} of the step")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"tether": tether_side, "trl": trl_runs, "plugin": plugin_runs}, indent=1))


def learning(args: argparse.Namespace) -> None:
    """Reward per step, tether's own loop against TRL + the plug-in, same estimator,
    generator precision and prompts; mean and a 95% t-interval over seeds."""
    sides = {"tether": [], "TRL + tether": []}
    for seed in range(args.seed, args.seed + args.seeds):
        sides["tether"].append(run_tether(args.model, args.steps, seed, args.lr, args.learn,
                                          args.generator or "fp32")["reward"])
        sides["TRL + tether"].append(child(args.model, args.steps, seed, args.lr, "plugin",
                                           args.learn, args.generator or "fp32")["reward"])
    k = max(1, args.steps // 5)
    print(f"{args.learn}, generator {args.generator or 'fp32'}, lr {args.lr:g}, {args.steps} "
          f"steps, seeds {args.seed}..{args.seed + args.seeds - 1}: batch reward/mean, first "
          f"{k} and last {k} steps (mean over seeds, 95% t-interval)")
    for name, runs in sides.items():
        first = [statistics.mean(r[:k]) for r in runs]
        last = [statistics.mean(r[-k:]) for r in runs]
        gain = _interval([b - a for a, b in zip(first, last, strict=True)])
        print(f"  {name:13} {_interval(first)} -> {_interval(last)}   gain {gain}")
    # Both sides draw the same prompts at each step: the per-step difference, paired by seed.
    diff = [statistics.mean(a - b for a, b in zip(x, y, strict=True))
            for x, y in zip(sides["tether"], sides["TRL + tether"], strict=True)]
    print(f"  tether - (TRL + tether), mean over steps: {_interval(diff)}")
    if args.json:
        Path(args.json).write_text(json.dumps(sides, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for (name, runs), color in zip(sides.items(), ("tab:blue", "tab:orange")):
            steps = range(1, len(runs[0]) + 1)
            mean = [statistics.mean(x) for x in zip(*runs)]
            ax.plot(steps, mean, color=color, label=f"{name} (mean of {len(runs)} seeds)")
            for r in runs:
                ax.plot(steps, r, color=color, alpha=0.2, lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("batch reward/mean")
        ax.set_title(f"{args.learn}, {args.generator or 'fp32'} generator, lr {args.lr:g}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")


# Student t's 97.5% quantile by degrees of freedom (a two-sided 95% interval); 1.96 past 10.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228}


def _interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:.3f}"
    h = T975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{m:.3f} [{m - h:.3f}, {m + h:.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="Training steps on each side.")
    parser.add_argument("--seed", type=int, default=0, help="The (first) seed of each side.")
    parser.add_argument("--lr", type=float, default=SETTINGS["lr"], help="AdamW's learning rate.")
    parser.add_argument("--model", help="Model directory (default: tether's tiny model, built if needed).")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Timing: runs of each TRL side (plain, with the plug-in), alternating.")
    parser.add_argument("--json", metavar="FILE",
                        help="Also write every step time (timing) or reward (--learn) here.")
    parser.add_argument("--learn", metavar="ESTIMATOR",
                        help="Compare learning instead of time: tether with this estimator "
                             "against TRL + the plug-in with it.")
    parser.add_argument("--generator", metavar="PRECISION",
                        help="With --learn: the generator's precision on both sides (fp32, bf16, "
                             "fp16, fp8; default fp32).")
    parser.add_argument("--seeds", type=int, default=3, help="With --learn: seeds per side.")
    parser.add_argument("--plot", metavar="PNG", help="With --learn: write the reward curves here.")
    parser.add_argument("--side", choices=["trl", "plugin"], help=argparse.SUPPRESS)  # one child
    args = parser.parse_args()
    if args.side is not None:
        print(json.dumps(run_trl(args.model, args.steps, args.seed, args.lr, args.side == "plugin",
                                 args.learn, args.generator)))
        return
    args.model = model_path(args.model)
    learning(args) if args.learn else timing(args)


if __name__ == "__main__":
    main()
