"""The config's sections but `task` (tether.config.task): one frozen model each, every key
with its meaning; a rule that involves one section only is that section's validator.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from tether.config.base import CrossFieldError, Node
from tether.defaults import (
    EVAL_BATCH_SIZE,
    GROUP_SIZE,
    MAX_NEW_TOKENS,
    MODEL_CACHE_DIR,
    RARE_PROB,
    TEMPERATURE,
    WARMSTART_STEPS,
)
from tether.plugins import split_spec
from tether.weights.policy import describe_forms

EXACT_TOPK_MAX_VOCAB = 64  # a small vocabulary is centered over every token (K = V)
DEFAULT_CENTERING_TOPK = 20  # else the top 20: vLLM's default max_logprobs

# Field metadata of a key (or a whole section) that does not change a run's trajectory, so
# a resumed run may override it (tether.config.resumable_keys). `run.threads` can change float
# reduction order on some backends: keep it for a bit-identical continuation. An asynchronous
# run has no bit-identical trajectory (the race decides which weights sample each batch), so
# its number of rollout workers, and where they run, may change too.
RESUMABLE = {"resumable": True}


class ModelConfig(Node):
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



class RolloutConfig(Node):
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
        0.0, ge=0.0, le=1.0, description="Share of positions, the outliers, where every logit's "
        "injected noise is Gaussian at rollout.logit_noise_outlier_scale s instead: E_mu[rho^2] "
        "about exp(s^2) on those prefixes, the typical token's eps (its q95) left in place. 0: off.",
    )
    logit_noise_outlier_scale: float = Field(
        3.0, gt=0.0, description="Standard deviation of the injected noise at outlier positions."
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

    vllm_max_model_len: int = Field(
        0, ge=0, description="vllm engine: longest prompt + response it accepts (0: the model's "
        "context, config.json's max_position_embeddings). Lower it for a long-context model: "
        "vLLM refuses to start when its KV cache cannot hold one sequence this long.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="vllm engine: share of the GPU's memory it may take, "
        "weights and KV cache (on CPU: of RAM). The trainer shares the GPU in-process: leave it "
        "room (its fp32 weights, Adam moments, activations).",
    )
    vllm_kv_cache_gib: float | None = Field(
        None, gt=0.0, description="vllm engine: KV cache size in GiB. Empty: on a GPU, what "
        "vllm_gpu_memory_utilization leaves after the weights; on CPU 0.25.",
    )
    vllm_enforce_eager: bool = Field(
        True, description="vllm engine: no CUDA graphs or torch.compile (fast start). false: "
        "faster decoding on a GPU after a slower start.",
    )

    @model_validator(mode="after")
    def _hf_only(self) -> RolloutConfig:
        if self.router_noise > 0 and self.engine != "hf":
            raise CrossFieldError(["rollout.router_noise", "rollout.engine"],
                                  "rollout.router_noise perturbs the hf engine's MoE router: "
                                  "set rollout.engine=hf")
        if (self.logit_noise > 0 or self.logit_noise_outliers > 0) and self.engine != "hf":
            raise CrossFieldError(["rollout.logit_noise", "rollout.engine"],
                                  "rollout.logit_noise is injected by the hf engine's sampler: "
                                  "set rollout.engine=hf, or rollout.logit_noise=0")
        return self


class TrainConfig(Node):
    steps: int = Field(40, ge=0, json_schema_extra=RESUMABLE,
        description="Rollout batches to train on.")
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
    correction: Literal["fixed", "auto"] = Field("fixed", description=(
        "fixed: train.estimator and sync.policy as set, the whole run. auto: each step's "
        "measured split chooses per cause (docs/estimators.md, 'The correction chosen "
        "online'): none, cis or icepop for a material numerical mismatch; the ESS re-sync "
        "(and, async, the ESS window) with DLC's centering for material staleness. "
        "train.estimator then names the objective only (grpo, gspo, vespo, ...)."))
    auto_on_after: int = Field(3, ge=1, description=(
        "train.correction=auto: steps a cause must call for a correction before it is "
        "switched on (k): in a row, or of the last train.auto_window."))
    auto_window: int | None = Field(None, ge=1, description=(
        "train.correction=auto: count auto_on_after over the last w steps (w >= k), for "
        "evidence that fires on some steps only. Empty: k steps in a row."))
    auto_pool: int | None = Field(None, ge=1, description=(
        "train.correction=auto: judge each step on the last w steps' metrics pooled as "
        "`tether inspect` pools a run (mean sequence chi2, lowest token ESS), for a cause "
        "whose per-step figure flickers near its threshold. Empty: each step on its own."))
    auto_off_after: int = Field(6, ge=1, description=(
        "train.correction=auto: steps in a row a cause must call for none before its "
        "correction is switched off (m)."))
    adv_std_norm: bool = Field(
        True, description="Divide group-centred rewards by the group's std (GRPO); false: Dr. GRPO."
    )
    max_bad_steps: int = Field(
        5, ge=1, json_schema_extra=RESUMABLE,
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
        1, ge=1, json_schema_extra=RESUMABLE,
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
    sharding: Literal["none", "fsdp"] = Field("none", description=(
        "none: each rank holds the whole model and AdamW state. fsdp: FSDP2 shards them and "
        "the kept versions over the world_size ranks, with sharded checkpoints a resume may "
        "reshard. See docs/distributed.md."))
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", json_schema_extra=RESUMABLE,
        description="world_size > 1: torch.distributed backend. auto: nccl when the trainer's "
        "weights are on a GPU, else gloo.",
    )


class SyncConfig(Node):
    policy: str = Field(
        "auto",
        description=f"When the generator gets new weights: {describe_forms()}. See docs/mismatch.md.",
    )
    lag: int = Field(
        0, ge=0,
        description="Staleness source: a delivery hands the generator the weights of `lag` "
        "versions ago (DLC's stale generator; 0: the current ones). ESS re-syncs bypass it.",
    )
    lag_from: int = Field(
        0, ge=0,
        description="The 0-based step from whose delivery on sync.lag applies (before it the "
        "generator gets the current weights): a staleness cause that starts mid-run, as when "
        "a generator's updates stop arriving (tether experiment auto, scenario 4).",
    )
    on_trip: Literal["train", "regenerate"] = Field(
        "train",
        description="ess policy: what happens to the batch whose ESS tripped the re-sync: "
        "train (train on it, the estimator caps its weights; re-sync after the step) or "
        "regenerate (re-sync now, drop it, sample the same prompts again).",
    )


class WeightsConfig(Node):
    snapshot_dtype: Literal["auto", "master", "train"] = Field(
        "auto",
        description="What a kept weight version (for exact pi_old) stores: master (every tensor "
        "as trained, fp32), train (the tensors train.precision=bf16's autocast only reads in "
        "bf16 stored in bf16: pi_old bit for bit the same, about half the bytes; needs "
        "train.precision=bf16 and rollout.precision=bf16, as the generator may load a kept "
        "version), auto (train where those hold, else master). docs/scale.md.",
    )
    snapshot_compress: Literal["none", "xor"] = Field(
        "none",
        description="Kept versions: none (each whole) or xor (the newest whole, each older one "
        "an exact XOR delta against the next, zstd-compressed, in host memory; rebuilt bit for "
        "bit when scored, at a decode per version in between).",
    )
    snapshot_offload: bool = Field(False, description="Keep snapshots in host memory when the "
                                   "trainer is on a GPU (xor deltas always are).")
    publish: Literal["full", "delta"] = Field(
        "full",
        description="How a version reaches the rollout workers (loop.mode=async): full (the "
        "whole state dict, in shared memory or Ray's object store) or delta (an exact XOR "
        "delta against the version before, zstd-compressed: fewer bytes to move, more CPU, "
        "one more copy of the weights on each side).",
    )
    bucket_mb: int = Field(
        64, ge=1,
        description="Deltas (snapshot_compress=xor, publish=delta) are encoded, sent and applied "
        "in buckets of at most this many MiB, which bounds their working memory.",
    )
    zstd_level: int = Field(1, ge=1, le=22, description="zstd level of the deltas (1: fastest).")
    delta_threads: int = Field(
        1, ge=1,
        description="Threads that encode and apply a delta's buckets in parallel (trainer side; "
        "a rollout worker uses loop.worker_threads).",
    )


class DiagnosticsConfig(Node):
    monitor_every: int = Field(
        10, ge=0,
        description="Current-model monitor every M steps (0: off): sample from the trainer's "
        "weights, score with the generator; KL and its share on rare tokens (monitor/*).",
    )
    monitor_prompts: int = Field(8, ge=1, description="Monitor: held-out prompts in the probe set.")
    monitor_samples: int = Field(4, ge=1, description="Monitor: samples per probe prompt.")
    rare_prob: float = Field(RARE_PROB, gt=0.0, lt=1.0, description="Monitor: a token is rare "
                             "when the generator gives it probability below this.")
    routing: bool = Field(True, description="MoE models: measure routing disagreement every "
                          "step (two no-grad forwards).")
    seq_weights: bool = Field(False, description="Log the spread of the sequence weights each "
                              "step: quantiles of log W and of VESPO's phi(W) (docs/metrics.md).")


class LogConfig(Node):
    tensorboard: bool = Field(False, description="Also write metrics to TensorBoard (RUN_DIR/tb).")
    wandb: bool = Field(False, description="Also write metrics to Weights & Biases (RUN_DIR/wandb).")
    wandb_project: str = Field("tether", description="Weights & Biases project name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: no network, `wandb sync RUN_DIR/wandb/offline-run-*` later.",
    )
    dump_logprobs: bool = Field(
        False, description="Also write every trained token's mu, pi_old and pi_theta to "
        "RUN_DIR/logprobs.jsonl (tether.dump's format; `tether inspect` reads it). About 150 "
        "bytes per token.",
    )


class RewardConfig(Node):
    fn: str | None = Field(
        None,
        description="Your own reward instead of the task's: 'package.module:function' or "
        "'path/to/file.py:function', called as fn(problem, response) -> float or Reward. "
        "Held-out accuracy stays the task's. See docs/reliability.md.",
    )
    timeout: float = Field(
        5.0, gt=0.0, json_schema_extra=RESUMABLE,
        description="Seconds one call of reward.fn may take; a slower or failing call scores 0 "
        "and is counted in reward/errors (the run goes on).",
    )

    @field_validator("fn")
    @classmethod
    def _spec(cls, fn: str | None) -> str | None:
        if fn is not None:
            split_spec(fn, kind="function")
        return fn


class EvalConfig(Node):
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


class RunConfig(Node):
    dir: str | None = Field(None, description="Run directory. Empty: runs/<time>-<estimator>.")
    seed: int = Field(0, description="Seed of sampling and training.")
    threads: int = Field(0, ge=0, json_schema_extra=RESUMABLE,
        description="torch CPU threads (0: torch's default).")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="Where the trainer's weights and the hf engine run: auto (cuda if torch sees "
        "a GPU, else cpu), cpu, cuda or cuda:N. vLLM picks its own device. Apple's mps is not "
        "offered: it has no float64, which the mismatch diagnostics need.",
    )
    deterministic: bool = Field(
        False, description="Deterministic kernels only (torch.use_deterministic_algorithms): a "
        "resumed run on a GPU then matches the uninterrupted one bit for bit, at some speed; "
        "off, it matches up to float rounding (on CPU with one thread it always matches; with "
        "more, some kernels add in a varying order too). See "
        "docs/reliability.md.",
    )
    progress: bool = Field(True, json_schema_extra=RESUMABLE,
        description="Show a progress bar.")
    checkpoint_every: int = Field(
        10, ge=0, json_schema_extra=RESUMABLE,
        description="Checkpoint (RUN_DIR/checkpoints) every K steps, and always after the last "
        "step and before any stop (0: only then). `tether train --resume RUN_DIR` continues.",
    )
    keep_checkpoints: int = Field(2, ge=1, json_schema_extra=RESUMABLE,
        description="How many of the newest checkpoints to keep.")
    start_timeout: float = Field(
        120.0, gt=0.0, json_schema_extra=RESUMABLE,
        description="Seconds until exit status 5, naming the phase, for: the Ray cluster at "
        "loop.ray_address to connect, the Ray actors' resources to be reserved (placement), a "
        "trainer rank to join. A Ray actor's process start and engine build and a rank's model "
        "load are not counted (a line every 30 s says which is still starting).",
    )
