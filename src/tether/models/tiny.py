"""tether's own tiny models: a dense Qwen3 and a Qwen3-MoE, built from transformers' classes.

The sizes follow DESIGN.md section 7: hidden 192, 4 layers, about 2.4 M parameters for
the dense model. head_dim is 64 so the model also loads in vLLM's CPU attention kernels.
"""

from __future__ import annotations

import torch
from transformers import (
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

MAX_POSITIONS = 128
"""The default model's context, unless its task needs more (`positions_for`)."""


def positions_for(context: int) -> int:
    """The context a default model gets for a task whose prompt + answer + eos take up to
    `context` tokens: MAX_POSITIONS, or the next power of two that holds it."""
    return max(MAX_POSITIONS, 1 << (max(context, 1) - 1).bit_length())


MOE_EXPERTS = 4  # the default MoE model's experts per layer (each token to its top 2)


def tiny_config(vocab_size: int = 21, moe: bool = False, experts: int = MOE_EXPERTS,
                positions: int = MAX_POSITIONS) -> PretrainedConfig:
    """The architecture of the default model (dense Qwen3, or Qwen3-MoE with `experts`
    experts, top 2), with a context of `positions` tokens (RoPE: no parameter depends on it)."""
    common = {
        "vocab_size": vocab_size,
        "hidden_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": positions,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 1,
    }
    if moe:
        return Qwen3MoeConfig(
            intermediate_size=768,
            moe_intermediate_size=256,
            num_experts=experts,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
    return Qwen3Config(intermediate_size=768, **common)


def build_tiny_model(vocab_size: int = 21, moe: bool = False, seed: int = 0,
                     experts: int = MOE_EXPERTS, positions: int = MAX_POSITIONS) -> PreTrainedModel:
    """A freshly initialised tiny model, deterministic for `seed`, in fp32."""
    torch.manual_seed(seed)
    config = tiny_config(vocab_size, moe, experts, positions)
    config._attn_implementation = "sdpa"
    model_cls = Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM
    return model_cls(config).float()
