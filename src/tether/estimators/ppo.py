"""`ppo` (GRPO's clipped surrogate) and `decoupled` (AReaL's decoupled PPO).

ppo:
    r_t = pi_theta(y_t) / pi_old(y_t)
    l_t = -min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t),  eps = (0.2, 0.28)
Source: Schulman et al. 2017 (PPO, eq. 7); GRPO (Shao et al. 2024, eq. 3) with DAPO's
clip-higher eps_hi = 0.28 (Yu et al. 2025). Corrects: staleness, as a trust region
rather than a reweighting: biased (clipped tokens drop out, the rest use r), bounded
variance. Gradient: -r A grad log pi where unclipped, 0 where clipped; so centering
(`ppo+none+centering`, the `dlc_clip` preset) can take w(v) = r(v), 0 where clipped
for the sign of the token's A, as the head weight.

decoupled:
    l_t = -sg(min(pi_prox / mu, C)) min(r'_t A_t, clip(r'_t, 1 - eps_lo, 1 + eps_hi) A_t)
    r'_t = pi_theta / pi_prox,  eps = (0.2, 0.2),  C = 5
Source: Fu et al., "AReaL" (2025), the decoupled PPO objective. pi_prox is the
trainer at the weights this step started from: it reads `logp_prox`, so the trainer
scores it once per batch, without grad, before the batch's first optimizer step (AReaL
recomputes it the same way, once per training step for all its mini-batches); a batch
whose every token was sampled at the trainer's version has pi_prox = pi_old and gets no
extra forward. Corrects: both (pi_prox / mu spans the numerics and the versions between
generator and step start). Departure: AReaL's old default dropped tokens whose behaviour
weight exceeded 5 (today's AReaL applies no behaviour weight unless rejection sampling
is configured, then masks or clamps); DESIGN.md truncates to the cap, as here.
behaviour_cap="cis" (the `decoupled_cis` preset): CIS's recipe (kzhao5/CIS-RL, its AReaL
patch: rejection sampling action "cis") caps the behaviour weight at CIS's calibrated
1 + lam max(1 - pi_prox, kappa) (lam 2.3, kappa 5e-3) instead of the fixed C; `cap` is then
unused, `lam` and `kappa` are unused otherwise.
Shapes (B, T).
"""

from __future__ import annotations

from tether.estimators.base import ObjectiveTerms, clamp_log_ratio
from tether.estimators.registry import (
    OBJECTIVES,
    BehaviourCap,
    ClipLow,
    NonNegative,
    Positive,
    UnitInterval,
)
from tether.lazy import torch


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> ObjectiveTerms:
    """PPO's pessimistic clipped surrogate for a log-ratio that carries the gradient."""
    ratio = clamp_log_ratio(log_ratio).exp()  # (B, T)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    coef, clipped = clip_coef(ratio.detach(), advantages, clip_low, clip_high)
    return ObjectiveTerms(loss=loss, coef=coef, clipped=clipped & mask)


def clip_coef(
    r: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate's weight on the score, r or 0, and where it is 0 (detached r)."""
    # The max picks the clipped branch (zero gradient) exactly in these two cases.
    clipped = ((advantages > 0) & (r > 1.0 + clip_high)) | ((advantages < 0) & (r < 1.0 - clip_low))
    return torch.where(clipped, torch.zeros_like(r), r), clipped


def ppo_head_weight(
    topk_logp: torch.Tensor,
    topk_logp_old: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """w(v) = r(v), or 0 where the token's A would clip it, on the top-K head. (B, T, K)."""
    r = clamp_log_ratio(topk_logp.detach() - topk_logp_old).exp()
    return clip_coef(r, advantages.unsqueeze(-1), clip_low, clip_high)[0]


@OBJECTIVES.register(
    "ppo",
    corrects="staleness",
    level="token",
    formula="-min(r A, clip(r, 1-eps_lo, 1+eps_hi) A)",
    source="PPO (Schulman 2017, eq. 7); GRPO (Shao 2024); clip-higher from DAPO",
    head_weight=ppo_head_weight,
)
def ppo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: ClipLow = 0.2,
    clip_high: NonNegative = 0.28,
) -> ObjectiveTerms:
    return clipped_surrogate(logp - logp_old, advantages, mask, clip_low, clip_high)


@OBJECTIVES.register(
    "decoupled",
    corrects="both",
    level="token",
    formula=("-sg(min(pi_prox/mu, C)) min(r' A, clip(r', 1-eps, 1+eps) A), r' = pi/pi_prox, "
             "C = cap, or 1 + lam max(1 - pi_prox, kappa) (behaviour_cap=cis)"),
    source="AReaL (Fu et al. 2025), decoupled PPO",
    includes_mismatch=True,
)
def decoupled(
    logp: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: ClipLow = 0.2,
    clip_high: NonNegative = 0.2,
    cap: Positive = 5.0,
    behaviour_cap: BehaviourCap = "fixed",
    lam: NonNegative = 2.3,
    kappa: UnitInterval = 5e-3,
) -> ObjectiveTerms:
    behaviour = clamp_log_ratio(logp_prox - logp_rollout).exp()  # (B, T) pi_prox / mu
    if behaviour_cap == "cis":  # CIS's calibrated cap on pi_prox's confidence
        behaviour = torch.minimum(behaviour, 1.0 + lam * (1.0 - logp_prox.exp()).clamp(min=kappa))
    else:
        behaviour = behaviour.clamp(max=cap)
    terms = clipped_surrogate(logp - logp_prox, advantages, mask, clip_low, clip_high)
    return ObjectiveTerms(
        loss=behaviour * terms.loss, coef=behaviour * terms.coef, clipped=terms.clipped,
        mismatch_weight=behaviour.detach(),
    )
