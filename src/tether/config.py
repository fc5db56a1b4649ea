"""The run configuration: a validated, frozen tree loaded from YAML with `key=value` overrides.

Every field carries its meaning in `description`; `tether config --fields` prints them.
A wrong key or value fails at load, before any work, with its dotted path in the message.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


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
    use_all: bool = Field(
        True, description="Targets need every number (the classic game); false: subsets suffice."
    )
    train_size: int = Field(
        0, ge=0, description="Cycle through only the first N training problems (0: endless).",
    )
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
    router_noise: float = Field(
        0.0, ge=0.0, description="MoE, hf engine: std of Gaussian noise the generator adds to its "
        "router logits (routing disagreement at equal weights; docs/mismatch.md). 0: off.",
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
    max_bad_steps: int = Field(
        5, ge=1,
        description="Stop the run (with a checkpoint, exit code 3) after this many optimizer steps "
        "in a row were skipped for a non-finite log-prob, advantage, loss or gradient norm.",
    )
    world_size: int = Field(
        1, ge=1,
        description="Data-parallel trainer ranks (processes on this machine, torch.distributed): "
        "each trains on its shard of every mini-batch, with the whole mini-batch's loss and "
        "gradient under the estimator's aggregation. See docs/distributed.md.",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="world_size > 1: torch.distributed backend. auto: nccl when the trainer's "
        "weights are on a GPU, else gloo.",
    )


class SyncConfig(_Node):
    policy: str = Field(
        "auto",
        description="When the generator gets new weights: every:K (after every K-th step), "
        "bounded:K (only when it would otherwise be more than K versions behind), "
        "ess:TAU[:max=M] (every step, lagged, plus a re-sync to the current weights when the "
        "token ESS of pi_theta/pi_old on the incoming batch falls below TAU; max=M: also after "
        "M steps without one), auto (the estimator preset's: dlc -> ess:0.5, else every:1). "
        "See docs/mismatch.md.",
    )
    lag: int = Field(
        0, ge=0,
        description="Staleness source: a delivery hands the generator the weights of `lag` "
        "versions ago (DLC's stale generator; 0: the current ones). ESS re-syncs bypass it.",
    )
    on_trip: Literal["train", "regenerate"] = Field(
        "train",
        description="ess policy: what happens to the batch whose ESS tripped the re-sync: "
        "train (train on it, the estimator caps its weights; re-sync after the step) or "
        "regenerate (re-sync now, drop it, sample the same prompts again).",
    )


class LoopConfig(_Node):
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generate, then train, in turn (staleness only from sync.lag and "
        "train.minibatches). async: rollout workers generate while the trainer trains; "
        "staleness is what the race gives, bounded by max_staleness. See docs/async.md.",
    )
    workers: int = Field(
        1, ge=1,
        description="async: rollout workers (processes, or Ray actors with backend=ray), each "
        "with its own engine.",
    )
    max_staleness: int = Field(
        1, ge=0,
        description="async: admission bound eta. A worker starts a batch only if its training "
        "will start at most eta versions after the weights it samples with (AReaL's "
        "max_head_offpolicyness); nothing is generated only to be thrown away.",
    )
    partial: bool = Field(
        False,
        description="async, hf engine: partial rollouts. A published version reaches a worker "
        "between decode steps of its in-flight batch (the KV cache is recomputed); each token "
        "records the version that sampled it, and pi_old is scored per token.",
    )
    worker_threads: int = Field(
        1, ge=1, description="async: torch CPU threads in each rollout worker.",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="async: where rollout workers run. local: processes on this machine, "
        "weights through shared memory. ray: one Ray actor per worker, on this machine or a "
        "cluster, weights through the Ray object store; a worker that dies is replaced and its "
        "prompts issued again (pip install -e '.[ray]'). See docs/distributed.md.",
    )
    ray_address: str | None = Field(
        None,
        description="backend=ray: the cluster to join ('auto': the one this machine belongs "
        "to, after `ray start`; or 'host:port'). None: start a local Ray with this machine's CPUs.",
    )
    worker_cpus: float = Field(
        1.0, gt=0.0, description="backend=ray: CPUs Ray reserves for each rollout worker actor.",
    )
    worker_gpus: float = Field(
        0.0, ge=0.0,
        description="backend=ray: GPUs Ray reserves for each rollout worker actor (fractions "
        "share a GPU; 0: CPU engines).",
    )


class DiagnosticsConfig(_Node):
    monitor_every: int = Field(
        10, ge=0,
        description="Current-model monitor every M steps (0: off): sample from the trainer's "
        "weights, score with the generator; KL and its share on rare tokens (monitor/*).",
    )
    monitor_prompts: int = Field(8, ge=1, description="Monitor: held-out prompts in the probe set.")
    monitor_samples: int = Field(4, ge=1, description="Monitor: samples per probe prompt.")
    rare_prob: float = Field(
        0.05, gt=0.0, lt=1.0,
        description="Monitor: a token is rare when the generator gives it probability below this.",
    )
    routing: bool = Field(
        True, description="MoE models: measure routing disagreement every step (two no-grad forwards).",
    )


class LogConfig(_Node):
    tensorboard: bool = Field(False, description="Also write metrics to TensorBoard (RUN_DIR/tb).")
    wandb: bool = Field(False, description="Also write metrics to Weights & Biases (RUN_DIR/wandb).")
    wandb_project: str = Field("tether", description="Weights & Biases project name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: no network, `wandb sync RUN_DIR/wandb/offline-run-*` later.",
    )


class RewardConfig(_Node):
    fn: str | None = Field(
        None,
        description="Your own reward instead of the task's: 'package.module:function' or "
        "'path/to/file.py:function', called as fn(problem, response) -> float or Reward. "
        "Held-out accuracy stays the task's. See docs/reliability.md.",
    )
    timeout: float = Field(
        5.0, gt=0.0,
        description="Seconds one call of reward.fn may take; a slower or failing call scores 0 "
        "and is counted in reward/errors (the run goes on).",
    )

    @field_validator("fn")
    @classmethod
    def _spec(cls, fn: str | None) -> str | None:
        if fn is not None:
            module, sep, name = fn.rpartition(":")
            if not sep or not module or not name.isidentifier():
                raise ValueError("must be 'package.module:function' or 'path/to/file.py:function'")
        return fn


class EvalConfig(_Node):
    every: int = Field(10, ge=0, description="Greedy held-out accuracy every E steps (0: start and end only).")
    batch_size: int = Field(200, ge=1, description="Prompts per evaluation forward.")
    samples: int = Field(
        4, ge=0, description="Also held-out accuracy sampled like the rollouts: samples per "
        "problem (0: greedy only).",
    )


class RunConfig(_Node):
    dir: str | None = Field(None, description="Run directory. Empty: runs/<time>-<estimator>.")
    seed: int = Field(0, description="Seed of sampling and training.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default).")
    progress: bool = Field(True, description="Show a progress bar.")
    checkpoint_every: int = Field(
        10, ge=0,
        description="Checkpoint (RUN_DIR/checkpoints) every K steps, and always after the last "
        "step and before any stop (0: only then). `tether train --resume RUN_DIR` continues.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many of the newest checkpoints to keep.")


class Config(_Node):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = CountdownTaskConfig()
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    sync: SyncConfig = SyncConfig()
    loop: LoopConfig = LoopConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    run: RunConfig = RunConfig()

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        if self.rollout.group_size < 2 and self.train.adv_std_norm:
            raise ValueError(
                "rollout.group_size=1 with train.adv_std_norm=true: group-normalised advantages "
                "need at least 2 responses per prompt; raise rollout.group_size"
            )
        if self.rollout.router_noise > 0 and self.rollout.engine != "hf":
            raise ValueError("rollout.router_noise perturbs the hf engine's MoE router: "
                             "set rollout.engine=hf")
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.minibatches:
            raise ValueError(
                f"train.minibatches={self.train.minibatches} must divide the rollout batch "
                f"(rollout.prompts_per_step * rollout.group_size = {batch})"
            )
        if batch // self.train.minibatches % self.train.world_size:
            raise ValueError(
                f"train.world_size={self.train.world_size} must divide each mini-batch "
                f"({batch // self.train.minibatches} sequences): every rank trains an equal shard"
            )
        if self.loop.mode == "async" and self.sync.lag:
            raise ValueError(
                f"sync.lag={self.sync.lag} with loop.mode=async: sync.lag simulates a stale "
                "generator in the synchronous loop; in async mode staleness comes from the race, "
                "bounded by loop.max_staleness: set sync.lag=0"
            )
        if self.loop.partial and self.loop.mode != "async":
            raise ValueError("loop.partial=true needs loop.mode=async (weights change mid-batch "
                             "only while generation and training overlap)")
        if self.loop.backend == "ray" and self.loop.mode != "async":
            raise ValueError("loop.backend=ray places the asynchronous loop's rollout workers: "
                             "set loop.mode=async (the synchronous loop has no workers)")
        if self.loop.backend == "ray" and self.loop.partial:
            raise ValueError("loop.partial=true with loop.backend=ray: a Ray actor loads new "
                             "weights between batches only; use loop.backend=local for partial "
                             "rollouts, or loop.partial=false")
        if self.loop.partial and self.rollout.engine != "hf":
            raise ValueError(
                "loop.partial=true with rollout.engine=vllm: tether's in-process vLLM engine "
                "cannot take new weights between decode steps of a running batch; use "
                "rollout.engine=hf or loop.partial=false"
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


def _leaf_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out += _leaf_paths(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format_errors(err: ValidationError, where: dict[str, str] | None = None) -> str:
    """One line per error: dotted key, what is wrong, and `(FILE:LINE)` when it came from a file."""
    lines = []
    for e in err.errors():
        # Drop the union tag pydantic inserts ("task.countdown.x" -> "task.x").
        loc = [str(p) for p in e["loc"] if p not in ("countdown", "numeric")]
        if e["type"] == "union_tag_invalid":
            loc.append("name")
        path = ".".join(loc) or "(top level)"
        at = next((f" ({w})" for k, w in (where or {}).items() if k == path or k.startswith(path + ".")), "")
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], _keys_at(loc[:-1]), n=1)
            hint = f"; did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else ""
            lines.append(f"{path}: unknown key{at}{hint}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {e['msg']}{shown}{at}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _keys_at(loc: list[str]) -> list[str]:
    """Valid keys of the config section at `loc` (both task kinds for `task`)."""
    nodes: list[type[BaseModel]] = [Config]
    for key in loc:
        nxt = []
        for node in nodes:
            field = node.model_fields.get(key)
            if field is None:
                continue
            if key == "task" and node is Config:
                nxt += [CountdownTaskConfig, NumericTaskConfig]
            elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                nxt.append(field.annotation)
        nodes = nxt
    return sorted({k for node in nodes for k in node.model_fields})


def _key_lines(text: str, source: str) -> dict[str, str]:
    """Dotted key -> "FILE:LINE" for every key written in a YAML file (nodes only, nothing built)."""
    out: dict[str, str] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                out[key] = f"{source}:{key_node.start_mark.line + 1}"
                walk(value_node, key + ".")

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply dotted overrides, validate; raise ConfigError naming the key."""
    tree: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        try:
            tree = yaml.safe_load(text) or {}
            where = _key_lines(text, str(p))
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            at = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
            context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context_mark and e.problem else ""
            raise ConfigError(f"{at}: YAML syntax error: {e.problem or e.context}{context}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    extra = parse_overrides(overrides or [])
    for key in _leaf_paths(extra):  # an override wins over the file: point at it instead
        where[key] = "command line"
    tree = _merge(tree, extra)
    if isinstance(tree.get("task"), dict) and "name" not in tree["task"]:
        tree["task"] = {"name": "countdown", **tree["task"]}  # the default task
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, where)) from None
    _check_registries(cfg)
    return _resolve_sync(cfg)


def _check_registries(cfg: Config) -> None:
    """Names resolved by registries (estimators, sync policies) are checked at load too."""
    from tether.estimators import build_estimator
    from tether.weights.policy import BoundedK, parse_sync_policy

    try:
        estimator = build_estimator(cfg.train.estimator, **cfg.train.estimator_params)
    except ValueError as e:
        raise ConfigError(f"train.estimator / train.estimator_params: {e}") from None
    if estimator.centering and cfg.rollout.logprobs_topk == 0:
        raise ConfigError(
            f"train.estimator={cfg.train.estimator} centers scores over the generator's top-K "
            "head: set rollout.logprobs_topk > 0 (e.g. 8)"
        )
    try:
        policy = parse_sync_policy(cfg.sync.policy, cfg.train.estimator)
    except ValueError as e:
        raise ConfigError(f"sync.policy: {e}") from None
    if cfg.sync.on_trip == "regenerate" and not policy.measures_ess:
        raise ConfigError(
            f"sync.on_trip=regenerate applies to the batch that trips an ESS re-sync, but "
            f"sync.policy resolves to {policy.spec}: use sync.policy=ess:TAU or on_trip=train"
        )
    if cfg.loop.mode == "async":
        _check_async_policy(cfg, policy)
    bound = policy.k if isinstance(policy, BoundedK) else None
    if bound is not None and cfg.sync.lag > bound:
        raise ConfigError(
            f"sync.lag={cfg.sync.lag} with sync.policy={policy.spec}: a delivery at lag "
            f"{cfg.sync.lag} can never bring the generator within {bound} versions; "
            f"lower sync.lag to <= {bound} or raise K"
        )
    if cfg.loop.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("loop.backend=ray needs Ray, which is not installed: "
                          "pip install -e '.[ray]' (or loop.backend=local)")
    from tether.logger import require

    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.log, key):
            try:
                require(package, f"log.{key}")
            except ImportError as e:
                raise ConfigError(str(e)) from None


def _check_async_policy(cfg: Config, policy: Any) -> None:
    """Async publishing must keep admission possible (docs/async.md)."""
    from tether.weights.policy import BoundedK, EveryK

    eta = cfg.loop.max_staleness
    if isinstance(policy, BoundedK) and policy.k != eta:
        raise ConfigError(
            f"sync.policy={policy.spec} with loop.mode=async: in async mode bounded:K is the "
            f"admission bound, and loop.max_staleness={eta} says another; set "
            f"loop.max_staleness={policy.k} or sync.policy=bounded:{eta}"
        )
    if isinstance(policy, EveryK) and policy.k > eta + 1:
        raise ConfigError(
            f"sync.policy={policy.spec} with loop.mode=async and loop.max_staleness={eta}: "
            f"publishing every {policy.k} versions leaves workers unable to start any batch "
            f"within {eta} versions of their weights; use every:K with K <= {eta + 1} or raise "
            f"loop.max_staleness"
        )


def _resolve_sync(cfg: Config) -> Config:
    """`sync.policy: auto` -> the estimator preset's policy, so the run's config.yaml says which."""
    from tether.weights.policy import resolve_policy_spec

    spec = resolve_policy_spec(cfg.sync.policy, cfg.train.estimator)
    return cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"policy": spec})})


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
