"""`stale_is`: DLC's staleness importance sampling, truncated.

    w_t = min(r_t, C_s),  r_t = pi_theta(y_t) / pi_old(y_t)
    l_t = -sg(w_t) A_t log pi_theta(y_t),  C_s = 2

Source: Li, Zhou, Lan, "On the Origin and Evolution of Training-Inference Mismatch in
LLM RL" (DLC), the staleness correction; its numerical part is `centering`.
Corrects: staleness (pi_theta against pi_old, same numerics). With C_s = inf it is the
unbiased per-prefix importance-sampling estimator of E_{pi_theta(.|h)}[A grad log pi]
(the prefix distribution stays pi_old's); a finite cap trades that bias for bounded
variance. Shapes (B, T).
"""

from __future__ import annotations

from tether.estimators.base import ObjectiveTerms, clamp_log_ratio
from tether.estimators.registry import OBJECTIVES
from tether.lazy import torch


def stale_is_head_weight(
    topk_logp: torch.Tensor, topk_logp_old: torch.Tensor, *, stale_cap: float = 2.0
) -> torch.Tensor:
    """w(v) = min(pi_theta(v) / pi_old(v), C_s) on the top-K head, detached. (B, T, K)."""
    log_r = clamp_log_ratio(topk_logp.detach() - topk_logp_old)
    return log_r.exp().clamp(max=stale_cap)


@OBJECTIVES.register(
    "stale_is",
    corrects="staleness",
    level="token",
    formula="-sg(min(r, C_s)) A log pi",
    source="DLC (Li, Zhou, Lan), staleness IS",
    head_weight=stale_is_head_weight,
)
def stale_is(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    stale_cap: float = 2.0,
) -> ObjectiveTerms:
    r = clamp_log_ratio(logp.detach() - logp_old).exp()  # (B, T) untruncated, detached
    w = r.clamp(max=stale_cap)
    return ObjectiveTerms(loss=-w * advantages * logp, coef=w, clipped=(r > stale_cap) & mask)
