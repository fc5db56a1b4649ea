"""Per-step diagnostics every estimator reports, named `cause/metric/stat`.

Raw ratios, before any truncation, per cause:
    numerical/is_weight/{mean,max,second_moment}   rho = pi_old / mu
    staleness/ratio/{mean,max,second_moment}       r = pi_theta / pi_old
    total/is_weight/{mean,max,second_moment}       pi_theta / mu
    {numerical,staleness,total}/ess/{token,seq}    normalised ESS (tether.estimators.ess)
What the estimator applied:
    correction/weight/{mean,max,second_moment}    w_mm over valid tokens
    correction/weight/adv_second_moment           E[w^2 A^2] / E[A^2] (1 uncorrected)
    correction/frac_truncated, correction/frac_masked
    objective/frac_clipped                        tokens whose gradient the objective cut
    objective/coef/{mean,max}                     the objective's own weight on the score
    loss/total, loss/objective, loss/centering
    centering/rho_tail/mean, centering/head_mass/rollout   (centering estimators only)
Everything stays a tensor until `to_floats`, which syncs once.
"""

from __future__ import annotations

from tether.estimators.base import CorrectionTerms, ObjectiveTerms, clamp_log_ratio
from tether.estimators.ess import ess_from_log
from tether.lazy import torch

_CAUSES = (("numerical", "is_weight"), ("staleness", "ratio"), ("total", "is_weight"))


def masked_stats(values: torch.Tensor, maskf: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """(mean, max, second moment) over valid tokens of values (..., B, T); shape (..., 3)."""
    flat = (values * maskf).flatten(-2)
    mean = flat.sum(dim=-1) / n
    second = (flat * flat).sum(dim=-1) / n
    peak = torch.where(maskf.bool(), values, torch.zeros_like(values)).flatten(-2).amax(dim=-1)
    return torch.stack([mean, peak, second], dim=-1)


def ratio_metrics(
    log_rho: torch.Tensor, log_r: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Raw-ratio statistics and ESS for the three causes; inputs (B, T), detached."""
    log_ratios = torch.stack([log_rho, log_r, log_rho + log_r])  # (3, B, T)
    maskf = mask.to(log_rho.dtype)
    n = maskf.sum().clamp(min=1.0)
    stats = masked_stats(clamp_log_ratio(log_ratios).exp(), maskf, n)  # (3, 3)
    ess_tok = ess_from_log(log_ratios.flatten(-2), mask.flatten().expand(3, -1))  # (3,)
    ess_seq = ess_from_log((log_ratios * maskf).sum(dim=-1), mask.any(dim=-1).expand(3, -1))
    out: dict[str, torch.Tensor] = {}
    for i, (cause, name) in enumerate(_CAUSES):
        for j, stat in enumerate(("mean", "max", "second_moment")):
            out[f"{cause}/{name}/{stat}"] = stats[i, j]
        out[f"{cause}/ess/token"] = ess_tok[i]
        out[f"{cause}/ess/seq"] = ess_seq[i]
    return out


def applied_metrics(
    log_rho: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    corr: CorrectionTerms,
    obj: ObjectiveTerms,
) -> dict[str, torch.Tensor]:
    """What the correction and the objective did to the valid tokens; inputs (B, T)."""
    maskf = mask.to(advantages.dtype)
    n = maskf.sum().clamp(min=1.0)
    a2 = advantages.square() * maskf
    rho = clamp_log_ratio(log_rho).exp()
    # the weight on pi/mu actually applied: an objective's own (decoupled), else the correction's
    applied = corr.weight if obj.mismatch_weight is None else obj.mismatch_weight
    corr_stats = masked_stats(applied, maskf, n)
    coef_stats = masked_stats(obj.coef, maskf, n)
    return {
        "numerical/is_weight/adv_second_moment": _adv_second_moment(rho, a2),
        "correction/weight/mean": corr_stats[0],
        "correction/weight/max": corr_stats[1],
        "correction/weight/second_moment": corr_stats[2],
        "correction/weight/adv_second_moment": _adv_second_moment(applied, a2),
        "correction/frac_truncated": corr.truncated.sum() / n,
        "correction/frac_masked": corr.masked.sum() / n,
        "objective/frac_clipped": obj.clipped.sum() / n,
        "objective/coef/mean": coef_stats[0],
        "objective/coef/max": coef_stats[1],
    }


def _adv_second_moment(weight: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
    """E[w^2 A^2] / E[A^2] over valid tokens (a2 = A^2, 0 where masked); 1 if all A = 0."""
    den = a2.sum()
    num = (weight.square() * a2).sum()
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), 1.0)


def centering_metrics(
    rho_tail: torch.Tensor, head_mu: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mean tail ratio and mean mass of mu on the head, over valid tokens."""
    maskf = mask.to(rho_tail.dtype)
    n = maskf.sum().clamp(min=1.0)
    return {
        "centering/rho_tail/mean": (rho_tail * maskf).sum() / n,
        "centering/head_mass/rollout": (head_mu * maskf).sum() / n,
    }


TOP_SHARE = 0.05  # objective/coef_seq/top_share: the share of the coefficients' sum on this top share


def sequence_weight_metrics(
    log_r: torch.Tensor, log_rho: torch.Tensor, coef: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How the sequence weights spread over a step's responses (`diagnostics.seq_weights`);
    inputs (B, T), detached, over the whole step batch; rows without a valid token left out.

        staleness/seq_log_ratio/{q05,q50,q95}  log W = sum_t log pi_theta/pi_old (VESPO's W)
        total/seq_log_ratio/{q05,q50,q95}      sum_t log pi_theta/mu (W with include_rho)
        objective/coef_seq/{q05,q50,q95,max}   the objective's weight per response, the mean
                                                over its tokens (VESPO: phi(W))
        objective/coef_seq/top_share           the share of those weights' sum on the top
                                                TOP_SHARE of responses (TOP_SHARE when equal)
    """
    rows = mask.any(dim=-1)
    if not rows.any():
        return {}
    maskf = mask.to(log_r.dtype)
    n_tok = maskf.sum(dim=-1).clamp(min=1.0)
    log_w = torch.stack([(clamp_log_ratio(x) * maskf).sum(dim=-1) for x in (log_r, log_r + log_rho)])
    per_row = ((coef * maskf).sum(dim=-1) / n_tok)[rows]
    q = torch.tensor([0.05, 0.5, 0.95], dtype=log_w.dtype, device=log_w.device)
    quantiles = torch.quantile(torch.cat([log_w[:, rows], per_row[None]]), q, dim=-1)  # (3, 3)
    top = max(1, round(TOP_SHARE * per_row.numel()))
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(("staleness/seq_log_ratio", "total/seq_log_ratio", "objective/coef_seq")):
        for j, stat in enumerate(("q05", "q50", "q95")):
            out[f"{name}/{stat}"] = quantiles[j, i]
    out["objective/coef_seq/max"] = per_row.max()
    total = per_row.abs().sum()
    out["objective/coef_seq/top_share"] = torch.where(
        total > 0, per_row.abs().topk(top).values.sum() / total.clamp(min=torch.finfo(total.dtype).tiny),
        torch.ones_like(total) * top / per_row.numel())
    return out


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device sync for the whole dict."""
    values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in metrics.values()])
    return dict(zip(metrics, values.tolist(), strict=True))
