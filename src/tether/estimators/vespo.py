"""`vespo`: a gamma-shaped weight of the true sequence importance ratio.

    log W_i = sum_t clamp(log r_it)                       (pi_theta / pi_old: a product)
            [+ sum_t clamp(log rho_it) with include_rho]  (then pi_theta / mu)
    phi(W)  = W^k exp(lam (1 - W))                        phi(1) = 1, peak at W = k / lam
    l_it    = -sg(phi(W_i)) A_it log pi_theta(y_it)
    (k, lam) = (2, 3) for A >= 0, (3, 2) for A < 0

Source: Shen et al., VESPO, arXiv 2602.10693; code FloyedShen/VESPO
(`recipe/vespo/code/core_algos.py`, `compute_policy_loss_vespo`), also TRL
`get_gamma_weights`. Each term and the sum are clamped to +-SAFETY_BOUND as there.
Their W is prod pi_theta / pi_old; rho enters only when verl's rollout correction
passes `rollout_is_weights`, which the paper's run scripts do not configure: hence
include_rho = False by default. Corrects: staleness; with include_rho, both (W spans
pi_theta to mu, and a mismatch correction on top would count rho twice, so it is
refused). phi is a smooth, bounded reshaping of the unbiased sequence weight W: biased,
but the variance stays bounded however stale the data.
The sign of each token's advantage picks (k, lam); with outcome advantages, constant
over a response, that is the paper's per-sequence choice.

length_norm divides log W by the row's token count ("T") or its square root
("sqrtT") before phi: the variants the paper reports as destabilising, kept for the
E-VESPO experiment. Default "none": the true product. Shapes (B, T); W is (B,).
"""

from __future__ import annotations

from tether.estimators.base import SAFETY_BOUND, ObjectiveTerms, clamp_log_ratio
from tether.estimators.registry import OBJECTIVES, LengthNorm, NonNegative
from tether.lazy import torch


def sequence_log_weight(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    length_norm: str = "none",
    include_rho: bool = False,
) -> torch.Tensor:
    """log W_i = sum_t log(pi_theta / pi_old) (/ mu with include_rho), each term and the sum
    clamped; (B, 1), detached."""
    maskf = mask.to(logp_old.dtype)
    log_w = clamp_log_ratio(logp.detach() - logp_old)
    if include_rho:
        log_w = log_w + clamp_log_ratio(logp_old - logp_rollout)
    log_w = (log_w * maskf).sum(dim=-1, keepdim=True)  # (B, 1)
    if length_norm != "none":
        n = maskf.sum(dim=-1, keepdim=True).clamp(min=1.0)
        log_w = log_w / (n if length_norm == "T" else n.sqrt())
    return log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def gamma_weight(log_w: torch.Tensor, k: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """phi(W) = W^k exp(lam (1 - W)), in log space: exp(k log W + lam (1 - W)).

    The exponent is capped at SAFETY_BOUND: only reachable with lam ~ 0 and a large k
    (the defaults peak at phi ~ 1.2), where it keeps phi finite.
    """
    return (k * log_w + lam * (1.0 - log_w.exp())).clamp(max=SAFETY_BOUND).exp()


@OBJECTIVES.register(
    "vespo",
    corrects="staleness",
    level="sequence",
    formula="-sg(phi(W)) A log pi, W = prod_t r (x rho: include_rho), phi(W) = W^k e^(lam (1 - W))",
    source="VESPO (Shen et al., arXiv 2602.10693)",
    mismatch_flag="include_rho",
)
def vespo(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: NonNegative = 2.0,
    lam_pos: NonNegative = 3.0,
    k_neg: NonNegative = 3.0,
    lam_neg: NonNegative = 2.0,
    length_norm: LengthNorm = "none",
    include_rho: bool = False,
) -> ObjectiveTerms:
    log_w = sequence_log_weight(logp, logp_old, logp_rollout, mask, length_norm, include_rho)
    positive = advantages >= 0
    k = torch.where(positive, log_w.new_tensor(k_pos), log_w.new_tensor(k_neg))
    lam = torch.where(positive, log_w.new_tensor(lam_pos), log_w.new_tensor(lam_neg))
    phi = gamma_weight(log_w, k, lam)  # (B, T), detached: log_w carries no graph
    return ObjectiveTerms(loss=-phi * advantages * logp, coef=phi, clipped=torch.zeros_like(mask))
