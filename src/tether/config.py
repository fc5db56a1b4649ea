"""The run configuration: a validated, frozen tree loaded from YAML with `key=value` overrides.

Every field carries its meaning in `description`; `tether config --fields` prints them.
A wrong key or value fails at load, before any work, with its dotted path in the message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration problem a person can act on: names the key, the value and the fix."""


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Node):
    path: str | None = Field(
        None,
        description="Local Hugging Face causal-LM directory. Empty: tether's own tiny model, "
        "built and warm-started on first use and cached under cache_dir.",
    )
    moe: bool = Field(False, description="Default model only: the Qwen3-MoE variant instead of dense.")
    seed: int = Field(0, description="Default model only: seed of its initialisation and warm-start.")
    warmstart_steps: int = Field(
        900, ge=0, description="Default model only: supervised steps on synthetic worked solutions."
    )
    cache_dir: str = Field(
        "~/.cache/tether/models", description="Where built default models are cached."
    )


class CountdownTaskConfig(_Node):
    name: Literal["countdown"] = Field("countdown", description="Task: countdown or numeric.")
    num_numbers: int = Field(3, ge=2, le=6, description="How many numbers each problem gives.")
    num_min: int = Field(1, ge=0, description="Smallest number drawn.")
    num_max: int = Field(9, ge=1, description="Largest number drawn.")
    target_min: int = Field(1, description="Smallest target.")
    target_max: int = Field(100, description="Largest target.")
    seed: int = Field(0, description="Seed of the problem generator (train and held-out sets).")
    eval_size: int = Field(200, ge=1, description="Size of the fixed held-out evaluation set.")
    format_weight: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Reward for a well-formed answer with allowed numbers that misses the target.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> CountdownTaskConfig:
        if self.num_min > self.num_max:
            raise ValueError(f"num_min ({self.num_min}) must be <= num_max ({self.num_max})")
        if self.target_min > self.target_max:
            raise ValueError(f"target_min ({self.target_min}) must be <= target_max ({self.target_max})")
        return self


class NumericTaskConfig(_Node):
    name: Literal["numeric"] = Field("numeric", description="Task: countdown or numeric.")
    path: str = Field(description="Local JSONL or parquet file of prompt/answer rows (GSM8K style).")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    answer_key: str = Field("answer", description="Column holding the reference answer.")
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of rows held out for evaluation (if no eval_path)."
    )
    eval_path: str | None = Field(None, description="A separate held-out file in the same format.")
    seed: int = Field(0, description="Seed of the train/eval split and the training order.")


TaskConfig = Annotated[CountdownTaskConfig | NumericTaskConfig, Field(discriminator="name")]


class RolloutConfig(_Node):
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine: hf (default) or vllm.")
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32", description="Generator numerics; the trainer stays fp32. fp8: weight-only e4m3."
    )
    prompts_per_step: int = Field(32, ge=1, description="Prompts sampled per step.")
    group_size: int = Field(8, ge=1, description="Responses per prompt (the GRPO group, G).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int = Field(0, ge=0, description="Top-k truncation (0: off).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus truncation (1: off).")
    max_new_tokens: int = Field(16, ge=1, description="Longest response, in tokens.")
    logprobs_topk: int = Field(
        0, ge=0, description="Also record the generator's top-K log-probs (needed by centering)."
    )


class TrainConfig(_Node):
    steps: int = Field(40, ge=0, description="Rollout batches to train on.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm to this.")
    micro_batch: int = Field(64, ge=1, description="Sequences per forward/backward (memory knob).")
    minibatches: int = Field(
        1, ge=1, description="Optimizer steps per rollout batch, on disjoint slices (VESPO's N)."
    )
    estimator: str = Field("grpo", description="Loss preset or objective+correction; `tether estimators` lists them.")
    estimator_params: dict[str, float | str] = Field(
        default_factory=dict, description="Estimator keyword parameters, e.g. {cap: 2.0}."
    )
    adv_std_norm: bool = Field(
        True, description="Divide group-centred rewards by the group's std (GRPO); false: Dr. GRPO."
    )


class SyncConfig(_Node):
    policy: str = Field("every:1", description="When the generator gets new weights: every:K.")


class EvalConfig(_Node):
    every: int = Field(10, ge=0, description="Greedy held-out accuracy every E steps (0: start and end only).")
    batch_size: int = Field(200, ge=1, description="Prompts per evaluation forward.")


class RunConfig(_Node):
    dir: str | None = Field(None, description="Run directory. Empty: runs/<time>-<estimator>.")
    seed: int = Field(0, description="Seed of sampling and training.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default).")
    progress: bool = Field(True, description="Show a progress bar.")


class Config(_Node):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = CountdownTaskConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    sync: SyncConfig = SyncConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.rollout.group_size < 2 and self.train.adv_std_norm:
            raise ValueError(
                "rollout.group_size=1 with train.adv_std_norm=true: group-normalised advantages "
                "need at least 2 responses per prompt; raise rollout.group_size"
            )
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.minibatches:
            raise ValueError(
                f"train.minibatches={self.train.minibatches} must divide the rollout batch "
                f"(rollout.prompts_per_step * rollout.group_size = {batch})"
            )
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {k} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["train.lr=3e-4", "rollout.precision=fp8"]` -> a nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=3e-4)")
        _set_dotted(tree, key.strip(), _parse_value(raw))
    return tree


def _parse_value(raw: str) -> Any:
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        # Drop the union tag pydantic inserts ("task.countdown.x" -> "task.x").
        loc = [str(p) for p in e["loc"] if p not in ("countdown", "numeric")]
        path = ".".join(loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {e['msg']}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply dotted overrides, validate; raise ConfigError naming the key."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    tree = _merge(tree, parse_overrides(overrides or []))
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
    _check_registries(cfg)
    return cfg


def _check_registries(cfg: Config) -> None:
    """Names resolved by registries (estimators, sync policies) are checked at load too."""
    from tether.estimators import build_estimator
    from tether.sync import parse_sync_policy

    try:
        build_estimator(cfg.train.estimator, **cfg.train.estimator_params)
    except ValueError as e:
        raise ConfigError(f"train.estimator / train.estimator_params: {e}") from None
    try:
        parse_sync_policy(cfg.sync.policy)
    except ValueError as e:
        raise ConfigError(f"sync.policy: {e}") from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written into every run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def describe_fields(node: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per leaf key: dotted path, default and description."""
    lines = []
    for name, field in node.model_fields.items():
        ann = field.annotation
        path = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines += describe_fields(ann, path + ".")
        elif name == "task":
            for sub in (CountdownTaskConfig, NumericTaskConfig):
                lines += describe_fields(sub, f"{path}.")
        else:
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            lines.append(f"{path} = {default}\n    {field.description or ''}")
    return lines
