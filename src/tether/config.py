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
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from tether.defaults import (
    EVAL_BATCH_SIZE,
    GROUP_SIZE,
    MAX_NEW_TOKENS,
    MODEL_CACHE_DIR,
    RARE_PROB,
    RL_SHARE,
    TEMPERATURE,
    WARMSTART_STEPS,
)
from tether.errors import InputError


class ConfigError(InputError):
    """A configuration problem a person can act on: names the key, the value and the fix."""


class CrossFieldError(ValueError):
    """Settings that are each valid but conflict; `fields` are the dotted keys involved."""

    def __init__(self, fields: list[str], message: str):
        super().__init__(message)
        self.fields = fields


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Node):
    path: str | None = Field(
        None,
        description="Local Hugging Face causal-LM directory. Empty: tether's own tiny model, "
        "built and warm-started on first use and cached under cache_dir.",
    )
    moe: bool = Field(False, description="Default model only: the Qwen3-MoE variant instead of dense.")
    moe_experts: int = Field(
        4, ge=2, description="Default MoE model only: experts per layer (each token goes to its top 2)."
    )
    moe_aux_loss: float = Field(
        0.0, ge=0.0,
        description="Default MoE model only: weight of the router load-balancing loss (Switch / "
        "Qwen3-MoE `router_aux_loss_coef`) added in the warm start; 0: none. Balanced routers "
        "make the experts specialise, so a token routed elsewhere moves further.",
    )
    seed: int = Field(0, description="Default model only: seed of its initialisation and warm-start.")
    warmstart_steps: int = Field(
        WARMSTART_STEPS, ge=0, description="Default model only: supervised steps on synthetic worked solutions."
    )
    cache_dir: str = Field(
        MODEL_CACHE_DIR, description="Where built default models are cached."
    )


TASK_NAME_HELP = ("Task: countdown, numeric, or your own class as 'package.module:Class' "
                  "(docs/tasks.md).")


class CountdownTaskConfig(_Node):
    name: Literal["countdown"] = Field("countdown", description=TASK_NAME_HELP)
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
    answer: Literal["expr", "steps"] = Field(
        "expr", description="How the answer is written: one expression '(9-3)*7', or its steps "
        "'9-3=6,7*6=42' (each number, given or intermediate, used at most once; responses "
        "several times longer). The default model is warm-started on this format.",
    )
    rl_share: float = Field(
        RL_SHARE, ge=0.0, lt=1.0,
        description="Share of problems kept for RL: training batches draw only from them and "
        "the default model's warm start only from the rest (a hash of numbers and target), so "
        "RL trains on problems the warm start never solved. 0: one stream for both.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> CountdownTaskConfig:
        if self.num_min > self.num_max:
            raise CrossFieldError(["task.num_min", "task.num_max"],
                                  f"num_min ({self.num_min}) must be <= num_max ({self.num_max})")
        if self.target_min > self.target_max:
            raise CrossFieldError(["task.target_min", "task.target_max"],
                                  f"target_min ({self.target_min}) must be <= target_max ({self.target_max})")
        return self


class NumericTaskConfig(_Node):
    name: Literal["numeric"] = Field("numeric", description=TASK_NAME_HELP)
    path: str = Field(description="Local JSONL or parquet file of prompt/answer rows (GSM8K style).")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    answer_key: str = Field("answer", description="Column holding the reference answer.")
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of rows held out for evaluation (if no eval_path)."
    )
    eval_path: str | None = Field(None, description="A separate held-out file in the same format.")
    seed: int = Field(0, description="Seed of the train/eval split and the training order.")


class UserTaskConfig(_Node):
    """A task of your own, by import path; its other keys are its constructor's keyword
    arguments, type-checked against their annotations at load (tether.tasks.user_task_params)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(
        description="Your own task class (or factory): 'package.module:Class' or "
        "'path/to/file.py:Class'; the other task.* keys are its keyword arguments. docs/tasks.md.",
    )

    @field_validator("name")
    @classmethod
    def _spec(cls, name: str) -> str:
        module, sep, attr = name.rpartition(":")
        if not sep or not module or not attr.isidentifier():
            raise ValueError("must be 'package.module:Class' or 'path/to/file.py:Class'")
        return name


BUILTIN_TASKS: dict[str, type[_Node]] = {"countdown": CountdownTaskConfig, "numeric": NumericTaskConfig}


def _task_kind(value: Any) -> str | None:
    """The union tag of a task section: a built-in name, or 'user' for an import path."""
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    if isinstance(name, str) and ":" in name:
        return "user"
    return name if name in BUILTIN_TASKS else None


TaskConfig = Annotated[
    Annotated[CountdownTaskConfig, Tag("countdown")]
    | Annotated[NumericTaskConfig, Tag("numeric")]
    | Annotated[UserTaskConfig, Tag("user")],
    Discriminator(_task_kind, custom_error_type="task_name",
                  custom_error_message="unknown task: use countdown, numeric, or your own "
                  "class as 'package.module:Class' / 'path/to/file.py:Class'"),
]


EXACT_TOPK_MAX_VOCAB = 64  # a small vocabulary is centered over every token (K = V)
DEFAULT_CENTERING_TOPK = 20  # else the top 20: vLLM's default max_logprobs


def resolve_logprobs_topk(cfg: Config, vocab_size: int) -> int:
    """`rollout.logprobs_topk`, or when empty the estimator's need (see its description)."""
    if cfg.rollout.logprobs_topk is not None:
        return cfg.rollout.logprobs_topk
    from tether.estimators import build_estimator

    if not build_estimator(cfg.train.estimator, **cfg.train.estimator_params).centering:
        return 0
    return vocab_size if vocab_size <= EXACT_TOPK_MAX_VOCAB else DEFAULT_CENTERING_TOPK


class RolloutConfig(_Node):
    engine: Literal["hf", "vllm"] = Field("hf", description="Rollout engine: hf (default) or vllm.")
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32", description="Generator numerics; the trainer stays fp32. fp8: weight-only e4m3."
    )
    router_noise: float = Field(
        0.0, ge=0.0, description="MoE, hf engine: std of Gaussian noise the generator adds to its "
        "router logits (routing disagreement at equal weights; docs/mismatch.md). 0: off.",
    )
    logit_noise: float = Field(
        0.0, ge=0.0, description="hf engine: INJECTED mismatch, not a numerics model: scale s of "
        "Student-t noise (logit_noise_dof degrees of freedom) the generator adds to every output "
        "logit before sampling, so mu is a heavy-tailed perturbation of pi_old at equal weights "
        "(a stand-in for a large MoE's eps, CIS Appendix A; docs/experiments.md, E-CIS). 0: off.",
    )
    logit_noise_dof: int = Field(
        3, ge=1, description="Degrees of freedom of rollout.logit_noise's Student-t (1: Cauchy; "
        "large: near Gaussian)."
    )
    logit_noise_outliers: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of logits, the outliers, whose injected noise "
        "is drawn at rollout.logit_noise_outlier_scale instead (a scale mixture: the far tail of "
        "rho = pi_old/mu that makes E[rho^2] large, which a Student-t sized to CIS's MAD lacks). "
        "0: off.",
    )
    logit_noise_outlier_scale: float = Field(
        3.0, gt=0.0, description="Student-t scale of the outlier logits' injected noise."
    )
    prompts_per_step: int = Field(32, ge=1, description="Prompts sampled per step.")
    group_size: int = Field(GROUP_SIZE, ge=1, description="Responses per prompt (the GRPO group, G).")
    temperature: float = Field(TEMPERATURE, ge=0.0, description="Sampling temperature (0: greedy).")
    top_k: int = Field(0, ge=0, description="Top-k truncation (0: off).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus truncation (1: off).")
    max_new_tokens: int = Field(MAX_NEW_TOKENS, ge=1, description="Longest response, in tokens.")
    logprobs_topk: int | None = Field(
        None, ge=0,
        description="Also record the generator's top-K log-probs (centering needs them). Empty: "
        "what the estimator needs: 0, or for a centering preset (dlc) K = the vocabulary size "
        f"when it is at most {EXACT_TOPK_MAX_VOCAB} (exact centering), else {DEFAULT_CENTERING_TOPK}.",
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
    estimator_params: dict[str, bool | float | str] = Field(
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
    routing_replay: Literal["none", "r2", "r3"] = Field(
        "none",
        description="MoE routing replay (docs/mismatch.md). none: every forward's routers choose "
        "their top-k. r3: the generator records each position's experts and the trainer's "
        "logp_old and logp forwards use them (removes routing mismatch from the numerical "
        "side). r2: the experts of the logp_old forward are replayed in the logp forwards "
        "(routing cannot move with staleness). Gate weights always come from the trainer's "
        "router, so it still learns. MoE models only.",
    )
    world_size: int = Field(
        1, ge=1,
        description="Data-parallel trainer ranks (processes on this machine, torch.distributed): "
        "each trains on its shard of every mini-batch, with the whole mini-batch's loss and "
        "gradient under the estimator's aggregation. See docs/distributed.md.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="The trainer's compute: fp32, or bf16 autocast over fp32 master weights "
        "(matrix products in bf16; log-softmax, loss and optimizer in fp32). Every trainer "
        "forward uses it, so pi_old is then the bf16 trainer's and the numerical part of the "
        "mismatch is the generator against it (docs/performance.md).",
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
        "M steps without one), auto (the estimator preset's: dlc, dlc_clip -> ess:0.5, else every:1). "
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
        RARE_PROB, gt=0.0, lt=1.0,
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
    batch_size: int = Field(EVAL_BATCH_SIZE, ge=1, description="Prompts per evaluation forward.")
    samples: int = Field(
        4, ge=0, description="Also held-out accuracy sampled like the rollouts: samples per "
        "problem (0: greedy only).",
    )
    seed: int | None = Field(
        None, description="Seed of the sampled evaluation's draws. Empty: run.seed + 7919, each "
        "run its own draws. Set, runs of different seeds share them (common random numbers): "
        "equal weights score equally, so the spread across seeds is the policies', not the draws'.",
    )


class RunConfig(_Node):
    dir: str | None = Field(None, description="Run directory. Empty: runs/<time>-<estimator>.")
    seed: int = Field(0, description="Seed of sampling and training.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0: torch's default).")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the trainer's weights and the hf engine run: auto (cuda if torch sees "
        "a GPU, else cpu), cpu, cuda or cuda:N. vLLM picks its own device. Apple's mps is not "
        "offered: it has no float64, which the mismatch diagnostics need.",
    )
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
            raise CrossFieldError(
                ["rollout.group_size", "train.adv_std_norm"],
                "rollout.group_size=1 with train.adv_std_norm=true: group-normalised advantages "
                "need at least 2 responses per prompt; raise rollout.group_size"
            )
        if self.rollout.router_noise > 0 and self.rollout.engine != "hf":
            raise CrossFieldError(["rollout.router_noise", "rollout.engine"], "rollout.router_noise perturbs the hf engine's MoE router: "
                             "set rollout.engine=hf")
        if (self.rollout.logit_noise > 0 or self.rollout.logit_noise_outliers > 0) \
                and self.rollout.engine != "hf":
            raise CrossFieldError(["rollout.logit_noise", "rollout.engine"],
                                  "rollout.logit_noise is injected by the hf engine's sampler: "
                                  "set rollout.engine=hf, or rollout.logit_noise=0")
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
        if self.loop.partial and self.loop.mode != "async":
            raise CrossFieldError(["loop.partial", "loop.mode"], "loop.partial=true needs loop.mode=async (weights change mid-batch "
                             "only while generation and training overlap)")
        if self.loop.backend == "ray" and self.loop.mode != "async":
            raise CrossFieldError(["loop.backend", "loop.mode"],
                                  "loop.backend=ray places the asynchronous loop's rollout workers: "
                             "set loop.mode=async (the synchronous loop has no workers)")
        if self.loop.backend == "ray" and self.loop.partial:
            raise CrossFieldError(["loop.partial", "loop.backend"],
                                  "loop.partial=true with loop.backend=ray: a Ray actor loads new "
                             "weights between batches only; use loop.backend=local for partial "
                             "rollouts, or loop.partial=false")
        if self.loop.partial and self.rollout.engine != "hf":
            raise CrossFieldError(
                ["loop.partial", "rollout.engine"],
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


def _drop_dotted(tree: dict[str, Any], dotted: str) -> None:
    """`~key` override: remove a key the config file set (as Hydra's `~key`)."""
    *parents, last = dotted.split(".")
    node: Any = tree
    for k in parents:
        node = node.get(k) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        raise ConfigError(f"override ~{dotted}: the config file does not set {dotted}, so there "
                          "is nothing to drop")
    del node[last]


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


_TASK_TAGS = ("countdown", "numeric", "user")


def _format_errors(err: ValidationError, where: dict[str, str] | None = None,
                   task_name: str | None = None) -> str:
    """One line per error: dotted key, what is wrong, and `(FILE:LINE)` when it came from a file."""
    where = where or {}
    lines: list[str] = []
    foreign: list[tuple[str, str, str]] = []  # (key, the task it belongs to, where)
    for e in err.errors():
        # Drop the union tag pydantic inserts ("task.countdown.x" -> "task.x").
        loc = [str(p) for p in e["loc"] if p not in _TASK_TAGS]
        if e["type"] in ("union_tag_invalid", "task_name"):
            loc.append("name")
        ctx_error = (e.get("ctx") or {}).get("error")
        fields = getattr(ctx_error, "fields", None) or [".".join(loc) or "(top level)"]
        path = " + ".join(fields)
        at = _where(fields, where)
        if e["type"] == "task_name":
            lines.append(f"{path}: unknown task {task_name!r}; valid: 'countdown', 'numeric', or your "
                         f"own class as 'package.module:Class' or 'path/to/file.py:Class'{at}")
        elif e["type"] == "extra_forbidden" and (owner := _other_task(loc, task_name)):
            foreign.append((path, owner, at))
        elif e["type"] == "extra_forbidden":
            lines.append(f"{path}: {_unknown_key(loc, task_name)}{at}")
        elif ctx_error is not None:
            lines.append(f"{path}: {ctx_error}{at}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {e['msg']}{shown}{at}")
    if foreign:  # a task switched on top of a file written for another: one line, one fix
        keys = ", ".join(p for p, _, _ in foreign)
        lines.append(f"{keys}: {'keys' if len(foreign) > 1 else 'a key'} of task {foreign[0][1]}, "
                     f"not of task {task_name}{foreign[0][2]}: remove them from the file, or drop "
                     f"the file's task section with the override ~task (one key: ~{foreign[0][0]})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _where(fields: list[str], where: dict[str, str]) -> str:
    """` (FILE:LINE, command line)`: where each field (or a key under it) was set."""
    found = [w for f in fields for k, w in where.items() if k == f or k.startswith(f + ".")]
    return f" ({', '.join(dict.fromkeys(found))})" if found else ""


def _other_task(loc: list[str], task_name: str | None) -> str | None:
    """The built-in task a `task.KEY` belongs to when the named task has no such key."""
    if len(loc) != 2 or loc[0] != "task" or task_name not in BUILTIN_TASKS:
        return None
    return next((n for n, node in BUILTIN_TASKS.items()
                 if n != task_name and loc[1] in node.model_fields), None)


def _unknown_key(loc: list[str], task_name: str | None) -> str:
    """'unknown key', with the nearest valid name when one is close."""
    close = difflib.get_close_matches(loc[-1], _keys_at(loc[:-1], task_name), n=1)
    return "unknown key" + (f"; did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else "")


def _keys_at(loc: list[str], task_name: str | None = None) -> list[str]:
    """Valid keys of the config section at `loc` (for `task`, the named task's, else all built-ins)."""
    nodes: list[type[BaseModel]] = [Config]
    for key in loc:
        nxt = []
        for node in nodes:
            field = node.model_fields.get(key)
            if field is None:
                continue
            if key == "task" and node is Config:
                nxt += [BUILTIN_TASKS[task_name]] if task_name in BUILTIN_TASKS else list(BUILTIN_TASKS.values())
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
    overrides = overrides or []
    for item in (o for o in overrides if o.startswith("~")):
        _drop_dotted(tree, item[1:].strip())
        where = {k: w for k, w in where.items() if k != item[1:] and not k.startswith(item[1:] + ".")}
    extra = parse_overrides([o for o in overrides if not o.startswith("~")])
    for key in _leaf_paths(extra):  # an override wins over the file: point at it instead
        where[key] = "command line"
    tree = _merge(tree, extra)
    if isinstance(tree.get("task"), dict) and "name" not in tree["task"]:
        tree["task"] = {"name": "countdown", **tree["task"]}  # the default task
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        task_name = tree.get("task", {}).get("name") if isinstance(tree.get("task"), dict) else None
        raise ConfigError(_format_errors(e, where, task_name)) from None
    _check_registries(cfg)
    if isinstance(cfg.task, UserTaskConfig):  # its keys are its constructor's: check them now
        from tether.tasks import user_task_params

        params = user_task_params(cfg.task.name, cfg.task.model_dump(exclude={"name"}))
        cfg = cfg.model_copy(update={"task": UserTaskConfig(name=cfg.task.name, **params)})
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
            f"rollout.logprobs_topk=0 with train.estimator={cfg.train.estimator}: it centers "
            "scores over the generator's top-K head; set rollout.logprobs_topk > 0 (e.g. 20), or "
            "leave it empty for the estimator's default"
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


SECTIONS = {
    "model": "which model to train",
    "task": "where prompts come from and how answers are rewarded",
    "reward": "your own reward function (optional)",
    "rollout": "the generator: engine, numerics, sampling",
    "train": "the trainer: steps, optimizer, loss estimator",
    "sync": "when the generator receives new weights",
    "loop": "synchronous or asynchronous generation and training",
    "diagnostics": "mismatch diagnostics and the current-model monitor",
    "log": "where metrics go besides RUN_DIR/metrics.jsonl",
    "eval": "held-out accuracy",
    "run": "run directory, seed, threads, checkpoints",
}


def describe_fields(node: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One entry per leaf key, `"path = default\n    description"`; task keys per task kind,
    `task.name` once."""
    lines = []
    for name, field in node.model_fields.items():
        ann = field.annotation
        path = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines += describe_fields(ann, path + ".")
        elif name == "task" and node is Config:
            for i, kind in enumerate(BUILTIN_TASKS.values()):
                lines += [line for line in describe_fields(kind, "task.")
                          if i == 0 or not line.startswith("task.name ")]
        else:
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            lines.append(f"{path} = {default}\n    {field.description or ''}")
    return lines


def format_fields() -> str:
    """`tether config --fields`: every key under a header per section (per task kind for task)."""
    out = []
    for section, title in SECTIONS.items():
        out.append(f"[{section}] {title}")
        if section == "task":
            out += [f"  {line}" for line in describe_fields(CountdownTaskConfig, "task.")
                    if line.startswith("task.name ")]
            for kind, node in BUILTIN_TASKS.items():
                out.append(f"  with task.name={kind}:")
                out += [f"    {line}".replace("\n", "\n  ") for line in describe_fields(node, "task.")
                        if not line.startswith("task.name ")]
            out.append("  with task.name=package.module:Class: its constructor's keyword arguments")
        else:
            node = Config.model_fields[section].annotation
            out += [f"  {line}" for line in describe_fields(node, f"{section}.")]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
