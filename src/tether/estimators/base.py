"""The data every estimator shares: the token batch, the loss output, aggregation.

Vocabulary (DESIGN.md section 1), per sampled token y_t at prefix h_t:
    logp_rollout = log mu(y_t | h_t)        the generator, at sampling time
    logp_old     = log pi_old(y_t | h_t)    the trainer at the generator's weights
    logp         = log pi_theta(y_t | h_t)  the trainer now, with grad
    numerical mismatch  log rho = logp_old - logp_rollout
    policy staleness    log r   = logp - logp_old
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tether.lazy import torch

# Log-ratios are clamped to +-SAFETY_BOUND before exp(): e^20 ~ 4.9e8 keeps squares and
# sums finite in fp32 while being far beyond any cap an estimator applies.
SAFETY_BOUND = 20.0

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class TokenBatch:
    """One training batch as the estimators see it; shapes (B, T) unless said.

    Positions with mask == 0 may hold any value (padding, even NaN): every estimator
    replaces them before use. Validation is on shapes only; checking values for NaN is
    the training loop's job.
    """

    logp: torch.Tensor  # (B, T) log pi_theta(y_t), with grad
    logp_old: torch.Tensor  # (B, T) log pi_old(y_t), trainer at the generator's weights
    logp_rollout: torch.Tensor  # (B, T) log mu(y_t), recorded by the generator
    advantages: torch.Tensor  # (B, T), or (B,) broadcast over the sequence
    mask: torch.Tensor  # (B, T) 1 for response tokens that enter the loss
    logp_prox: torch.Tensor | None = None  # (B, T) trainer at the step's start weights
    topk_ids: torch.Tensor | None = None  # (B, T, K) the generator's top-K ids
    topk_logp_rollout: torch.Tensor | None = None  # (B, T, K) log mu at those ids
    topk_logp: torch.Tensor | None = None  # (B, T, K) log pi_theta at those ids, with grad
    topk_logp_old: torch.Tensor | None = None  # (B, T, K) log pi_old at those ids

    def __post_init__(self) -> None:
        for name in ("logp", "logp_old", "logp_rollout", "advantages", "mask"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"TokenBatch.{name} must be a torch.Tensor")
        if self.logp.dim() != 2 or self.logp.numel() == 0:
            raise ValueError(
                f"TokenBatch.logp must be a non-empty (B, T) tensor, got shape "
                f"{tuple(self.logp.shape)}"
            )
        shape = self.logp.shape
        for name in ("logp_old", "logp_rollout", "mask", "logp_prox"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(
                    f"TokenBatch.{name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(shape)} like logp"
                )
        if self.advantages.shape not in (shape, shape[:1]):
            raise ValueError(
                f"TokenBatch.advantages has shape {tuple(self.advantages.shape)}, expected "
                f"{tuple(shape)} or ({shape[0]},)"
            )
        topk = {
            name: getattr(self, name)
            for name in ("topk_ids", "topk_logp_rollout", "topk_logp", "topk_logp_old")
        }
        given = [name for name, value in topk.items() if value is not None]
        if given and len(given) != len(topk):
            missing = [name for name in topk if name not in given]
            raise ValueError(
                f"TokenBatch has {', '.join(given)} but not {', '.join(missing)}: "
                "centering needs all four top-K tensors"
            )
        if given:
            k_shape = topk["topk_ids"].shape
            if k_shape[:2] != shape or len(k_shape) != 3 or k_shape[2] == 0:
                raise ValueError(
                    f"TokenBatch.topk_ids has shape {tuple(k_shape)}, expected "
                    f"({shape[0]}, {shape[1]}, K) with K >= 1"
                )
            for name, value in topk.items():
                if value.shape != k_shape:
                    raise ValueError(
                        f"TokenBatch.{name} has shape {tuple(value.shape)}, expected "
                        f"{tuple(k_shape)} like topk_ids"
                    )

    @property
    def has_topk(self) -> bool:
        return self.topk_ids is not None


@dataclass
class LossOutput:
    """What an estimator returns."""

    loss: torch.Tensor  # () scalar, differentiable
    weights: torch.Tensor  # (B, T) detached coefficient c with d loss_t / d logp_t = -c A
    metrics: dict[str, float] = field(default_factory=dict)  # `cause/metric/stat` -> value


@dataclass
class ObjectiveTerms:
    """An objective's per-token result (staleness side)."""

    loss: torch.Tensor  # (B, T) l_obj, with grad
    coef: torch.Tensor  # (B, T) detached: d l_obj / d logp = -coef * A
    clipped: torch.Tensor  # (B, T) bool: tokens whose gradient the objective cut
    # (B, T) detached, objectives that weigh by pi/mu themselves (decoupled): that weight,
    # which the `correction/weight/*` metrics then report in place of the correction's.
    mismatch_weight: torch.Tensor | None = None


@dataclass
class CorrectionTerms:
    """A mismatch correction's per-token weight (numerical side), detached."""

    weight: torch.Tensor  # (B, T) w_mm
    truncated: torch.Tensor  # (B, T) bool: weight lowered by a cap
    masked: torch.Tensor  # (B, T) bool: weight set to 0 by a band test


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """Clamp a log-ratio to +-SAFETY_BOUND so that exp() stays finite."""
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean") -> torch.Tensor:
    """Reduce per-token losses (B, T) to a scalar over valid tokens.

    token-mean: sum_{i,t} m x / sum m.  seq-mean-token-mean: mean over non-empty rows of
    the row's token mean.  seq-mean-token-sum: mean over non-empty rows of the row's sum.
    All-masked rows count nowhere, so adding one changes nothing.
    """
    maskf = mask.to(values.dtype)
    x = values * maskf
    if agg == "token-mean":
        return x.sum() / maskf.sum().clamp(min=1.0)
    n_row = maskf.sum(dim=-1)  # (B,)
    row = x.sum(dim=-1)
    if agg == "seq-mean-token-mean":
        row = row / n_row.clamp(min=1.0)
    elif agg != "seq-mean-token-sum":
        raise ValueError(f"unknown agg {agg!r}; valid: {', '.join(AGGREGATIONS)}")
    return row.sum() / (n_row > 0).sum().clamp(min=1).to(values.dtype)
