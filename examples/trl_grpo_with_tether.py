"""TRL's GRPOTrainer with tether: the split in TRL's logs, a tether loss, the dump, the advice.

    .venv/bin/python examples/trl_grpo_with_tether.py [--model PATH] [--estimator tis]
        [--generator bf16] [--steps 20] [--steps-per-generation 2]     (about 40 s on a CPU)
    .venv/bin/python examples/trl_grpo_with_tether.py --correction auto --estimator grpo

A plain TRL GRPO script on Countdown with tether's tiny model (the demo's, built and cached
on first use); the tether lines are the import, the class name and its four arguments.
tether's engine samples in TRL's place at `--generator` precision, so TRL has the sampling
log-probs (mu) the numerical split needs; with two optimizer steps per generation the
second trains on a batch one version stale. At the end: each step's split as TRL logged
it, tether's advice, and `tether inspect` on the dump. docs/integrations.md explains it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from tether.config import load_config
from tether.inspection import inspect_run
from tether.integrations.trl import TetherGRPOTrainer
from tether.setup import resolve_model_path
from tether.tasks import CountdownTask


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local causal-LM directory with tether's character "
                   "tokenizer (default: the demo's tiny model, built on first use)")
    p.add_argument("--estimator", default="tis", help="tether's loss in TRL (default tis; "
                   "'none': TRL's own loss, the split is still logged)")
    p.add_argument("--generator", default="bf16",
                   help="the precision tether's engine samples at (fp32, bf16, fp16, fp8)")
    p.add_argument("--correction", default="fixed", choices=["fixed", "auto"],
                   help="auto: tether chooses the correction per step from the split "
                   "(--estimator then names the objective, e.g. grpo)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--steps-per-generation", type=int, default=2,
                   help="TRL's steps_per_generation: >1 trains on stale batches")
    p.add_argument("--out", default="runs/trl-example", help="TRL's output_dir; the dump goes here")
    a = p.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func, which tether uses
    torch.manual_seed(0)
    path = a.model or resolve_model_path(load_config("configs/demo.yaml"))

    task = CountdownTask(format_weight=0.0)
    problems = [task.train_problem(i) for i in range(a.steps * 16)]
    by_prompt = {q.prompt: q for q in problems}

    def countdown(prompts, completions, **_):
        return [task.reward(by_prompt[q], c).total for q, c in zip(prompts, completions, strict=True)]

    args = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=12, temperature=1.0, learning_rate=3e-4, beta=0.0,
        loss_type="dapo", steps_per_generation=a.steps_per_generation, use_cpu=True,
        bf16=False, logging_steps=1, save_strategy="no", report_to=[], log_level="warning")
    dump = Path(a.out) / "logprobs.jsonl"
    dump.unlink(missing_ok=True)
    trainer = TetherGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        reward_funcs=countdown, args=args,
        train_dataset=Dataset.from_dict({"prompt": [q.prompt for q in problems]}),
        processing_class=AutoTokenizer.from_pretrained(path),
        estimator=None if a.estimator == "none" else a.estimator,  # tether's loss
        generator=a.generator,  # tether's engine samples: TRL gets mu
        resync_tau=None,  # or DLC's ESS re-sync, e.g. 0.5
        correction=a.correction,  # "auto": the correction chosen per step, per cause
        dump=dump)  # every trained token's mu, pi_old, pi_theta, for `tether inspect`
    trainer.train()

    # TRL logs the reward on the steps that generate; the split on every step.
    print(f"{'step':>4} {'reward':>7} {'numerical k3':>13} {'staleness k3':>13} {'stale':>6}")
    for h in trainer.state.log_history:
        if "numerical/k3_kl/mean" in h:
            reward = f"{h['reward']:7.3f}" if "reward" in h else f"{'':7}"
            print(f"{h['step']:>4} {reward} {h['numerical/k3_kl/mean']:13.2e} "
                  f"{h['staleness/k3_kl/mean']:13.2e} {h['staleness/versions/batch']:6.0f}")
    print("\n" + trainer.advice())
    print(f"\n$ tether inspect {dump} --no-plots")
    print(inspect_run(dump, plots=False)[0])


if __name__ == "__main__":
    main()
