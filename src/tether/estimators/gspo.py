"""`gspo`: Group Sequence Policy Optimization, token form (GSPO-token).

    s_i    = exp( (1/|y_i|) sum_t log r_it )             sequence ratio, geometric mean
    s_it   = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))  value s_i, gradient s_i grad log pi
    l_it   = -min(s_it A_it, clip(s_it, 1 - eps_lo, 1 + eps_hi) A_it),  eps = (3e-4, 4e-4)

Source: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (the
GSPO-token objective, eqs. 13-14; with a sequence-constant advantage it equals GSPO).
Corrects: staleness, at the sequence level: one length-normalised ratio per response,
so the clip keeps or drops whole responses. The geometric mean is not an importance
weight (biased), but its variance does not grow with length. Shapes (B, T); s_i is (B,).

Aggregation: seq-mean-token-mean by default, the paper's. GSPO's objective (eq. 5) is
(1/G) sum_i of the sequence term and GSPO-token's (eq. 13) is (1/G) sum_i (1/|y_i|) sum_t:
every response weighs the same whatever its length. token-mean would weigh a response
by its length (TRL and verl's GSPO aggregate per sequence too).
"""

from __future__ import annotations

from tether.estimators.base import SAFETY_BOUND, ObjectiveTerms
from tether.estimators.registry import OBJECTIVES, ClipLow, NonNegative
from tether.lazy import torch


@OBJECTIVES.register(
    "gspo",
    corrects="staleness",
    level="sequence",
    formula="-min(s A, clip(s, 1-eps_lo, 1+eps_hi) A), s = exp(mean_t log r)",
    source="GSPO (Zheng et al. 2025, arXiv 2507.18071)",
    agg="seq-mean-token-mean",
)
def gspo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: ClipLow = 3e-4,
    clip_high: NonNegative = 4e-4,
) -> ObjectiveTerms:
    maskf = mask.to(logp.dtype)
    n = maskf.sum(dim=-1, keepdim=True).clamp(min=1.0)  # (B, 1)
    log_s = ((logp.detach() - logp_old) * maskf).sum(dim=-1, keepdim=True) / n
    log_s = log_s.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, 1)
    # Value s_i at every token; d/d logp_t = s_i (the token form's gradient).
    s_token = (log_s + logp - logp.detach()).exp()  # (B, T)
    s = s_token.detach()
    loss = torch.maximum(
        -advantages * s_token, -advantages * s_token.clamp(1.0 - clip_low, 1.0 + clip_high)
    )
    clipped = ((advantages > 0) & (s > 1.0 + clip_high)) | ((advantages < 0) & (s < 1.0 - clip_low))
    coef = torch.where(clipped, torch.zeros_like(s), s)
    return ObjectiveTerms(loss=loss, coef=coef, clipped=clipped & mask)
