"""The `Trainer`: the trained model, its optimizer, and the loss and optimizer step(s) on a batch.

It scores tokens with tether.scoring (`logp` with grad at the current weights;
`score_old` without grad at whatever weights the caller hands it, e.g. a kept snapshot),
gets the loss from the estimator the config names (tether.estimators), and meets the
other data-parallel ranks only through the `Collective` it is handed (`attach`;
tether.distributed builds one, `Solo` with one process).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import PreTrainedModel

from tether.config import TrainConfig
from tether.estimators import LossOutput, TokenBatch, build_estimator
from tether.guards import StepGuard, first_nonfinite
from tether.rollout.types import SamplingParams
from tether.scoring import RolloutTensors, TokenScorer, token_logprobs
from tether.trainer.collective import Collective, Solo
from tether.trainer.sharding import full_value, is_sharded, resharded


class Trainer(TokenScorer):
    """Holds the trained model and its optimizer; counts weight versions (one per step).
    Scores tokens as `TokenScorer` (`score`, `score_old`)."""

    def __init__(self, model: PreTrainedModel, cfg: TrainConfig, sampling: SamplingParams):
        super().__init__(cfg, sampling)
        self.model = model
        self.estimator = build_estimator(cfg.estimator, **cfg.estimator_params)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.version = 0
        self.guard = StepGuard(cfg.max_bad_steps)
        self.collective: Collective = Solo()
        # Sharded (train.sharding=fsdp), every forward and backward gathers or reduces over
        # the ranks: each rank runs all of them, even after a bad micro-batch, and FSDP
        # reduce-scatters the gradients (a sum) in each micro-batch's backward.
        self.lockstep = is_sharded(model)

    def attach(self, collective: Collective) -> None:
        """Train as one rank of `collective` (tether.distributed) from now on."""
        self.collective = collective

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs: weights, optimizer moments, weight version, guard counters."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.counters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_counters(state)

    def counters(self) -> dict[str, Any]:
        """The state besides weights and moments: what a sharded checkpoint keeps in its
        JSON (the weights and moments go to each rank's shards, tether.trainer.spmd)."""
        return {"version": self.version, "guard": self.guard.state_dict()}

    def load_counters(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.guard.load_state_dict(state["guard"])

    def use(self, spec: tuple[str, str, bool, dict[str, Any]]) -> None:
        """Train with the estimator of `spec` (`Estimator.spec`) from now on: the one rank 0
        trains with (train.correction=auto changes it during a run)."""
        if spec != self.estimator.spec:
            objective, correction, centering, params = spec
            self.estimator = build_estimator(objective=objective, correction=correction,
                                             centering=centering, **params)

    def score_now(self, batch: RolloutTensors) -> torch.Tensor:
        """(B, T) no-grad log-probs of the batch's tokens at the current weights; sharded, a
        forward on every rank together (rank 0 asks, tether.distributed)."""
        if self.lockstep and self.collective.rank == 0:
            return self.collective.call(score_now_on_rank, batch)
        return self.score_old(batch, self.model)[0]

    def train_on(
        self,
        batch: RolloutTensors,
        advantages: torch.Tensor,
        logp_old: torch.Tensor | None,
        topk_logp_old: torch.Tensor | None,
    ) -> tuple[list[dict[str, float]], torch.Tensor | None]:
        """`train.minibatches` optimizer steps on disjoint slices of the batch.

        Returns the metrics of each optimizer step and the (B, T) logp as each token's loss
        saw it (mini-batch i after i steps), for diagnostics and the ESS trigger; None when
        a step was skipped (tether.guards) or stopped before scoring every row. `logp_old`
        None (one mini-batch, a batch sampled at the current weights): pi_old is the
        training forward's logp, detached.

        An estimator that reads pi_prox (decoupled PPO) gets it scored here, without grad,
        at the weights before the first of these steps, for every mini-batch (as AReaL
        recomputes it once per training step). A batch whose every token was sampled at
        this version needs no forward: pi_prox is then pi_old (same weights, same numerics).
        """
        if logp_old is None and self.cfg.minibatches != 1:
            raise ValueError("logp_old=None needs train.minibatches=1: later mini-batches "
                             "train after the weights moved")
        self.collective.begin(self.estimator.spec, batch, advantages, logp_old, topk_logp_old)
        B = batch.input_ids.shape[0]
        mb = B // self.cfg.minibatches
        idxs = [self.collective.rows(start, mb) for start in range(0, B, mb)]  # this rank's
        score_prox = self.estimator.needs_prox and not batch.sampled_at(self.version)
        logp_prox = [self.score(batch.select(i), self.model).logp if score_prox else None
                     for i in idxs]
        out: list[dict[str, float]] = []
        parts: list[torch.Tensor] = []
        version = self.version
        for idx, prox_i in zip(idxs, logp_prox, strict=True):
            try:
                out.append(self._step(batch.select(idx), advantages[idx],
                                      None if logp_old is None else logp_old[idx],
                                      None if topk_logp_old is None else topk_logp_old[idx],
                                      parts, prox_i))
            except RuntimeError as e:  # a collective failed: a rank is likely gone
                self.collective.failed(e, intact=self.version == version)
        out[-1].update(self.guard.counters())  # running counts: once, not averaged
        logp = torch.cat(parts) if sum(p.shape[0] for p in parts) == B else None
        return out, logp

    def _step(
        self,
        batch: RolloutTensors,
        advantages: torch.Tensor,
        logp_old: torch.Tensor | None,
        topk_logp_old: torch.Tensor | None,
        logp_parts: list[torch.Tensor],
        logp_prox: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch (this rank's shard of it, data-parallel);
        `logp_prox` None: the estimator takes pi_old for pi_prox."""
        reuse = logp_old is None  # pi_old from this forward (see train_on)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        B = batch.input_ids.shape[0]
        # Micro-batch losses are re-weighted so their sum equals the loss on the whole
        # mini-batch; data-parallel, the denominators count every rank's rows and tokens.
        token_mean = self.estimator.params["agg"] == "token-mean"
        n_tokens = batch.response_mask.sum()
        n_tokens, B = self.collective.sum(n_tokens), B * self.collective.world_size
        n_tokens = n_tokens.clamp(min=1)
        total = n_tokens if token_mean else B
        sums: dict[str, float] = {}
        loss_sum, bad = 0.0, None
        local: list[torch.Tensor] = []
        for i in range(0, batch.input_ids.shape[0], self.cfg.micro_batch):
            sl = slice(i, i + self.cfg.micro_batch)
            micro = batch.select(sl)
            logp, topk_logp = token_logprobs(self.model, micro, self.sampling, self.cfg.precision)
            local.append(logp.detach())
            old = logp.detach() if reuse else logp_old[sl]
            topk_old = (None if topk_logp is None else topk_logp.detach()) if reuse else \
                (None if topk_logp_old is None else topk_logp_old[sl])
            # Guard: a non-finite input or log-prob would poison the weights; one host sync.
            prox = None if logp_prox is None else logp_prox[sl]
            checked = {"logp_prox": prox, "logp_rollout": micro.logp_rollout,
                       "advantages": advantages[sl], "logp": logp, "topk_logp": topk_logp}
            if not reuse:  # reused, pi_old is logp itself
                checked = {"logp_old": old, **checked}
            found = first_nonfinite(checked, micro.response_mask)
            if found is not None:
                bad = bad or found
                if not self.lockstep:
                    break
            out: LossOutput = self.estimator(
                TokenBatch(
                    logp=logp,
                    logp_old=old,
                    logp_rollout=micro.logp_rollout,
                    advantages=advantages[sl],
                    mask=micro.response_mask,
                    logp_prox=prox,
                    topk_ids=micro.topk_ids,
                    topk_logp_rollout=micro.topk_logp_rollout,
                    topk_logp=topk_logp,
                    topk_logp_old=topk_old,
                )
            )
            share = (micro.response_mask.sum() if token_mean else micro.input_ids.shape[0]) / total
            loss = out.metrics["loss/total"]  # out.loss as a float, read in to_floats' one sync
            if not math.isfinite(loss):
                bad = bad or "loss"
                if not self.lockstep:
                    break
            (out.loss * share).backward()  # lockstep and bad: its gradient is dropped below
            share_f = float(share)  # one sync each for the two shares
            loss_sum += loss * share_f
            # Token statistics fold by token share; the losses by the aggregation's share.
            tok_share = float(micro.response_mask.sum() / n_tokens)
            for k, v in out.metrics.items():
                sums[k] = combine(k, sums.get(k), float(v),
                                  share_f if k.startswith("loss/") else tok_share)
        bad, loss_sum, sums = self._reduce(bad, loss_sum, sums, local, logp_parts)
        grad_norm = full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                              self.cfg.grad_clip))
        if bad is None and not torch.isfinite(grad_norm):
            bad = "grad_norm"
        guard = self.guard.record(bad)  # guard/skipped, and guard/bad/<tensor> when skipped
        if bad is not None:
            # A non-finite value would poison the weights: skip this optimizer step.
            self.optimizer.zero_grad(set_to_none=True)
            return guard
        self.optimizer.step()
        self.version += 1
        return {**sums, "loss/total": loss_sum, "train/grad_norm": float(grad_norm), **guard}

    def _reduce(self, bad: str | None, loss_sum: float, sums: dict[str, float],
                local: list[torch.Tensor], logp_parts: list[torch.Tensor],
                ) -> tuple[str | None, float, dict[str, float]]:
        """Across ranks (identities with one process): agree on skipping (any rank's
        non-finite value skips the step on all), sum the gradients, and fold the ranks'
        partial metric sums (peaks by max) and log-probs (the mini-batch's rows, in order)
        into the whole mini-batch's."""
        shard = self.collective
        verdicts = shard.gather((bad, loss_sum, sums))
        bad = next((v[0] for v in verdicts if v[0] is not None), None)
        if bad is not None:
            return bad, loss_sum, sums
        if not self.lockstep:  # sharded, FSDP summed them in each backward
            shard.sum_grads([p for p in self.model.parameters() if p.requires_grad])
        logp_parts.append(shard.gather_rows(torch.cat(local)))
        merged: dict[str, float] = {}
        for _, _, rank_sums in verdicts:
            for k, v in rank_sums.items():
                merged[k] = max(merged[k], v) if k.endswith("/max") and k in merged else \
                    merged.get(k, 0.0) + v
        return None, sum(v[1] for v in verdicts), merged


def score_now_on_rank(ctx: Any, batch: RolloutTensors) -> torch.Tensor:
    """`Trainer.score_now` on one rank of a sharded trainer (`ctx`: its RankContext)."""
    trainer = ctx.trainer
    try:
        return trainer.score_old(batch, trainer.model)[0]
    finally:
        resharded(trainer.model)


def combine(key: str, acc: float | None, value: float, share: float) -> float:
    """Fold one micro-batch's metric into the slice's: peaks (`*/max`) by max, the rest
    weighted by the micro-batch's share of the slice (exact for means and second moments;
    ESS keys are approximate, and the loop's diagnostics log whole-batch ESS)."""
    if key.endswith("/max"):
        return value if acc is None else max(acc, value)
    return (acc or 0.0) + value * share


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Fold the mini-batch steps' metrics into one row with `combine`, each step an equal share
    (keys missing in some rows average the rest)."""
    out: dict[str, float] = {}
    for k in {k for r in rows for k in r}:
        values = [r[k] for r in rows if k in r]
        for v in values:
            out[k] = combine(k, out.get(k), v, 1.0 / len(values))
    return out
