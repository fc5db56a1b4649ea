"""The synchronous RL loop: generate, score old log-probs, loss, step, sync. One screen.

What it leaves out, on purpose: no KL penalty to a reference model (the papers under
study train without one), no reward model (rewards parse the answer), no filtering of
batches by reward (which rollouts make a batch never depends on their reward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tether.config import Config, dump_config
from tether.evaluate import greedy_accuracy
from tether.logger import JsonlLogger
from tether.models import ensure_default_model, load_model
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.snapshots import SnapshotStore
from tether.sync import parse_sync_policy
from tether.tasks import build_task
from tether.trainer import Trainer, collate, group_advantages, mean_metrics


@dataclass
class RunResult:
    run_dir: Path
    accuracy_before: float
    accuracy_after: float
    rewards: list[float]  # mean reward per step


def resolve_model_path(cfg: Config) -> Path:
    """`model.path`, or tether's own tiny model (built and cached on first use)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    task_kwargs = cfg.task.model_dump(exclude={"name", "seed", "eval_size", "format_weight"})
    return ensure_default_model(cfg.model.cache_dir, cfg.model.moe, cfg.model.seed,
                                cfg.model.warmstart_steps, task_kwargs)


def make_run_dir(cfg: Config) -> Path:
    run_dir = Path(cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.train.estimator}")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir


def train(cfg: Config) -> RunResult:
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    model, tokenizer = load_model(resolve_model_path(cfg))
    task = build_task(cfg.task.name, **cfg.task.model_dump(exclude={"name"}))
    run_dir = make_run_dir(cfg)
    r = cfg.rollout
    sampling = SamplingParams(n=r.group_size, temperature=r.temperature, top_k=r.top_k,
                              top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              logprobs_topk=r.logprobs_topk)
    trainer = Trainer(model, cfg.train, sampling)
    generator = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, r.precision)
    snapshots = SnapshotStore(model)
    snapshots.put(0, model.state_dict())
    policy = parse_sync_policy(cfg.sync.policy)
    log = JsonlLogger(run_dir / "metrics.jsonl")

    def evaluate() -> float:
        return greedy_accuracy(model, tokenizer, task, max_new_tokens=r.max_new_tokens,
                               batch_size=cfg.eval.batch_size)

    acc_before = evaluate()
    log.log({"step": 0, "eval/accuracy": acc_before})
    rewards: list[float] = []
    bar = tqdm(range(cfg.train.steps), disable=not cfg.run.progress, desc="train", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        # 1. Generate: G samples per prompt at the generator's weight version; reward them.
        problems = [task.train_problem(step * r.prompts_per_step + i) for i in range(r.prompts_per_step)]
        prompts = [encode_exact(tokenizer, p.prompt) for p in problems]
        rollouts = generator.generate(prompts, [p.id for p in problems], sampling,
                                      seed=cfg.run.seed * 1_000_003 + step)
        for ro in rollouts:
            text = tokenizer.decode(ro.response_ids, skip_special_tokens=True)
            reward = task.reward(problems[ro.group_id], text)
            ro.reward, ro.reward_parts = reward.total, reward.parts
        t1 = time.perf_counter()

        # 2. Score old log-probs at the weights that sampled the batch (a kept snapshot).
        batch = collate(rollouts, tokenizer.pad_token_id)
        advantages = group_advantages(batch.rewards, batch.group_ids, cfg.train.adv_std_norm)
        old_model = model if generator.version == trainer.version else snapshots.model_at(generator.version)
        logp_old, topk_logp_old = trainer.score_old(batch, old_model)
        t2 = time.perf_counter()

        # 3. Loss and optimizer step(s) at the current weights.
        step_metrics = mean_metrics(trainer.train_on(batch, advantages, logp_old, topk_logp_old))
        t3 = time.perf_counter()

        # 4. Sync: the policy decides which version the generator holds next.
        target = policy.target_version(step, trainer.version, generator.version)
        if target is not None:
            generator.load_weights(model.state_dict(), target)
            snapshots.put(target, model.state_dict())  # logp_old of its batches needs these weights
        snapshots.release(keep={generator.version})
        t4 = time.perf_counter()

        # 5. Log, and evaluate every E steps and at the end.
        row = {
            "step": step + 1,
            "version": trainer.version,
            "generator_version": generator.version,
            "reward/mean": batch.rewards.mean().item(),
            "reward/correct": sum(ro.reward_parts.get("correct", 0.0) for ro in rollouts) / len(rollouts),
            "response/length_mean": batch.response_mask.sum(1).mean().item(),
            "response/truncated_frac": sum(ro.finish_reason == "length" for ro in rollouts) / len(rollouts),
            "snapshots/count": len(snapshots.versions),
            "time/generate": t1 - t0, "time/old_logprob": t2 - t1,
            "time/train": t3 - t2, "time/sync": t4 - t3, "time/step": t4 - t0,
            **step_metrics,
        }
        if step + 1 == cfg.train.steps or (cfg.eval.every and (step + 1) % cfg.eval.every == 0):
            row["eval/accuracy"] = evaluate()
        log.log(row)
        rewards.append(row["reward/mean"])
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", acc=row.get("eval/accuracy", "-"),
                        v=trainer.version)

    acc_after = evaluate() if cfg.train.steps == 0 else row["eval/accuracy"]
    model.save_pretrained(run_dir / "final")  # safetensors, loads with from_pretrained
    tokenizer.save_pretrained(run_dir / "final")
    return RunResult(run_dir, acc_before, acc_after, rewards)

