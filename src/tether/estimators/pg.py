"""`pg`: the plain policy-gradient surrogate, which treats the data as on-policy.

    l_t = -A_t log pi_theta(y_t)

Source: REINFORCE (Williams 1992); the "naive" baseline of every mismatch paper.
Corrects: neither cause. Sampled from mu, its expected gradient is
E_mu[A grad log pi_theta], biased for grad J(pi_theta) whenever mu != pi_theta; it has
no importance weight, hence the lowest variance of all. Shapes (B, T) in, (B, T) out.
"""

from __future__ import annotations

from tether.estimators.base import ObjectiveTerms
from tether.estimators.registry import OBJECTIVES
from tether.lazy import torch


def pg_head_weight(topk_logp: torch.Tensor, topk_logp_old: torch.Tensor) -> torch.Tensor:
    """w(v) = 1 on the top-K head: pg weighs every sampled score by 1."""
    return torch.ones_like(topk_logp_old)


@OBJECTIVES.register(
    "pg",
    corrects="neither",
    level="token",
    formula="-A log pi",
    source="REINFORCE (Williams 1992)",
    head_weight=pg_head_weight,
)
def pg(logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> ObjectiveTerms:
    """Plain policy gradient; `mask` only sets the shape of the outputs."""
    loss = -advantages * logp  # (B, T)
    ones = torch.ones_like(advantages)
    return ObjectiveTerms(loss=loss, coef=ones, clipped=torch.zeros_like(mask))
