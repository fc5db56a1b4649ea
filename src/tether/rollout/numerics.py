"""Generator numerics: how the generator's copy of the weights differs from the trainer's.

- fp32: an exact copy (no numerical mismatch).
- bf16 / fp16: weights and activations in that dtype, as an inference engine runs them.
- fp8: weight-only e4m3 with one scale per output channel (amax / 448), dequantised
  back to fp32 for compute on this CPU; norms and embeddings stay in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float32}


def quantize_fp8(weight: torch.Tensor) -> torch.Tensor:
    """Round-trip a (out, in) weight through e4m3 with a per-output-channel scale."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (weight / scale).to(torch.float8_e4m3fn)
    return q.to(weight.dtype) * scale


@torch.no_grad()
def apply_numerics(model: nn.Module, state_dict: dict[str, torch.Tensor], precision: str) -> None:
    """Load `state_dict` into `model` and cast it to the generator's `precision`, in place."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    model.to(torch.float32)
    model.load_state_dict(state_dict)
    if precision == "fp8":
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not model.get_output_embeddings():
                module.weight.copy_(quantize_fp8(module.weight))
    model.to(_DTYPES[precision])
