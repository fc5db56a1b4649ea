"""Per-step mismatch diagnostics, split by cause (DESIGN.md sections 1 and 6). Pure functions.

Per sampled token y_t (drawn from the generator mu), with the three log-probs of
DESIGN.md section 1:
    numerical  log rho = logp_old - logp_rollout   same weights, different numerics
    staleness  log r   = logp     - logp_old       same numerics, different weights
    total      log w   = logp     - logp_rollout   = log r + log rho
For each cause, with delta its per-token log-ratio (target over sampler) over the valid
tokens of the batch, this module adds (`<cause>/<metric>/<stat>`):
    k1_kl/mean        mean(-delta)                      KL(sampler || target), k1 estimator
    k3_kl/mean        mean(exp(delta) - 1 - delta)      same KL, k3: >= 0, lower variance
    abs_log_ratio/max max |delta|
    chi2/token        mean(exp(2 delta)) - 1            chi^2(target || sampler), per token
    chi2/seq          mean_i exp(2 sum_t delta) - 1     the same on sequence ratios
    ppl_ratio/mean    mean_i exp(-mean_t delta)         perplexity under target / under sampler
and, for the MoE model, `numerical/routing_disagreement/{mean,any_layer}`; with routing
replay R3, the same divergence metrics of the forward without replay
(`numerical/replay_off/<metric>/<stat>`, docs/mismatch.md).
The KL estimates use the tokens as drawn from mu, so the staleness ones estimate
KL(pi_old || pi_theta) up to the numerical gap. Weight statistics (mean, max, second
moment) and ESS of each cause are the estimator's own metrics and function
(tether.estimators.metrics.ratio_metrics: `numerical/is_weight/*`, `staleness/ratio/*`,
`total/is_weight/*`, `<cause>/ess/{token,seq}`), applied here once to the whole step
batch (see `mismatch_metrics`).
Everything is computed in float64, where log r + log rho equals log w exactly for
fp32 inputs (differences of fp32 numbers are exact in float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tether.estimators.base import SAFETY_BOUND
from tether.estimators.metrics import ratio_metrics, to_floats
from tether.models.routing import is_moe
from tether.scoring import decode

CAUSES = ("numerical", "staleness", "total")


@dataclass(frozen=True)
class Decomposition:
    """The per-token log-ratios of one batch, float64, (B, T); 0 where mask is False."""

    log_rho: torch.Tensor  # numerical: logp_old - logp_rollout
    log_r: torch.Tensor | None  # staleness: logp - logp_old (None if logp is unknown)
    log_total: torch.Tensor | None  # total: logp - logp_rollout
    mask: torch.Tensor  # bool, valid tokens

    def by_cause(self) -> dict[str, torch.Tensor]:
        out = {"numerical": self.log_rho}
        if self.log_r is not None:
            out |= {"staleness": self.log_r, "total": self.log_total}
        return out


def decompose(
    logp_rollout: torch.Tensor,
    logp_old: torch.Tensor,
    logp: torch.Tensor | None,
    mask: torch.Tensor,
) -> Decomposition:
    """Split the total log-ratio into its numerical and staleness parts; inputs (B, T)."""
    keep = mask.bool()

    def diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d = a.detach().double() - b.detach().double()
        return torch.where(keep, d, torch.zeros_like(d))

    log_rho = diff(logp_old, logp_rollout)
    if logp is None:
        return Decomposition(log_rho, None, None, keep)
    return Decomposition(log_rho, diff(logp, logp_old), diff(logp, logp_rollout), keep)


def divergence_metrics(delta: torch.Tensor, mask: torch.Tensor, cause: str) -> dict[str, float]:
    """k1, k3, max |delta|, chi^2 (token, sequence) and perplexity ratio of one cause.

    `delta` (B, T) is log(target / sampler) per token; `mask` (B, T) bool. An empty
    mask gives zeros (nothing disagrees).
    """
    keep = mask.bool()
    d = torch.where(keep, delta.double(), 0.0)
    n = keep.sum().clamp(min=1)
    rows = keep.any(dim=-1)
    n_rows = rows.sum().clamp(min=1)
    dc = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k1 = (-d).sum() / n
    k3 = torch.where(keep, torch.expm1(dc) - dc, 0.0).sum() / n  # expm1: exact for tiny delta
    chi2_tok = torch.where(keep, torch.expm1(2 * dc), 0.0).sum() / n  # mean(w^2) - 1
    seq = d.sum(dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    chi2_seq = torch.where(rows, torch.expm1(2 * seq), 0.0).sum() / n_rows
    mean_t = d.sum(dim=-1) / keep.sum(dim=-1).clamp(min=1)
    ppl = torch.where(rows, torch.exp(-mean_t.clamp(-SAFETY_BOUND, SAFETY_BOUND)), 0.0).sum() / n_rows
    out = {
        f"{cause}/k1_kl/mean": k1,
        f"{cause}/k3_kl/mean": k3,
        f"{cause}/abs_log_ratio/max": d.abs().max() if keep.any() else d.new_zeros(()),
        f"{cause}/chi2/token": chi2_tok,
        f"{cause}/chi2/seq": chi2_seq,
        f"{cause}/ppl_ratio/mean": ppl if rows.any() else d.new_ones(()),
    }
    values = torch.stack([v.double().reshape(()) for v in out.values()]).tolist()
    return dict(zip(out, values, strict=True))


def mismatch_metrics(d: Decomposition) -> dict[str, float]:
    """All causes' metrics for one step (staleness and total only if logp is known).

    Adds the divergence metrics above, and the estimator's own weight statistics and ESS
    (`tether.estimators.metrics.ratio_metrics`) recomputed over the whole step batch: the
    trainer calls the estimator per micro-batch and averages, which is exact for means but
    not for max or ESS (one outlier weight sinks the ESS of the batch, not of the average),
    and a memory knob (`train.micro_batch`) must not change what is logged.
    """
    out: dict[str, float] = {}
    for cause, delta in d.by_cause().items():
        out |= divergence_metrics(delta, d.mask, cause)
    log_r = d.log_r if d.log_r is not None else torch.zeros_like(d.log_rho)
    ratios = to_floats(ratio_metrics(d.log_rho, log_r, d.mask))
    out |= {k: v for k, v in ratios.items() if k.split("/")[0] in d.by_cause()}
    return out


# -- MoE routing ---------------------------------------------------------------------------


@torch.no_grad()
def expert_sets(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                micro_batch: int = 64) -> torch.Tensor:
    """Each position's chosen experts (B, L, layers, k): the model's own top-k, no replay."""
    parts = [decode(model, input_ids[i:i + micro_batch], attention_mask[i:i + micro_batch],
                     record=True)[1] for i in range(0, input_ids.shape[0], micro_batch)]
    return torch.cat(parts)


def routing_disagreement(trainer_model: nn.Module, generator_model: nn.Module, batch,
                         micro_batch: int = 64) -> dict[str, float]:
    """Share of response tokens routed to another expert set by the generator's numerics,
    the generator model re-run on the batch (teacher-forced). Empty for dense models.

    Both models hold the same weights version; the trainer's runs fp32, the generator's
    its own numerics. `batch` is a `tether.trainer.RolloutTensors`.
    """
    if not (is_moe(trainer_model) and is_moe(generator_model)):
        return {}
    a = expert_sets(trainer_model, batch.input_ids, batch.attention_mask, micro_batch)
    b = expert_sets(generator_model, batch.input_ids, batch.attention_mask, micro_batch)
    return compare_routes(a, b, batch)


def compare_routes(trainer_routes: torch.Tensor, generator_routes: torch.Tensor,
                   batch) -> dict[str, float]:
    """`numerical/routing_disagreement/*` of two routings (B, P+T, layers, k) of a batch.

    Counted at the positions that predict the response tokens (where `logp` is read), on
    valid tokens, comparing expert *sets* (order within the top-k does not matter):
    `mean` over (token, layer) pairs, `any_layer` the share of tokens with a different
    set in at least one layer.
    """
    P, T = batch.prompt_len, batch.response_ids.shape[1]
    a, b = (r.long().sort(dim=-1).values[:, P - 1:P + T - 1]
            for r in (trainer_routes, generator_routes))
    differs = (a != b).any(dim=-1)  # (B, T, layers)
    keep = batch.response_mask.bool()[..., None]
    n = keep.sum().clamp(min=1)
    per_pair = (differs & keep).sum() / (n * differs.shape[-1])
    any_layer = (differs.any(dim=-1, keepdim=True) & keep).sum() / n
    return {"numerical/routing_disagreement/mean": float(per_pair),
            "numerical/routing_disagreement/any_layer": float(any_layer)}
