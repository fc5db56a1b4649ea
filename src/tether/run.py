"""The driver's run: what both loops need before the first step, and what ends it.

`build_run` builds the parts every process builds (tether.setup) plus the driver's own:
the run directory, the trainer, the monitor's prompts. The rollout engine and the weight
bookkeeping differ between the synchronous loop (one engine in this process) and the
asynchronous one (engines in worker processes), so each loop builds its own (tether.loops).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.checkpoint import RunState, check_fresh_run_dir, list_checkpoints, load_checkpoint
from tether.config import Config, dump_config
from tether.distributed import TrainerRanks, start_sharded
from tether.errors import EnvironmentFault, describe_os_error, os_errors_at
from tether.guards import check_prompts
from tether.logger import RunLogger, open_logger
from tether.models.tokenizer import encode_exact
from tether.rollout.types import SamplingParams
from tether.setup import (
    build_task_and_reward,
    check_routing_replay,
    load_policy,
    resolve_device,
    sampling_seed,
    seed_process,
)
from tether.tasks.base import Task
from tether.trainer import Trainer
from tether.trainer.spmd import (
    Gathered,
    RankContext,
    ShardedCheckpoint,
    ShardedSnapshots,
    evaluate,
    export,
    rank_context,
)
from tether.weights.snapshots import SnapshotStore


@dataclass
class RunResult:
    run_dir: Path
    accuracy_before: float  # greedy, held-out
    accuracy_after: float
    sampled_before: float | None  # sampled like the rollouts, held-out (eval.samples per problem)
    sampled_after: float | None
    rewards: list[float]  # mean reward per step


@dataclass
class Run:
    """The parts of a run shared by both loops."""

    cfg: Config
    run_dir: Path
    task: Task
    reward_fn: Any  # (problem, response text) -> Reward
    model_path: Path
    model: PreTrainedModel  # the trainer's (fp32, current weights)
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    trainer: Trainer
    probe: list[list[int]]  # the current-model monitor's prompts (held-out)
    ctx: RankContext  # rank 0's parts (the trainer's)
    ranks: TrainerRanks | None  # train.sharding=fsdp: every trainer rank, started with the run

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(ctx, *args)` with the trainer's weights (tether.trainer.spmd): here, or sharded
        on every trainer rank together."""
        return self.ranks.call(fn, *args) if self.ranks is not None else fn(self.ctx, *args)

    def sampling_seed(self, index: int) -> int:
        """The generator's seed for the `index`-th rollout batch (a step, or an async slot)."""
        return sampling_seed(self.cfg, index)

    def start(self, state: RunState, resume: bool) -> tuple[int, RunLogger]:
        """Restore the last checkpoint (when resuming) and open the metric log; the start step."""
        start = load_checkpoint(self.run_dir, state) if resume else 0  # also trims later rows
        cfg = self.cfg
        log = open_logger(self.run_dir, cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project,
                          cfg.log.wandb_mode, cfg.model_dump(mode="json"))
        return start, log

    def generator_model(self) -> PreTrainedModel:
        """The whole model an in-process generator copies: the trainer's module, or, sharded
        (no rank holds it whole), one loaded from the model directory (the weights a run
        starts from; a publish brings the generator to any other version)."""
        return self.model if self.ranks is None else load_policy(self.cfg, self.model_path)[1]

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The trainer's current weights as a state dict (sharded: gathered when first read)."""
        return Gathered(self.ranks) if self.ranks is not None else self.model.state_dict()

    def snapshots(self) -> SnapshotStore | ShardedSnapshots:
        """The store of kept versions `weights.*` asks for (sharded: each rank its shards)."""
        if self.ranks is not None:
            assert self.ctx.kept is not None
            return ShardedSnapshots(self.ranks, self.ctx.kept)
        return SnapshotStore.of(self.cfg, self.model)

    def state(self, sync: Any) -> RunState:
        """What a checkpoint holds, with the loop's synchronizer (or scheduler) `sync`."""
        shards = ShardedCheckpoint(self.ranks) if self.ranks is not None else None
        return RunState(self.trainer, sync, shards=shards)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy at the trainer's weights (tether.evaluate.heldout_metrics)."""
        return self.call(evaluate)

    def eval_due(self, step: int) -> bool:
        """After `step` steps: every eval.every steps and after the last one."""
        every = self.cfg.eval.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def finish(self, before: dict[str, Any], after: dict[str, Any],
               rewards: list[float]) -> RunResult:
        """Save the trained model (safetensors, loads with from_pretrained); the result."""
        final = self.run_dir / "final"
        with os_errors_at(final / "model.safetensors"):
            if self.ranks is not None:
                self.ranks.call(export, final)  # gathered, written by rank 0
            else:
                self.model.save_pretrained(final)
        self.tokenizer.save_pretrained(final)
        return RunResult(self.run_dir, before["eval/accuracy"], after["eval/accuracy"],
                         before.get("eval/accuracy_sampled"), after.get("eval/accuracy_sampled"),
                         rewards)


def build_run(cfg: Config, resume: bool = False) -> Run:
    """The input first (task, reward), so a bad dataset row or reward.fn fails before the
    model loads; then the run directory, the model, the prompts' fit in its context, and
    the trainer."""
    r = cfg.rollout
    seed_process(cfg)
    task, reward_fn = build_task_and_reward(cfg)
    run_dir = make_run_dir(cfg, resume)
    device = resolve_device(cfg.run.device)
    sharded = cfg.train.sharding == "fsdp"
    # Sharded, the whole model is loaded in host memory and only shards reach the device.
    model_path, model, tokenizer = load_policy(cfg, device=torch.device("cpu") if sharded else device)
    check_routing_replay(cfg.train.routing_replay, model)
    check_prompts(task, tokenizer, getattr(model.config, "max_position_embeddings", None),
                  r.max_new_tokens, cfg.train.steps * r.prompts_per_step)
    ranks = None
    if sharded:
        ranks = start_sharded(cfg, model_path, model, tokenizer, task, reward_fn, device)
        ctx = ranks.ctx
    else:
        ctx = rank_context(cfg, model, tokenizer, task=task, reward_fn=reward_fn)
    probe = [encode_exact(tokenizer, p.prompt)
             for p in task.eval_problems()[:cfg.diagnostics.monitor_prompts]]
    return Run(cfg, run_dir, task, reward_fn, model_path, model, tokenizer, ctx.sampling,
               ctx.trainer, probe, ctx, ranks)


def with_run_dir(cfg: Config) -> Config:
    """`cfg` with `run.dir` resolved (empty: runs/<time>-<estimator>), so the caller knows
    where the run writes before it starts."""
    if cfg.run.dir:
        return cfg
    run_dir = f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.train.estimator}"
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": run_dir})})


def make_run_dir(cfg: Config, resume: bool = False) -> Path:
    """RUN_DIR with the resolved config.yaml in it; a new run refuses another run's directory.
    A directory that cannot be made or written is the machine's fault (EnvironmentFault)."""
    run_dir = Path(with_run_dir(cfg).run.dir)
    if not resume:
        check_fresh_run_dir(run_dir)  # never mix two runs' rows and checkpoints
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    except OSError as e:
        raise EnvironmentFault(f"run.dir={run_dir}: cannot write the run directory: "
                               f"{describe_os_error(e)}; choose a run.dir on a writable disk "
                               "with free space") from e
    return run_dir


def discard_unstarted(run_dir: Path, before: set[str] | None) -> bool:
    """After a new run failed before its first step ended: remove what it wrote to RUN_DIR
    (`before`: the entries RUN_DIR held before, None when it did not exist), so the same
    command works once the cause is fixed. A run with a checkpoint or a trained step's row
    keeps its directory (`--resume` continues it). Returns whether it was kept."""
    metrics = run_dir / "metrics.jsonl"  # lines, not parsed rows: a kill may cut the last
    rows = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    if list_checkpoints(run_dir) or rows > 1:
        return True
    if not run_dir.is_dir():
        return False
    if before is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return False
    for entry in set(os.listdir(run_dir)) - before:
        path = run_dir / entry
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return False
