"""Models: architectures, tokenizers and routing, with nothing of tasks or training.

tether's own tiny Qwen3 (dense or MoE, tether.models.tiny) with a character tokenizer, or
any local Hugging Face directory (`load_model`). How the default model is built and
warm-started on a task is the testbed's (tether.testbed).
"""

from __future__ import annotations

from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tether.errors import InputError
from tether.models.tiny import build_tiny_model
from tether.models.tokenizer import build_char_tokenizer

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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


__all__ = ["build_char_tokenizer", "build_tiny_model", "load_model", "quiet_transformers"]
