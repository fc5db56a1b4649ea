"""Truncated importance sampling for numerical mismatch: `none`, `tis`, `seq_tis`.

    rho_t = pi_old(y_t) / mu(y_t)                  same weights, different numerics
    none:    w_t = 1
    tis:     w_t = min(rho_t, C),                  C = 2
    seq_tis: w_i = min(prod_t rho_t, C),           C = 2, one weight per response

Source: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (TIS, 2025); the sequence variant as in verl's rollout correction. All
weights are detached. Corrects: numerical. Truncation removes the variance of large
ratios at the price of a bias toward mu on the truncated tokens; the sequence form is
unbiased up to the cap but its variance grows with length. Shapes (B, T).
"""

from __future__ import annotations

import math

from tether.estimators.base import CorrectionTerms, clamp_log_ratio
from tether.estimators.registry import CORRECTIONS, Positive
from tether.lazy import torch


@CORRECTIONS.register(
    "none",
    corrects="neither",
    level="token",
    formula="w = 1",
    source="-",
)
def no_correction(logp_old: torch.Tensor, mask: torch.Tensor) -> CorrectionTerms:
    no = torch.zeros_like(mask)
    return CorrectionTerms(weight=torch.ones_like(logp_old), truncated=no, masked=no)


@CORRECTIONS.register(
    "tis",
    corrects="numerical",
    level="token",
    formula="w = min(rho, C)",
    source="TIS (Yao et al. 2025)",
)
def tis(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, *, cap: Positive = 2.0
) -> CorrectionTerms:
    rho = clamp_log_ratio(logp_old - logp_rollout).exp()  # (B, T)
    return CorrectionTerms(
        weight=rho.clamp(max=cap), truncated=(rho > cap) & mask, masked=torch.zeros_like(mask)
    )


@CORRECTIONS.register(
    "seq_tis",
    corrects="numerical",
    level="sequence",
    formula="w_i = min(prod_t rho_t, C)",
    source="TIS (Yao et al. 2025), sequence form",
)
def seq_tis(
    logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, *, cap: Positive = 2.0
) -> CorrectionTerms:
    # Stay in log space: the product of many ratios over- or underflows quickly.
    log_rho = ((logp_old - logp_rollout) * mask).sum(dim=-1, keepdim=True)  # (B, 1)
    log_cap = math.log(cap)  # inf for cap = inf
    weight = clamp_log_ratio(log_rho).clamp(max=log_cap).exp()
    truncated = (log_rho > log_cap) & mask
    return CorrectionTerms(
        weight=weight.expand_as(logp_old), truncated=truncated, masked=torch.zeros_like(mask)
    )
