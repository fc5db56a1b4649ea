"""What every process of a run builds from its config, written once.

The driver (tether.run), the rollout workers (tether.rollout.worker), the data-parallel
trainer ranks (tether.distributed) and `tether probe` each build the parts they need:

    seed_process           torch's seed and numerics (the driver and the probe)
    configure_numerics     thread count and `run.deterministic` (every process that runs torch)
    build_task_and_reward  the task and the reward function
    load_policy            the model on `run.device` and its tokenizer
    sampling_params        how the generator samples from it
    build_generator        the rollout engine `rollout.engine` names, holding the model's weights
    scores_old_in_worker   whether rollout workers score pi_old (`loop.score_old` resolved)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.config import Config, RolloutConfig, centering_topk, resolve_logprobs_topk
from tether.errors import InputError
from tether.models import load_model
from tether.models.routing import is_moe, routers
from tether.rewards import build_reward_fn
from tether.rollout.hf import HFGenerator
from tether.rollout.types import Generator, SamplingParams
from tether.tasks import task_from_config
from tether.tasks.base import Task
from tether.testbed import ensure_default_model


def seed_process(cfg: Config) -> None:
    """Seed torch with `run.seed`, then `configure_numerics`."""
    torch.manual_seed(cfg.run.seed)
    configure_numerics(cfg)


def configure_numerics(cfg: Config) -> None:
    """`run.threads` torch threads (0: torch's default), and with `run.deterministic` only
    deterministic kernels: on a GPU, index_add, scatter and the attention backward otherwise
    sum in a varying order, so a resumed run matches the uninterrupted one only up to
    float rounding (docs/reliability.md). An op with no deterministic kernel then raises."""
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if cfg.run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def sampling_seed(cfg: Config, index: int) -> int:
    """The generator's seed for the `index`-th rollout batch of a run (a step, an async slot,
    or a batch of `tether probe`)."""
    return cfg.run.seed * 1_000_003 + index


def build_task_and_reward(cfg: Config) -> tuple[Task, Any]:
    """The task and the reward function ((problem, response text) -> Reward)."""
    task = task_from_config(cfg.task)
    return task, build_reward_fn(cfg.reward.fn, cfg.reward.timeout, task)


def load_policy(cfg: Config, model_path: str | Path | None = None,
                device: torch.device | None = None,
                ) -> tuple[Path, PreTrainedModel, PreTrainedTokenizerBase]:
    """The model directory (`model_path`, else `resolve_model_path`), its fp32 model on
    `device` (default: `run.device`), and its tokenizer. How to sample from it:
    `sampling_params`."""
    path = Path(model_path) if model_path is not None else resolve_model_path(cfg)
    device = device if device is not None else resolve_device(cfg.run.device)
    model, tokenizer = load_model(path)
    return path, model.to(device), tokenizer


def resolve_model_path(cfg: Config) -> Path:
    """`model.path`, or tether's own tiny model (built and cached on first use)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    return ensure_default_model(cfg.model.cache_dir, cfg.model.moe, cfg.model.seed,
                                cfg.model.warmstart_steps, cfg.task.model_dump(),
                                moe_experts=cfg.model.moe_experts,
                                moe_aux_loss=cfg.model.moe_aux_loss, threads=cfg.run.threads)


def resolve_device(name: str) -> torch.device:
    """`run.device`: auto is the first GPU torch sees, else the CPU; a GPU it cannot see fails."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not (torch.cuda.is_available()
                                      and (device.index or 0) < torch.cuda.device_count()):
        raise InputError(f"run.device={name}: torch sees {torch.cuda.device_count()} CUDA "
                         "device(s) here; set run.device=auto or cpu")
    return device


def sampling_params(cfg: Config, vocab_size: int) -> SamplingParams:
    """How the generator samples; `rollout.logprobs_topk` resolved for `vocab_size` tokens."""
    r = cfg.rollout
    return SamplingParams(n=r.group_size, temperature=r.temperature, top_k=r.top_k,
                          top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                          logprobs_topk=resolve_logprobs_topk(cfg, vocab_size))


def check_routing_replay(replay: str, model: PreTrainedModel) -> None:
    """train.routing_replay needs a MoE model whose routers tether can patch."""
    if replay == "none":
        return
    if not is_moe(model):
        raise InputError(f"train.routing_replay={replay}: {type(model).__name__} is not a "
                         "mixture-of-experts model (no routers to replay); set "
                         "train.routing_replay=none, or model.moe=true for tether's own model")
    try:
        routers(model)
    except ValueError as e:
        raise InputError(f"train.routing_replay={replay}: {e}") from None


def build_generator(cfg: Config, model: PreTrainedModel, model_path: Path,
                    tokenizer: PreTrainedTokenizerBase) -> Generator:
    """The rollout engine `rollout.engine` names, holding `model`'s weights as version 0."""
    r = cfg.rollout
    record = cfg.train.routing_replay == "r3"  # R3 replays the generator's routing
    if r.engine == "vllm":
        from tether.rollout.vllm_engine import VLLMGenerator  # an optional dependency

        topk = resolve_logprobs_topk(cfg, model.config.vocab_size)
        if cfg.train.correction == "auto":  # it may turn centering on mid-run
            topk = max(topk, centering_topk(cfg, model.config.vocab_size))
        generator = VLLMGenerator(model_path, r.precision, eos_token_id=tokenizer.eos_token_id,
                                  max_logprobs=max(20, topk), record_routes=record,
                                  **vllm_memory(r, on_cpu=not torch.cuda.is_available()))
        generator.load_weights(model.state_dict(), version=0)
        return generator
    return HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, r.precision,
                       r.router_noise, record_routes=record, logit_noise=logit_noise(r))


def vllm_memory(r: RolloutConfig, on_cpu: bool) -> dict[str, Any]:
    """The vLLM engine's memory settings from `rollout.vllm_*`. Its KV cache: `vllm_kv_cache_gib`
    when set; else on a GPU what `vllm_gpu_memory_utilization` leaves after the weights
    (vLLM's own sizing), and on the CPU 0.25 GiB (vLLM's CPU sizing would count the
    trainer's memory in this process against the engine's share)."""
    kv = r.vllm_kv_cache_gib if r.vllm_kv_cache_gib is not None else (0.25 if on_cpu else None)
    return {"max_model_len": r.vllm_max_model_len or None,
            "kv_cache_bytes": None if kv is None else int(kv * 2**30),
            "gpu_memory_utilization": r.vllm_gpu_memory_utilization,
            "enforce_eager": r.vllm_enforce_eager}


def actor_config(cfg: Config) -> Config:
    """The config a Ray rollout actor builds its engine from: `run.device` is the driver's,
    which the actor cannot see; an actor holds `loop.worker_gpus` GPUs, and Ray shows it
    those as its cuda:0 (none: Ray hides every GPU, so the CPU)."""
    device = "cuda" if cfg.loop.worker_gpus > 0 else "cpu"
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"device": device})})


def scores_old_in_worker(cfg: Config) -> bool:
    """`loop.score_old` resolved: rollout workers score pi_old of their batches (auto: with the
    hf engine, unless R2 needs the trainer's own pi_old forward)."""
    if cfg.loop.score_old == "auto":
        return cfg.rollout.engine == "hf" and cfg.train.routing_replay != "r2"
    return cfg.loop.score_old == "worker"


def logit_noise(r: RolloutConfig) -> tuple[float, int, float, float] | None:
    """HFGenerator's `logit_noise` from a RolloutConfig: (scale, dof, outlier share, outlier
    scale), or None when off."""
    if r.logit_noise == 0 and r.logit_noise_outliers == 0:
        return None
    return r.logit_noise, r.logit_noise_dof, r.logit_noise_outliers, r.logit_noise_outlier_scale
