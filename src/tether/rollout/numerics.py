"""Generator numerics: how the generator's copy of the weights differs from the trainer's.

The trainer stays fp32; the generator runs one of (DESIGN.md section 5):
- fp32: an exact copy (no numerical mismatch; only kernel order differs, ~1e-6).
- bf16 / fp16: weights and activations in that dtype, as an inference engine runs them.
  On the MoE model the router runs in that dtype too, so some tokens go to other experts
  than in the trainer (CIS's setting).
- fp8: weight-only e4m3 with one scale per output channel (amax / 448), dequantised
  back to fp32 for compute on this CPU. Quantised: every Linear except the output
  embedding, and the MoE experts' stacked weights (E, out, in), each expert's output
  channel on its own scale. Kept in fp32, as FP8 checkpoints keep them: embeddings,
  norms and the MoE router (`mlp.gate`), whose routing still moves because its input
  does.

Router noise (`rollout.router_noise=s`, MoE only): the generator adds N(0, s^2) to every
router logit before its top-k, so some tokens go to other experts than in the trainer at
equal weights. A stand-in for a large MoE's engine-to-engine routing disagreement (R3,
arXiv 2510.11370: about 10% of router decisions differ between vLLM and Megatron),
which the tiny model's bf16 router (under 1%) is far from. The noise is applied by
`tether.models.routing.add_router_noise`, the router patch routing replay also uses.
"""

from __future__ import annotations

import torch
from torch import nn

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float32}
# MoE expert weights stored as stacked 3-D parameters (transformers' Qwen3MoeExperts).
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def quantize_fp8(weight: torch.Tensor) -> torch.Tensor:
    """Round-trip a (..., out, in) weight through e4m3, one scale per output channel.

    scale = amax over `in` / 448, so every channel uses the full e4m3 range; the result is
    dequantised (q * scale) in the weight's own dtype.
    """
    scale = weight.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    q = (weight / scale).to(torch.float8_e4m3fn)
    return q.to(weight.dtype) * scale


def fp8_targets(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights fp8 quantises: (name, parameter) pairs (see the module docstring)."""
    out_emb = model.get_output_embeddings()
    targets = []
    for mod_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not out_emb:
            targets.append((f"{mod_name}.weight", module.weight))
        for pname in _EXPERT_PARAMS:
            p = getattr(module, pname, None)
            if isinstance(p, nn.Parameter) and p.dim() == 3:
                targets.append((f"{mod_name}.{pname}", p))
    return targets


@torch.no_grad()
def apply_numerics(model: nn.Module, state_dict: dict[str, torch.Tensor], precision: str) -> None:
    """Load `state_dict` into `model` and cast it to the generator's `precision`, in place."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    model.to(torch.float32)
    model.load_state_dict(state_dict)
    if precision == "fp8":
        for _, weight in fp8_targets(model):
            weight.copy_(quantize_fp8(weight))
    model.to(_DTYPES[precision])
