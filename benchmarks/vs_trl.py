"""tether against TRL's GRPOTrainer on the same work, side by side in one run.

    .venv/bin/python benchmarks/vs_trl.py                      # 10 steps each, prints the table
    .venv/bin/python benchmarks/vs_trl.py --steps 20 --json out.json

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

TRL runs in its own environment (`make install-trl`: .venv-trl, TRL's pins differ from
tether's transformers pin), imports tether's task code from src/ for the reward, and
reports its step times to this script as JSON. A step's time is wall time from its start
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

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"prompts": 32, "group": 8, "max_new_tokens": 12, "temperature": 1.0, "lr": 1e-4}


def run_tether(model_dir: str, steps: int, seed: int) -> dict:
    """tether's synchronous loop; step times from its metrics (time/step and phases)."""
    from tether.config import load_config
    from tether.logger import read_jsonl
    from tether.loops import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs/countdown.yaml", [
            f"model.path={model_dir}", f"train.steps={steps}", f"train.lr={SETTINGS['lr']}",
            "train.estimator=grpo", f"rollout.prompts_per_step={SETTINGS['prompts']}",
            f"rollout.group_size={SETTINGS['group']}",
            f"rollout.max_new_tokens={SETTINGS['max_new_tokens']}",
            f"rollout.temperature={SETTINGS['temperature']}", "task.format_weight=0.0",
            "diagnostics.monitor_every=0", "eval.every=0", "eval.samples=0", "eval.batch_size=8",
            "task.eval_size=8", "run.checkpoint_every=0", "run.progress=false", "run.threads=1",
            f"run.seed={seed}", f"run.dir={tmp}/run"])
        train(cfg)
        rows = [r for r in read_jsonl(Path(tmp) / "run/metrics.jsonl") if r.get("step", 0) > 0]
    phases = ("generate", "old_logprob", "train", "diagnostics", "sync")
    return {"step_s": [r["time/step"] for r in rows], "reward": [r["reward/mean"] for r in rows],
            "tokens": [r["response/length_mean"] * SETTINGS["prompts"] * SETTINGS["group"] for r in rows],
            "phases_s": {p: [r[f"time/{p}"] for r in rows] for p in phases}}


def run_trl(model_dir: str, steps: int, seed: int) -> dict:
    """TRL's GRPOTrainer (run inside .venv-trl)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tether.tasks import CountdownTask

    torch.set_num_threads(1)
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
            temperature=SETTINGS["temperature"], top_k=0, top_p=1.0, learning_rate=SETTINGS["lr"],
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
            num_iterations=1, steps_per_generation=1, use_cpu=True, bf16=False, fp16=False,
            logging_steps=1, save_strategy="no", report_to=[], seed=seed, shuffle_dataset=False,
            dataloader_num_workers=0, disable_tqdm=True)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        trainer = GRPOTrainer(model=model, reward_funcs=countdown_reward, args=args,
                              train_dataset=data, processing_class=tokenizer, callbacks=[clock])
        trainer.train()
        logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"step_s": clock.times, "reward": [h["reward"] for h in logs],
            "tokens": [h.get("completions/mean_length", 0.0) * batch for h in logs]}


def summary(side: dict) -> dict:
    steps = side["step_s"][1:] or side["step_s"]  # without the warm-up step
    tok = side["tokens"][1:] or side["tokens"]
    return {"step_s": statistics.mean(steps), "tokens_per_s": sum(tok) / sum(steps),
            "reward_first": side["reward"][0], "reward_last": side["reward"][-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="Training steps on each side.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", help="Model directory (default: tether's tiny model, built if needed).")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"),
                        help="The Python of the environment TRL is installed in.")
    parser.add_argument("--json", metavar="FILE", help="Also write every step time here.")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: one side
    args = parser.parse_args()
    if args.side == "trl":
        print(json.dumps(run_trl(args.model, args.steps, args.seed)))
        return
    if args.model is None:
        from tether.config import load_config
        from tether.setup import resolve_model_path

        args.model = str(resolve_model_path(load_config(ROOT / "configs/countdown.yaml")))
    if not Path(args.trl_python).is_file():
        sys.exit(f"no TRL environment at {args.trl_python}: run `make install-trl` first")
    tether_side = run_tether(args.model, args.steps, args.seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([args.trl_python, __file__, "--side", "trl", "--model", args.model,
                          "--steps", str(args.steps), "--seed", str(args.seed)],
                         capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        sys.exit(f"the TRL side failed:\n{out.stderr[-4000:]}")
    trl_side = json.loads(out.stdout.strip().splitlines()[-1])
    t, r = summary(tether_side), summary(trl_side)
    print(f"{args.steps} steps of {SETTINGS['prompts']} prompts x {SETTINGS['group']}, "
          f"<= {SETTINGS['max_new_tokens']} new tokens, fp32, 1 thread; model {args.model}")
    print(f"{'':8} {'s/step':>8} {'tokens/s':>9} {'reward first -> last':>22}")
    for name, s in (("tether", t), ("TRL", r)):
        print(f"{name:8} {s['step_s']:8.3f} {s['tokens_per_s']:9.0f} "
              f"{s['reward_first']:10.3f} -> {s['reward_last']:.3f}")
    phases = {p: statistics.mean(v[1:] or v) for p, v in tether_side["phases_s"].items()}
    print("tether phases (s/step): " + ", ".join(f"{p} {v:.3f}" for p, v in phases.items()))
    print(f"tether step time / TRL step time: {t['step_s'] / r['step_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"tether": tether_side, "trl": trl_side}, indent=1))


if __name__ == "__main__":
    main()
