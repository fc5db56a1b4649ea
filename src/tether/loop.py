"""The synchronous RL loop: generate, score old log-probs, loss, step, sync. One screen.

What it leaves out, on purpose: no KL penalty to a reference model (the papers under
study train without one), no reward model (rewards parse the answer), no filtering of
batches by reward (which rollouts make a batch never depends on their reward).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.checkpoint import (
    RunState,
    check_fresh_run_dir,
    checkpoint_due,
    load_checkpoint,
    save_checkpoint,
)
from tether.config import Config, dump_config
from tether.diagnostics import decompose, is_moe, mismatch_metrics, routing_disagreement
from tether.evaluate import greedy_accuracy, heldout_accuracy
from tether.guards import STOP, check_prompts
from tether.logger import open_logger, read_jsonl
from tether.models import ensure_default_model, load_model
from tether.models.tokenizer import encode_exact
from tether.monitor import current_model_monitor
from tether.rewards import build_reward_fn
from tether.rollout.hf import HFGenerator
from tether.rollout.types import Generator, SamplingParams
from tether.snapshots import SnapshotStore
from tether.sync import Synchronizer, parse_sync_policy
from tether.tasks import build_task
from tether.trainer import RolloutTensors, Trainer, collate, group_advantages, mean_metrics


@dataclass
class RunResult:
    run_dir: Path
    accuracy_before: float  # greedy, held-out
    accuracy_after: float
    sampled_before: float | None  # sampled like the rollouts, held-out (eval.samples per problem)
    sampled_after: float | None
    rewards: list[float]  # mean reward per step


def resolve_model_path(cfg: Config) -> Path:
    """`model.path`, or tether's own tiny model (built and cached on first use)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    return ensure_default_model(cfg.model.cache_dir, cfg.model.moe, cfg.model.seed,
                                cfg.model.warmstart_steps, cfg.task.model_dump())


def build_generator(cfg: Config, model: PreTrainedModel, model_path: Path,
                    tokenizer: PreTrainedTokenizerBase) -> Generator:
    """The rollout engine `rollout.engine` names, holding the trainer's current weights."""
    r = cfg.rollout
    if r.engine == "vllm":
        from tether.rollout.vllm_engine import VLLMGenerator

        generator = VLLMGenerator(model_path, r.precision, eos_token_id=tokenizer.eos_token_id,
                                  max_logprobs=max(20, r.logprobs_topk))
        generator.load_weights(model.state_dict(), version=0)
        return generator
    return HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, r.precision,
                       r.router_noise)


def make_run_dir(cfg: Config, resume: bool = False) -> Path:
    run_dir = Path(cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.train.estimator}")
    if not resume:
        check_fresh_run_dir(run_dir)  # never mix two runs' rows and checkpoints
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir


def train(cfg: Config, resume: bool = False) -> RunResult:
    """Run RL as `cfg` says; `resume`: continue the run in run.dir from its last checkpoint."""
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    r = cfg.rollout
    # Input first: a bad dataset row, reward.fn or prompt fails before any compute is spent.
    task = build_task(cfg.task.name, **cfg.task.model_dump(exclude={"name"}))
    reward_fn = build_reward_fn(cfg.reward.fn, cfg.reward.timeout, task)
    run_dir = make_run_dir(cfg, resume)
    model_path = resolve_model_path(cfg)
    model, tokenizer = load_model(model_path)
    check_prompts(task, tokenizer, getattr(model.config, "max_position_embeddings", None),
                  r.max_new_tokens, cfg.train.steps * r.prompts_per_step)
    sampling = SamplingParams(n=r.group_size, temperature=r.temperature, top_k=r.top_k,
                              top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              logprobs_topk=r.logprobs_topk)
    trainer = Trainer(model, cfg.train, sampling)
    generator = build_generator(cfg, model, model_path, tokenizer)
    sync = Synchronizer(parse_sync_policy(cfg.sync.policy, cfg.train.estimator), generator,
                        trainer, SnapshotStore(model), cfg.sync.lag, cfg.sync.on_trip,
                        minibatches=cfg.train.minibatches)
    state = RunState(trainer, sync)  # what a checkpoint holds (tether.checkpoint)
    start = load_checkpoint(run_dir, state) if resume else 0  # also trims later metric rows
    log = open_logger(run_dir, cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project,
                      cfg.log.wandb_mode, cfg.model_dump(mode="json"))
    d = cfg.diagnostics
    probe = [encode_exact(tokenizer, p.prompt) for p in task.eval_problems()[:d.monitor_prompts]]

    def sample(step: int) -> tuple[list, RolloutTensors]:
        """G samples per prompt at the generator's weight version, rewarded, as tensors."""
        problems = [task.train_problem(step * r.prompts_per_step + i) for i in range(r.prompts_per_step)]
        prompts = [encode_exact(tokenizer, p.prompt) for p in problems]
        rollouts = generator.generate(prompts, [p.id for p in problems], sampling,
                                      seed=cfg.run.seed * 1_000_003 + step)
        for ro in rollouts:
            text = tokenizer.decode(ro.response_ids, skip_special_tokens=True)
            reward = reward_fn(problems[ro.group_id], text)  # parses; a user's fn is guarded
            ro.reward, ro.reward_parts = reward.total, reward.parts
        return rollouts, collate(rollouts, tokenizer.pad_token_id)

    def diagnose(step: int, batch: RolloutTensors, logp_old: torch.Tensor) -> dict[str, float]:
        """The mismatch by cause (docs/metrics.md); MoE routing; the monitor every M steps."""
        out = mismatch_metrics(decompose(batch.logp_rollout, logp_old, trainer.last_logp,
                                         batch.response_mask))
        hf_generator = getattr(generator, "model", None)  # vLLM's weights live in its engine
        if d.routing and is_moe(model) and hf_generator is not None:  # fp32 vs generator numerics
            out |= routing_disagreement(sync.snapshots.model_at(int(batch.versions[0])),
                                        hf_generator, batch, cfg.train.micro_batch)
        if d.monitor_every and (step + 1) % d.monitor_every == 0 and hf_generator is not None:
            out |= current_model_monitor(
                model, hf_generator, probe, replace(sampling, n=d.monitor_samples, logprobs_topk=0),
                cfg.run.seed * 1_000_003 + step + 500_009, tokenizer.eos_token_id,
                tokenizer.pad_token_id, d.rare_prob)
        return out

    def evaluate() -> dict[str, float]:
        """Held-out accuracy, greedy and sampled like the rollouts (eval.samples per problem)."""
        out = {"eval/accuracy": greedy_accuracy(model, tokenizer, task, r.max_new_tokens,
                                                cfg.eval.batch_size)}
        if cfg.eval.samples:
            out["eval/accuracy_sampled"] = heldout_accuracy(
                model, tokenizer, task, replace(sampling, n=cfg.eval.samples, logprobs_topk=0),
                seed=cfg.run.seed + 7919, batch_size=cfg.eval.batch_size)
        return out

    if start == 0:
        log.log({"step": 0, **evaluate()})
    done = read_jsonl(log.path)  # step 0, and after a resume the steps up to its checkpoint
    before, rewards = done[0], [row["reward/mean"] for row in done[1:]]
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
               disable=not cfg.run.progress, desc="train", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        # 1. Generate: G samples per prompt at the generator's weight version; reward them.
        rollouts, batch = sample(step)
        t1 = time.perf_counter()

        # 2. Score old log-probs at the weights that sampled the batch (a kept snapshot).
        logp_old, topk_logp_old = trainer.score_old(batch, sync.old_model(generator.version))
        t2 = time.perf_counter()

        # 3. Staleness check (ess policy, on_trip=regenerate): a batch whose ESS at the current
        #    weights is below tau is dropped; the generator re-syncs and the prompts are resampled.
        if sync.check(batch, logp_old, generator.version):
            rollouts, batch = sample(step)
            logp_old, topk_logp_old = trainer.score_old(batch, model)
        t3 = time.perf_counter()

        # 4. Loss and optimizer step(s) at the current weights.
        advantages = group_advantages(batch.rewards, batch.group_ids, cfg.train.adv_std_norm)
        step_metrics = mean_metrics(trainer.train_on(batch, advantages, logp_old, topk_logp_old))
        t4 = time.perf_counter()

        # 5. Diagnostics: numerical / staleness / total split, MoE routing, current-model monitor.
        diag = diagnose(step, batch, logp_old)
        t5 = time.perf_counter()

        # 6. Sync: the policy (ESS trip, interval) and sync.lag decide the generator's next version.
        sync_metrics = sync.after_step(step)
        t6 = time.perf_counter()

        # 7. Log, and evaluate every E steps and at the end.
        row = {
            "step": step + 1,
            "version": trainer.version,
            "generator_version": generator.version,
            "reward/mean": batch.rewards.mean().item(),
            "reward/correct": sum(ro.reward_parts.get("correct", 0.0) for ro in rollouts) / len(rollouts),
            "reward/errors": sum(ro.reward_parts.get("error", 0.0) for ro in rollouts),
            "response/length_mean": batch.response_mask.sum(1).mean().item(),
            "response/truncated_frac": sum(ro.finish_reason == "length" for ro in rollouts) / len(rollouts),
            "time/generate": t1 - t0, "time/old_logprob": t2 - t1, "time/train": t4 - t3,
            "time/diagnostics": t5 - t4, "time/sync": (t3 - t2) + (t6 - t5), "time/step": t6 - t0,
            **step_metrics, **diag, **sync_metrics,
        }
        if step + 1 == cfg.train.steps or (cfg.eval.every and (step + 1) % cfg.eval.every == 0):
            row |= evaluate()
        log.log(row)
        rewards.append(row["reward/mean"])
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", acc=row.get("eval/accuracy", "-"),
                        v=trainer.version)

        # 8. Checkpoint every K steps and at the end; on repeated bad steps or SIGINT/SIGTERM,
        #    checkpoint and stop.
        stop = trainer.guard.stop_reason(step + 1, run_dir) or STOP.stop_reason(step + 1, run_dir)
        if stop or checkpoint_due(step + 1, cfg.run.checkpoint_every, cfg.train.steps):
            save_checkpoint(run_dir, step + 1, state, keep=cfg.run.keep_checkpoints)
        if stop:
            raise stop

    after = evaluate() if start == cfg.train.steps else row
    log.close()
    generator.close()
    model.save_pretrained(run_dir / "final")  # safetensors, loads with from_pretrained
    tokenizer.save_pretrained(run_dir / "final")
    return RunResult(run_dir, before["eval/accuracy"], after["eval/accuracy"],
                     before.get("eval/accuracy_sampled"), after.get("eval/accuracy_sampled"), rewards)

