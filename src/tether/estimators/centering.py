"""Score centering: DLC's numerical-mismatch correction (Marek & Ryabinin).

A sample y ~ mu at prefix h, weighted w(y) by the objective, has the update
A w(y) grad log pi_theta(y), whose mean under mu is not 0 when mu != pi_theta. Subtract
the prefix's expected weighted score:

    g = A [ w(y) grad log pi_theta(y) - sum_v mu(v) w(v) grad log pi_theta(v) ]

Only the generator's top-K head H is known. Model the tail as mu ~ rho_tail pi_old,
rho_tail = (1 - sum_H mu) / (1 - sum_H pi_old), so the tail's mu w ~ rho_tail pi_theta
(uncapped staleness weight); since sum_v pi_theta grad log pi_theta = 0, the tail sum
equals -rho_tail sum_H pi_theta grad log pi_theta. As a loss term, per token:

    center_t = A_t sum_{v in H} sg( mu(v) w(v) - rho_tail pi_theta(v) ) log pi_theta(v)

Minimising loss = l_obj + center follows -g. Exact when H is the whole vocabulary:
then the tail is empty, and rho_tail is set to 0 (so is any tail below TAIL_MASS_EPS,
where the ratio of two rounding errors would be noise). With K = V - 1 it is exact too
(a one-token tail is its own model). Head entries with a non-finite mu (padding of
fewer than K ids) are left out.

Source: DLC (Li, Zhou, Lan) numerical part; score centering, Marek & Ryabinin, arXiv
2609.20807 (public: NeMo RL `score_centering`, torchtitan
`rl/losses/score_centering.py`). Corrects: numerical. Under a constant advantage the
centered expected gradient is exactly 0 (K = V), where plain pg drifts by
A E_mu[grad log pi_theta]; variance: adds the head sum, a control variate.
Shapes: A, mask (B, T); top-K tensors (B, T, K).
"""

from __future__ import annotations

from tether.lazy import torch

# Tail mass of pi_old below this counts as an empty tail (rho_tail = 0).
TAIL_MASS_EPS = 1e-6


def center_term(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    topk_logp: torch.Tensor,
    topk_logp_old: torch.Tensor,
    topk_logp_rollout: torch.Tensor,
    head_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """center_t (B, T) with grad through topk_logp; rho_tail and sum_H mu (B, T), detached.

    `head_weight` is w(v) on the head (B, T, K), detached, from the objective.
    """
    valid = torch.isfinite(topk_logp_rollout) & mask.unsqueeze(-1)  # (B, T, K)
    zero = torch.zeros_like(topk_logp_old)
    mu = torch.where(valid, topk_logp_rollout, -torch.inf).exp()  # 0 off the head
    pi_old = torch.where(valid, topk_logp_old, -torch.inf).exp()
    logp = torch.where(valid, topk_logp, zero)  # (B, T, K) with grad
    pi = logp.detach().exp()
    tail_old = 1.0 - pi_old.sum(dim=-1)  # (B, T)
    head_mu = mu.sum(dim=-1)
    tail_mu = (1.0 - head_mu).clamp(min=0.0)
    has_tail = tail_old > TAIL_MASS_EPS
    rho_tail = torch.where(has_tail, tail_mu / tail_old.clamp(min=TAIL_MASS_EPS), zero[..., 0])
    coef = torch.where(valid, mu * head_weight - rho_tail.unsqueeze(-1) * pi, zero)  # detached
    center = advantages * (coef * logp).sum(dim=-1)
    return center, rho_tail, head_mu
