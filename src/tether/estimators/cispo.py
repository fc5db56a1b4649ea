"""`cispo`: Clipped IS-weight Policy Optimization, a clipped, detached weight on the score.

    r_t = pi_theta(y_t) / pi_old(y_t)
    w_t = clip(r_t, 1 - eps_lo, 1 + eps_hi),  (eps_lo, eps_hi) = (1, 4): w_t = min(r_t, 5)
    l_t = -sg(w_t) A_t log pi_theta(y_t)

Source: MiniMax, "MiniMax-M1", arXiv 2506.13585, section 3.1: the objective (eq. 4)
and the clipped weight (eq. 5). Unlike PPO's clip, which zeroes a clipped token's
gradient, the clip here bounds the weight and every token keeps its gradient.
Corrects: staleness, by truncated importance sampling (biased where the cap binds,
bounded variance); with eps_lo = 1 and eps_hi = C_s - 1 it is `stale_is`.

Defaults: MiniMax-M1 sets no lower bound ("setting eps_low^IS to a large value"): eps_lo =
1 puts it at 0, as Trinity-RFT and NeMo-RL do. The paper tunes eps_hi without stating
it; eps_hi = 4 is TRL's recommended cap eps_max = 5 (from ScaleRL, Khatri et al., arXiv
2510.13786). verl's example uses (10, 0.2), ROLL's defaults (0.1, 0.1) clip both sides.
Aggregation: token-mean, eq. 4's 1 / sum_i |o_i|. Shapes (B, T).
"""

from __future__ import annotations

from tether.estimators.base import ObjectiveTerms, clamp_log_ratio
from tether.estimators.registry import OBJECTIVES, ClipLow, NonNegative
from tether.lazy import torch


@OBJECTIVES.register(
    "cispo",
    corrects="staleness",
    level="token",
    formula="-sg(clip(r, 1-eps_lo, 1+eps_hi)) A log pi",
    source="CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5)",
)
def cispo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: ClipLow = 1.0,
    clip_high: NonNegative = 4.0,
) -> ObjectiveTerms:
    r = clamp_log_ratio(logp.detach() - logp_old).exp()  # (B, T) unclipped, detached
    w = r.clamp(1.0 - clip_low, 1.0 + clip_high)
    # "Clipped" here means the weight was clipped: the token's gradient is kept.
    return ObjectiveTerms(loss=-w * advantages * logp, coef=w, clipped=(w != r) & mask)
