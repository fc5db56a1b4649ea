"""`sapo`: Soft Adaptive Policy Optimization, a sigmoid gate instead of a hard clip.

    r_t   = pi_theta(y_t) / pi_old(y_t)
    tau_t = tau_pos if A_t > 0 else tau_neg,  (tau_pos, tau_neg) = (1.0, 1.05)
    l_t   = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A_t
    d l_t / d log pi = -4 g (1 - g) r_t A_t,  g = sigmoid(tau_t (r_t - 1))

Source: Gao et al., "Soft Adaptive Policy Optimization", arXiv 2511.20347. At r = 1 the
gate's weight 4 g (1 - g) r is exactly 1 (the 4/tau factor is there for that), so near
on-policy it is plain policy gradient; far from it the weight decays smoothly instead
of dropping to 0. Corrects: staleness, as a soft trust region (biased, bounded
variance). The larger tau for A < 0 makes negative updates decay faster. Shapes (B, T).

Aggregation: seq-mean-token-mean by default, the paper's. SAPO's objective (eq. 5),
J = E[(1/G) sum_i (1/|y_i|) sum_t f(r_it) A_it], normalises each response by its length
before averaging over the group; token-mean would weigh a response by its length (TRL
and verl aggregate SAPO per sequence too).
"""

from __future__ import annotations

from tether.estimators.base import ObjectiveTerms, clamp_log_ratio
from tether.estimators.registry import OBJECTIVES, PositiveFinite
from tether.lazy import torch


@OBJECTIVES.register(
    "sapo",
    corrects="staleness",
    level="token",
    formula="-(4/tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else tau_neg",
    source="SAPO (Gao et al. 2025, arXiv 2511.20347)",
    agg="seq-mean-token-mean",
)
def sapo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    tau_pos: PositiveFinite = 1.0,
    tau_neg: PositiveFinite = 1.05,
) -> ObjectiveTerms:
    ratio = clamp_log_ratio(logp - logp_old).exp()  # (B, T)
    tau = torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * gate * advantages
    g = gate.detach()
    coef = 4.0 * g * (1.0 - g) * ratio.detach()
    return ObjectiveTerms(loss=loss, coef=coef, clipped=torch.zeros_like(mask))
