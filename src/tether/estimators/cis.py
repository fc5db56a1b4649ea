"""`cis`: calibrated importance sampling, a cap that tightens with the token's confidence.

    rho_t = pi_old(y_t) / mu(y_t)
    w_t   = min(rho_t, 1 + lam * max(1 - pi_old(y_t), kappa)),  lam = 2.3, kappa = 5e-3
    w_t   = 1 where log rho_t is not finite

Source: Yu, Zhao, Li et al., "Rethinking Training-Inference Mismatch in LLM RL: Where It
Arises and How to Correct It", arXiv 2609.32444, Algorithm 1; code kzhao5/CIS-RL
(`cis/operator.py`). The cap bounds the log-odds displacement between trainer and
generator at one threshold; mapped back to a ratio it tightens as pi_old -> 1, where a
ratio above 1 is mostly numerical noise. kappa keeps the cap of confident tokens above
the storage resolution of log-probs. Only large weights are cut (no lower cap).
lam = 0 is TIS with cap 1. Corrects: numerical. Biased like TIS on the cut tokens, with
a far smaller second moment on confident ones. Shapes (B, T).
"""

from __future__ import annotations

from tether.estimators.base import CorrectionTerms, clamp_log_ratio
from tether.estimators.registry import CORRECTIONS, NonNegative, UnitInterval
from tether.lazy import torch


def cis_cap(logp_old: torch.Tensor, *, lam: NonNegative = 2.3, kappa: UnitInterval = 5e-3) -> torch.Tensor:
    """1 + lam * max(1 - pi_old(y), kappa), elementwise."""
    return 1.0 + lam * (1.0 - logp_old.exp()).clamp(min=kappa)


@CORRECTIONS.register(
    "cis",
    corrects="numerical",
    level="token",
    formula="w = min(rho, 1 + lam max(1 - pi_old, kappa))",
    source="CIS (Yu, Zhao, Li et al., arXiv 2609.32444, Alg. 1)",
)
def cis(
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    *,
    lam: NonNegative = 2.3,
    kappa: UnitInterval = 5e-3,
) -> CorrectionTerms:
    log_rho = logp_old - logp_rollout  # (B, T)
    log_rho = torch.where(torch.isfinite(log_rho), log_rho, torch.zeros_like(log_rho))
    rho = clamp_log_ratio(log_rho).exp()
    cap = cis_cap(logp_old, lam=lam, kappa=kappa)
    return CorrectionTerms(
        weight=torch.minimum(rho, cap), truncated=(rho > cap) & mask, masked=torch.zeros_like(mask)
    )
