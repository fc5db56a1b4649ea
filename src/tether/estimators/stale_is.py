"""Truncated token importance sampling: `stale_is` (DLC's staleness part) and `total_is`.

stale_is:
    w_t = min(r_t, C_s),  r_t = pi_theta(y_t) / pi_old(y_t)
    l_t = -sg(w_t) A_t log pi_theta(y_t),  C_s = 2
Source: Li, Zhou, Lan, "On the Origin and Evolution of Training-Inference Mismatch in
LLM RL" (DLC), the staleness correction; its numerical part is `centering`.
Corrects: staleness (pi_theta against pi_old, same numerics). With C_s = inf it is the
unbiased per-prefix importance-sampling estimator of E_{pi_theta(.|h)}[A grad log pi]
(the prefix distribution stays pi_old's); a finite cap trades that bias for bounded
variance.

total_is (preset `reweight`):
    w_t = min(pi_theta(y_t) / mu(y_t), C) = min(r_t rho_t, C)
    l_t = -sg(w_t) A_t log pi_theta(y_t),  C = 2
Source: DLC's plain-reweighting baseline (the run that drifted 115 sigma off the
on-policy path): one token IS weight on the whole ratio, staleness and numerics
together, no centering, no PPO clip, no re-sync. The paper (as summarised in
shared/seeds) gives no cap; C = 2 is TIS's and stale_is's. Corrects: both, in one
weight, so pair it with correction `none`. Unbiased per prefix for C = inf; its
variance grows with the product of both ratios, which is what ESS-triggered re-sync
watches. Shapes (B, T).
"""

from __future__ import annotations

from tether.estimators.base import ObjectiveTerms, clamp_log_ratio
from tether.estimators.registry import OBJECTIVES, Positive
from tether.lazy import torch


def truncated_is(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
) -> ObjectiveTerms:
    """-sg(min(pi_theta / pi_ref, cap)) A log pi_theta, for a detached reference log-prob."""
    ratio = clamp_log_ratio(logp.detach() - logp_ref).exp()  # (B, T) untruncated, detached
    w = ratio.clamp(max=cap)
    return ObjectiveTerms(loss=-w * advantages * logp, coef=w, clipped=(ratio > cap) & mask)


def stale_is_head_weight(
    topk_logp: torch.Tensor, topk_logp_old: torch.Tensor, *, stale_cap: Positive = 2.0
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
    stale_cap: Positive = 2.0,
) -> ObjectiveTerms:
    return truncated_is(logp, logp_old, advantages, mask, stale_cap)


@OBJECTIVES.register(
    "total_is",
    corrects="both",
    level="token",
    formula="-sg(min(pi/mu, C)) A log pi",
    source="DLC (Li, Zhou, Lan), plain reweighting baseline",
    includes_mismatch=True,
)
def total_is(
    logp: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: Positive = 2.0,
) -> ObjectiveTerms:
    return truncated_is(logp, logp_rollout, advantages, mask, cap)
