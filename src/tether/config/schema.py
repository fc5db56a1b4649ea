"""The config schema: the sections together, the rules across them, and the keys a resumed
run may change.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from tether.config.base import CrossFieldError, Node
from tether.config.loop import LoopConfig
from tether.config.sections import (
    RESUMABLE,
    DiagnosticsConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SyncConfig,
    TrainConfig,
    WeightsConfig,
)
from tether.config.task import CountdownTaskConfig, TaskConfig


class Config(Node):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = CountdownTaskConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    sync: SyncConfig = SyncConfig()
    loop: LoopConfig = LoopConfig()
    weights: WeightsConfig = WeightsConfig()
    diagnostics: DiagnosticsConfig = Field(DiagnosticsConfig(), json_schema_extra=RESUMABLE)
    log: LogConfig = Field(LogConfig(), json_schema_extra=RESUMABLE)
    eval: EvalConfig = Field(EvalConfig(), json_schema_extra=RESUMABLE)
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _cross_section(self) -> Config:
        """Settings of different sections that conflict: CrossFieldError naming the keys."""
        if self.rollout.group_size < 2 and self.train.adv_std_norm:
            raise CrossFieldError(
                ["rollout.group_size", "train.adv_std_norm"],
                "rollout.group_size=1 with train.adv_std_norm=true: group-normalised advantages "
                "need at least 2 responses per prompt; raise rollout.group_size"
            )
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.minibatches:
            raise CrossFieldError(
                ["train.minibatches", "rollout.prompts_per_step", "rollout.group_size"],
                f"train.minibatches={self.train.minibatches} must divide the rollout batch "
                f"(rollout.prompts_per_step * rollout.group_size = {batch})"
            )
        if batch // self.train.minibatches % self.train.world_size:
            raise CrossFieldError(
                ["train.world_size", "train.minibatches", "rollout.prompts_per_step",
                 "rollout.group_size"],
                f"train.world_size={self.train.world_size} must divide each mini-batch "
                f"({batch // self.train.minibatches} sequences): every rank trains an equal shard"
            )
        if self.loop.mode == "async" and self.sync.lag:
            raise CrossFieldError(
                ["sync.lag", "loop.mode"],
                f"sync.lag={self.sync.lag} with loop.mode=async: sync.lag simulates a stale "
                "generator in the synchronous loop; in async mode staleness comes from the race, "
                "bounded by loop.max_staleness: set sync.lag=0"
            )
        eta, n = self.loop.max_staleness, self.train.minibatches
        if self.loop.mode == "async" and 0 < eta < n:  # measured: N16 at eta 8 lagged 0 versions
            raise CrossFieldError(
                ["loop.max_staleness", "train.minibatches", "loop.mode"],
                f"loop.max_staleness={eta} with train.minibatches={n} and loop.mode=async: a "
                f"batch takes {n} versions, so under {n} no second batch is admitted while one is "
                "in flight; the workers never generate while the trainer trains and nothing "
                f"lags; set loop.max_staleness >= {n} ({n}: one batch ahead, {2 * n}: two), or 0 "
                "(with loop.window_min=0) to take turns on purpose"
            )
        if self.loop.partial and self.rollout.engine != "hf":
            raise CrossFieldError(
                ["loop.partial", "rollout.engine"],
                "loop.partial=true with rollout.engine=vllm: tether's in-process vLLM engine "
                "cannot take new weights between decode steps of a running batch; use "
                "rollout.engine=hf or loop.partial=false"
            )
        if self.train.world_size > 1 and self.rollout.engine == "vllm" and self.loop.mode == "sync":
            raise CrossFieldError(
                ["train.world_size", "rollout.engine", "loop.mode"],
                f"train.world_size={self.train.world_size} with rollout.engine=vllm and "
                "loop.mode=sync: the synchronous loop runs vLLM in the trainer's process, where "
                "vLLM sets up torch.distributed's default process group for itself (and ends it "
                "on close), so the trainer ranks cannot have it; use loop.mode=async (vLLM then "
                "runs in rollout workers), or rollout.engine=hf"
            )
        if self.train.sharding == "fsdp" and self.loop.mode == "sync" and self.rollout.engine == "vllm":
            raise CrossFieldError(
                ["train.sharding", "rollout.engine", "loop.mode"],
                "train.sharding=fsdp with rollout.engine=vllm and loop.mode=sync: the "
                "synchronous loop runs vLLM in the trainer's process, where vLLM sets up "
                "torch.distributed's default process group for itself, which the sharded "
                "trainer needs; use loop.mode=async (vLLM then runs in rollout workers), or "
                "rollout.engine=hf"
            )
        if self.loop.score_old == "worker" and self.train.routing_replay == "r2":
            raise CrossFieldError(
                ["loop.score_old", "train.routing_replay"],
                "loop.score_old=worker with train.routing_replay=r2: R2 replays the experts the "
                "trainer's own pi_old forward chose, so the trainer scores pi_old; set "
                "loop.score_old=trainer (or auto)"
            )
        w = self.weights
        if w.snapshot_dtype == "train" and (self.train.precision, self.rollout.precision) != ("bf16", "bf16"):
            raise CrossFieldError(
                ["weights.snapshot_dtype", "train.precision", "rollout.precision"],
                "weights.snapshot_dtype=train keeps in bf16 what the trainer's bf16 autocast reads "
                "in bf16: it needs train.precision=bf16, and rollout.precision=bf16 because the "
                "generator may load a kept version (a lagged delivery, a resume) and any other "
                "numerics round the master weights differently; use snapshot_dtype=auto or master"
            )
        if w.publish == "delta" and self.loop.mode != "async":
            raise CrossFieldError(
                ["weights.publish", "loop.mode"],
                "weights.publish=delta sends rollout workers deltas: it needs loop.mode=async "
                "(the synchronous loop's engine shares the trainer's process, where publishing "
                "is a copy); use weights.publish=full"
            )
        return self


def resumable_keys(node: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """The keys marked RESUMABLE, in schema order; a whole section ends in "."."""
    keys = []
    for name, field in node.model_fields.items():
        section = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        if (field.json_schema_extra or {}).get("resumable"):
            keys.append(f"{prefix}{name}" + ("." if section else ""))
        elif section:
            keys += resumable_keys(field.annotation, f"{prefix}{name}.")
    return keys
