"""The staleness gate: what an ESS sync policy (`sync.policy=ess:TAU`) does to a batch.

Both loops put every batch through it, around its training step:

    before(batch, logp_old, trainer)  -> regenerate?
    after(logp_trained, trainer)      -> tripped?

The ESS of r = pi_theta / pi_old is taken at the weights the batch's training starts
from. `sync.on_trip=regenerate` must decide before training, so `before` scores the batch
at the trainer's current weights (one no-grad forward) and answers True when the batch
is to be dropped and its prompts sampled again from re-synced weights. `on_trip=train`
trains on it (the estimator caps its weights) and `after` reads the ESS off the training
forward's first mini-batch, at no extra compute; True means re-sync now. A batch whose
every token was sampled at the trainer's version has r = 1 and ESS 1, with no forward.
Other policies measure nothing and never trip. The loop then delivers the weights
(tether.weights.Synchronizer, or the async loop's Scheduler) and logs `metrics()`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from tether.advice import ESS_TAU
from tether.weights.policy import (
    ON_TRIP,
    EssTrigger,
    Switched,
    SyncPolicy,
    parse_sync_policy,
    staleness_ess,
    trained_ess,
)


class Scorer(Protocol):
    """The trainer, as the gate uses it: its weight version, and no-grad log-probs."""

    version: int

    def score_now(self, batch: Any) -> torch.Tensor: ...


class StalenessGate:
    """One per run: `before` and `after` each batch, `metrics` for its row."""

    @classmethod
    def of(cls, cfg: Any) -> StalenessGate:
        """The gate of `sync.policy` (resolved for `train.estimator`) and `sync.on_trip`;
        under train.correction=auto, that policy or DLC's ESS re-sync, as auto chooses."""
        policy = parse_sync_policy(cfg.sync.policy, cfg.train.estimator)
        if cfg.train.correction == "auto":
            policy = Switched(policy, EssTrigger(ESS_TAU))
        return cls(policy, cfg.sync.on_trip, cfg.train.minibatches)

    def __init__(self, policy: SyncPolicy, on_trip: str = "train", minibatches: int = 1):
        if on_trip not in ON_TRIP:
            raise ValueError(f"sync.on_trip={on_trip!r}; valid: {', '.join(ON_TRIP)}")
        self.policy, self.on_trip = policy, on_trip
        self.minibatches = minibatches  # train.minibatches: the first one is trained unchanged
        self._pending: tuple[Any, torch.Tensor | None, bool] | None = None
        self._metrics: dict[str, float] = {}

    def before(self, batch: Any, logp_old: torch.Tensor | None, trainer: Scorer) -> bool:
        """Before training on `batch`: True = drop it and sample its prompts again.
        `logp_old` may be None only for a fresh batch (read off the training forward)."""
        self._pending, self._metrics = None, {}
        if not self.policy.measures_ess:
            return False
        fresh = batch.sampled_at(trainer.version)
        if self.on_trip == "train":
            self._pending = (batch, logp_old, fresh)
            return False
        ess = 1.0 if fresh else staleness_ess(_score_now(trainer, batch), logp_old,
                                              batch.response_mask)
        tripped = self._record(ess)
        self._metrics["sync/regenerated"] = float(tripped)
        return tripped

    def after(self, logp_trained: torch.Tensor | None, trainer: Scorer) -> bool:
        """After the training step: True = the batch tripped the policy, re-sync now
        (`on_trip=train`; `logp_trained` None, a step cut short: the trainer scores it)."""
        if self._pending is None:
            return False
        batch, logp_old, fresh = self._pending
        self._pending = None
        ess = 1.0 if fresh else trained_ess(logp_trained, logp_old, batch.response_mask,
                                            self.minibatches, lambda: _score_now(trainer, batch))
        return self._record(ess)

    def metrics(self) -> dict[str, float]:
        """`sync/ess/token`, `sync/tripped` (and `sync/regenerated`) of the last batch gated."""
        return dict(self._metrics)

    def _record(self, ess: float) -> bool:
        tripped = self.policy.trips(ess)
        self._metrics |= {"sync/ess/token": ess, "sync/tripped": float(tripped)}
        return tripped


def _score_now(trainer: Scorer, batch: Any) -> torch.Tensor:
    """(B, T) log-probs of the batch's tokens at the trainer's current weights."""
    return trainer.score_now(batch)
