"""Models: tether's own tiny Qwen3 (dense or MoE) with a character tokenizer, or any local HF dir."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tether.defaults import MODEL_CACHE_DIR, WARMSTART_STEPS
from tether.errors import InputError
from tether.models.tiny import MAX_POSITIONS, MOE_EXPERTS, build_tiny_model, positions_for
from tether.models.tokenizer import build_char_tokenizer
from tether.models.warmstart import warm_start

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# Bump when the recipe of the default model changes, so stale caches are not reused.
RECIPE_VERSION = 1


def default_model_dir(cache_dir: str, moe: bool, seed: int, warmstart_steps: int, task_key: dict,
                      arch_key: dict | None = None) -> Path:
    """`arch_key`: the MoE knobs that differ from the default architecture (none: keyed as
    before they existed, so cached models stay valid)."""
    key = {"v": RECIPE_VERSION, "moe": moe, "seed": seed, "steps": warmstart_steps, "task": task_key}
    if arch_key:
        key["arch"] = arch_key
    key = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    kind = "moe" if moe else "dense"
    return Path(os.path.expanduser(cache_dir)) / f"tiny-{kind}-{digest}"


def ensure_default_model(
    cache_dir: str = MODEL_CACHE_DIR, moe: bool = False, seed: int = 0,
    warmstart_steps: int = WARMSTART_STEPS,
    task_kwargs: dict | None = None, verbose: bool = True,
    moe_experts: int = MOE_EXPERTS, moe_aux_loss: float = 0.0,
) -> Path:
    """Build and warm-start tether's tiny model unless cached; return its HF directory.

    `task_kwargs` is the task section: the model is warm-started on the chain task when its
    `name` is "chain", else on Countdown; the task's WARMSTART_KNOBS among them shape the
    data (others are ignored). The cache key holds their resolved values, so defaults
    passed explicitly or left out find the same model; so do
    `moe_experts` (experts per layer) and `moe_aux_loss` (the router load-balancing loss's
    weight in the warm start), MoE only, keyed only when not the default. The
    directory loads with AutoModelForCausalLM / AutoTokenizer. It is written to a
    temporary directory and renamed into place, so a killed build leaves no half model;
    concurrent callers build it once (`build_lock`), the others wait and load it.
    """
    from tether.tasks.chain import ChainTask
    from tether.tasks.countdown import ALPHABET, CountdownTask

    task_kwargs = task_kwargs or {}
    chain = task_kwargs.get("name") == ChainTask.name
    task_cls = ChainTask if chain else CountdownTask  # the chain task shares Countdown's ALPHABET
    knobs = {k: v for k, v in task_kwargs.items() if k in task_cls.WARMSTART_KNOBS}
    task = task_cls(**knobs, seed=seed)
    key = {k: getattr(task, k) for k in task_cls.WARMSTART_KNOBS}
    if chain:
        key["name"] = ChainTask.name
    for knob, before in (("answer", "expr"), ("rl_share", 0.0)):
        if key.get(knob) == before:  # keyed as before the option existed: cached models stay valid
            del key[knob]
    positions = positions_for(getattr(task, "context", 0))
    arch = {"positions": positions} if positions != MAX_POSITIONS else {}
    if moe and moe_experts != MOE_EXPERTS:
        arch["experts"] = moe_experts
    if moe and moe_aux_loss:
        arch["aux_loss"] = moe_aux_loss
    out = default_model_dir(cache_dir, moe, seed, warmstart_steps, key, arch)
    if (out / "config.json").is_file():
        return out
    with build_lock(out, verbose):  # a second process waits here for the first one's build
        if (out / "config.json").is_file():
            return out
        tokenizer = build_char_tokenizer(ALPHABET)
        model = build_tiny_model(len(tokenizer), moe=moe, seed=seed, experts=moe_experts,
                                 positions=positions)
        if verbose:
            print(f"building tether's tiny {'MoE' if moe else 'dense'} model: "
                  f"{warmstart_steps} warm-start steps -> {out}")
        # The one-time build is a batch-128 SFT that scales with cores; run.threads (often 1,
        # which suits the RL loop's small batches) would double its time on two cores.
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))
        try:
            warm_start(model, tokenizer, task, warmstart_steps, seed=seed,
                       log_every=max(1, warmstart_steps // 5) if verbose else 0,
                       router_aux_loss=moe_aux_loss if moe else 0.0)
        finally:
            torch.set_num_threads(threads)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".building-"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)  # a killed build leaves no half model
    return out


@contextmanager
def build_lock(out: Path, verbose: bool) -> Iterator[None]:
    """Hold an exclusive lock on OUT's build (an flock on `.OUT.lock` beside it: released by
    the kernel when its holder dies, so a killed build never blocks the next)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if verbose:
                print(f"waiting for another process building {out}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def quiet_transformers() -> None:
    """No per-model progress bars or advisories from transformers in this process: worker
    processes, ranks and experiment cells load models whose bars would flood the output."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_model(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local HF causal LM and its tokenizer in fp32; clear errors for a wrong directory."""
    p = Path(path).expanduser()
    where = f"model.path={p}"
    if not (p / "config.json").is_file():
        raise InputError(f"{where}: not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as e:  # not JSON, or a model type this transformers lacks
        first = str(e).strip().split("\n")[0]
        raise InputError(f"{where}: its config.json cannot be read: {first}") from None
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise InputError(f"{where}: no tokenizer files there (one of {', '.join(_TOKENIZER_FILES)})")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            p, local_files_only=True, dtype="float32", attn_implementation="sdpa"
        )
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise InputError(
            f"{where}: {type(config).__name__} (model_type {config.model_type!r}) is not a "
            f"causal language model: AutoModelForCausalLM cannot load it"
        ) from None
    except OSError as e:  # no weights file, or an unreadable one
        raise InputError(f"{where}: the weights cannot be loaded: {str(e).strip().splitlines()[0]}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as e:  # damaged or foreign tokenizer files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{where}: the tokenizer cannot be loaded: {first}") from None
    if tokenizer.eos_token_id is None:
        raise InputError(f"{where}: the tokenizer has no eos token, so no response could end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise InputError(
            f"model.path={p}: tokenizer has {len(tokenizer)} tokens but the model's embedding "
            f"has {model.get_input_embeddings().num_embeddings}: they do not belong together"
        )
    return model, tokenizer


__all__ = ["build_char_tokenizer", "build_tiny_model", "ensure_default_model", "load_model", "warm_start"]
