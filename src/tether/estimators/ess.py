"""Normalised effective sample size of importance weights, in (0, 1].

    ESS = (sum m w)^2 / (sum m * sum m w^2)

1 when all valid weights are equal, 1/N when one dominates. Computed on untruncated
ratios; token level on w_t, sequence level on w_i = prod_t w_t (rows with no valid token
are left out). The log-ratio forms work in log space, so a log-ratio of 1e4 is fine:
ESS = exp(2 LSE(l) - LSE(2 l) - log N). An empty selection gives 1 (nothing is stale).
Used as DLC's re-sync trigger (`ess:0.5`) and logged as `<cause>/ess/<level>`.
"""

from __future__ import annotations

import math

from tether.lazy import torch


def ess(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Normalised ESS of nonnegative `weights` over `mask` (same shape); 0-d tensor."""
    m = mask.to(weights.dtype)
    w = torch.where(mask.bool(), weights, torch.zeros_like(weights))
    n = m.sum()
    first, second = w.sum(), (w * w).sum()
    value = first * first / (n * second).clamp(min=torch.finfo(weights.dtype).tiny)
    return torch.where(n > 0, value, torch.ones_like(value))


def ess_from_log(log_w: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """ESS over the last dim of `log_w` where `keep`; leading dims are batched."""
    masked = torch.where(keep, log_w, torch.full_like(log_w, -math.inf))
    n = keep.sum(dim=-1).to(log_w.dtype)
    lse1 = torch.logsumexp(masked, dim=-1)
    lse2 = torch.logsumexp(2.0 * masked, dim=-1)
    value = (2.0 * lse1 - lse2 - n.clamp(min=1.0).log()).exp()
    return torch.where(n > 0, value.clamp(max=1.0), torch.ones_like(value))


def ess_token(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level ESS of w_t = exp(log_ratio) over valid tokens (B, T); 0-d tensor."""
    keep = mask.bool()
    return ess_from_log(log_ratio.reshape(-1), keep.reshape(-1))


def ess_seq(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence-level ESS of w_i = prod_t exp(log_ratio) over non-empty rows; 0-d tensor."""
    keep = mask.bool()
    log_w = torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1)  # (B,)
    return ess_from_log(log_w, keep.any(dim=-1))
