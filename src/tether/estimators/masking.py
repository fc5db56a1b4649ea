"""Masked importance sampling for numerical mismatch: `mis`, `icepop`, `seq_mis`, `geo_mis`.

    rho_t = pi_old(y_t) / mu(y_t)
    mis / icepop: w_t = rho_t if lo <= rho_t <= hi else 0,            (lo, hi) = (0.5, 2)
    seq_mis:      w_i = prod_t rho_t if lo <= prod_t rho_t <= hi else 0, (0.5, 2)
    geo_mis:      w_i = 1 if lo <= exp(mean_t log rho_t) <= hi else 0,  (0.99, 1.01)

Sources: MIS (Liu, Li et al., "When Speed Kills Stability: Demystifying RL Collapse
from the Training-Inference Mismatch", 2025); IcePop (Ling team, Ring-1T report, 2025:
the same token test, kept as its own name); the geometric test with SkyRL's bounds
(0.99, 1.01), tight because a geometric mean moves far less than a product. geo_mis is
a pure rejection mask (weight 1 when kept), as in SkyRL and prime-rl.
All weights detached. Corrects: numerical. Masking removes the tokens (or responses)
where the generator was far off instead of trusting a truncated weight: unbiased on
what is kept, biased by what is dropped, variance bounded by hi. Shapes (B, T).
"""

from __future__ import annotations

import math

from tether.estimators.base import CorrectionTerms, clamp_log_ratio
from tether.estimators.registry import CORRECTIONS, NonNegative, Positive
from tether.lazy import torch


def _band(log_value: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """lo <= exp(log_value) <= hi, tested in log space (lo = 0 gives log 0 = -inf)."""
    log_lo = math.log(lo) if lo > 0 else -math.inf
    return (log_value >= log_lo) & (log_value <= math.log(hi))


def masked_is(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    lo: NonNegative = 0.5,
    hi: Positive = 2.0,
) -> CorrectionTerms:
    log_rho = logp_old - logp_rollout  # (B, T)
    keep = _band(log_rho, lo, hi)
    weight = torch.where(keep, clamp_log_ratio(log_rho).exp(), torch.zeros_like(log_rho))
    return CorrectionTerms(weight=weight, truncated=torch.zeros_like(mask), masked=~keep & mask)


_TOKEN_META = {
    "corrects": "numerical",
    "level": "token",
    "formula": "w = rho if lo <= rho <= hi else 0",
}
CORRECTIONS.add("mis", masked_is, source="MIS (Liu, Li et al. 2025)", **_TOKEN_META)
CORRECTIONS.add("icepop", masked_is, source="IcePop (Ling team 2025)", **_TOKEN_META)


@CORRECTIONS.register(
    "seq_mis",
    corrects="numerical",
    level="sequence",
    formula="w_i = prod rho if lo <= prod rho <= hi else 0",
    source="MIS (Liu, Li et al. 2025), sequence form",
)
def seq_mis(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    lo: NonNegative = 0.5,
    hi: Positive = 2.0,
) -> CorrectionTerms:
    log_rho = ((logp_old - logp_rollout) * mask).sum(dim=-1, keepdim=True)  # (B, 1)
    keep = _band(log_rho, lo, hi)
    weight = torch.where(keep, clamp_log_ratio(log_rho).exp(), torch.zeros_like(log_rho))
    return CorrectionTerms(
        weight=weight.expand_as(logp_old), truncated=torch.zeros_like(mask), masked=~keep & mask
    )


@CORRECTIONS.register(
    "geo_mis",
    corrects="numerical",
    level="sequence",
    formula="w_i = 1 if lo <= exp(mean_t log rho) <= hi else 0",
    source="geometric-mean mask, bounds as SkyRL",
)
def geo_mis(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    lo: NonNegative = 0.99,
    hi: Positive = 1.01,
) -> CorrectionTerms:
    maskf = mask.to(logp_old.dtype)
    n = maskf.sum(dim=-1, keepdim=True).clamp(min=1.0)
    log_geo = ((logp_old - logp_rollout) * maskf).sum(dim=-1, keepdim=True) / n  # (B, 1)
    keep = _band(log_geo, lo, hi)
    weight = keep.to(logp_old.dtype).expand_as(logp_old)
    return CorrectionTerms(weight=weight, truncated=torch.zeros_like(mask), masked=~keep & mask)
