"""The trainer side: collate rollouts, score log-probs, group advantages, optimizer steps.

The trainer scores every sampled token twice: `logp_old` without grad at the weights of
the batch's version (a kept snapshot), and `logp` with grad at the current weights.
Both use the same processed distribution as the generator (`process_logits`), so with
equal weights and numerics all three log-probs agree.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import PreTrainedModel

from tether.config import TrainConfig
from tether.distributed import Shard, TrainerRanks
from tether.estimators import LossOutput, TokenBatch, build_estimator
from tether.guards import StepGuard, first_nonfinite
from tether.rollout.hf import process_logits
from tether.rollout.types import Rollout, SamplingParams

LOGP_FLOOR = -1e4  # a token outside the trainer's top-k/top-p set has logp -inf; keep it finite


@dataclass
class RolloutTensors:
    """A batch of rollouts as tensors. Prompts are left-padded to P, responses right-padded to T."""

    input_ids: torch.Tensor  # (B, P+T) prompt then response
    attention_mask: torch.Tensor  # (B, P+T)
    response_ids: torch.Tensor  # (B, T) exactly as sampled
    response_mask: torch.Tensor  # (B, T) 1 on sampled tokens
    logp_rollout: torch.Tensor  # (B, T)
    rewards: torch.Tensor  # (B,)
    group_ids: torch.Tensor  # (B,)
    token_versions: torch.Tensor  # (B, T) version that sampled each token (partial rollouts: several)
    topk_ids: torch.Tensor | None = None  # (B, T, K)
    topk_logp_rollout: torch.Tensor | None = None  # (B, T, K)

    @property
    def versions(self) -> torch.Tensor:
        """(B,) the version that sampled each row's first token (padding keeps the row's)."""
        return self.token_versions[:, 0]

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.response_ids.shape[1]

    def select(self, idx: torch.Tensor | slice) -> RolloutTensors:
        return RolloutTensors(
            **{f.name: (None if (v := getattr(self, f.name)) is None else v[idx]) for f in fields(self)}
        )


def collate(rollouts: list[Rollout], pad_id: int) -> RolloutTensors:
    """Rollouts -> tensors, token ids untouched (a sampled pad or a mid-group eos stays as is)."""
    B = len(rollouts)
    if B == 0:
        raise ValueError("collate: empty list of rollouts")
    P = max(len(r.prompt_ids) for r in rollouts)
    T = max(len(r.response_ids) for r in rollouts)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    resp_mask = torch.zeros((B, T))
    logp_rollout = torch.zeros((B, T))
    K = len(rollouts[0].topk_ids[0]) if rollouts[0].topk_ids else 0
    topk_ids = torch.zeros((B, T, K), dtype=torch.long) if K else None
    topk_lp = torch.zeros((B, T, K)) if K else None
    token_versions = torch.tensor([r.version for r in rollouts])[:, None].repeat(1, T)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        input_ids[i, P - p:P] = torch.tensor(r.prompt_ids)
        input_ids[i, P:P + n] = torch.tensor(r.response_ids, dtype=torch.long)
        attn[i, P - p:P + n] = 1
        resp_mask[i, :n] = 1
        logp_rollout[i, :n] = torch.tensor(r.logp_rollout)
        if r.token_versions is not None:
            token_versions[i, :n] = torch.tensor(r.token_versions)
        if K:
            topk_ids[i, :n] = torch.tensor(r.topk_ids)
            topk_lp[i, :n] = torch.tensor(r.topk_logp)
    return RolloutTensors(
        input_ids=input_ids,
        attention_mask=attn,
        response_ids=input_ids[:, P:].clone(),
        response_mask=resp_mask,
        logp_rollout=logp_rollout,
        rewards=torch.tensor([float(r.reward or 0.0) for r in rollouts]),
        group_ids=torch.tensor([r.group_id for r in rollouts]),
        token_versions=token_versions,
        topk_ids=topk_ids,
        topk_logp_rollout=topk_lp,
    )


def token_logprobs(
    model: PreTrainedModel, batch: RolloutTensors, sampling: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the sampled tokens (B, T) and of the top-K ids (B, T, K) under `model`.

    Differentiable when called with grad enabled. Padding positions hold 0.
    """
    P, T = batch.prompt_len, batch.response_ids.shape[1]
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids
    ).logits[:, P - 1:P + T - 1]  # (B, T, V): position P+t-1 predicts response token t
    logp_all = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    logp_all = logp_all.clamp(min=LOGP_FLOOR)
    logp = logp_all.gather(-1, batch.response_ids[..., None]).squeeze(-1) * batch.response_mask
    topk = None
    if batch.topk_ids is not None:
        topk = logp_all.gather(-1, batch.topk_ids) * batch.response_mask[..., None]
    return logp, topk


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's std if `std_norm`."""
    adv = torch.zeros_like(rewards)
    for g in group_ids.unique():
        sel = group_ids == g
        r = rewards[sel]
        centred = r - r.mean()
        adv[sel] = centred / (r.std(unbiased=False) + 1e-6) if std_norm else centred
    return adv


class Trainer:
    """Holds the trained model and its optimizer; counts weight versions (one per step)."""

    def __init__(self, model: PreTrainedModel, cfg: TrainConfig, sampling: SamplingParams):
        self.model = model
        self.cfg = cfg
        self.sampling = sampling
        self.estimator = build_estimator(cfg.estimator, **cfg.estimator_params)
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        self.version = 0
        self.guard = StepGuard(cfg.max_bad_steps)
        # Data parallel (tether.distributed): this rank's shard and collectives; on rank 0,
        # the other ranks, which get each batch from `train_on`. None with one process.
        self.shard: Shard | None = None
        self.ranks: TrainerRanks | None = None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs: weights, optimizer moments, weight version, guard counters."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "version": self.version, "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.guard.load_state_dict(state["guard"])

    @torch.no_grad()
    def score_old(
        self, batch: RolloutTensors, model: PreTrainedModel
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`logp_old` (and top-K) at the batch's weights, micro-batched, without grad."""
        model.eval()
        parts = [
            token_logprobs(model, batch.select(slice(i, i + self.cfg.micro_batch)), self.sampling)
            for i in range(0, batch.input_ids.shape[0], self.cfg.micro_batch)
        ]
        logp = torch.cat([p[0] for p in parts])
        topk = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
        return logp, topk

    def train_on(
        self,
        batch: RolloutTensors,
        advantages: torch.Tensor,
        logp_old: torch.Tensor,
        topk_logp_old: torch.Tensor | None,
    ) -> tuple[list[dict[str, float]], torch.Tensor | None]:
        """`train.minibatches` optimizer steps on disjoint slices of the batch.

        Returns the metrics of each optimizer step and the (B, T) logp as each token's loss
        saw it (mini-batch i after i steps), for diagnostics and the ESS trigger; None when
        a step stopped before scoring every row.
        """
        if self.ranks is not None:  # rank 0: the other ranks train on the same batch
            self.ranks.dispatch(batch, advantages, logp_old, topk_logp_old)
        B = batch.input_ids.shape[0]
        mb = B // self.cfg.minibatches
        out: list[dict[str, float]] = []
        parts: list[torch.Tensor] = []
        version = self.version
        for start in range(0, B, mb):
            # This rank's rows of the mini-batch (all of them with one process).
            idx = slice(start, start + mb) if self.shard is None else self.shard.rows(start, mb)
            try:
                out.append(self._step(batch.select(idx), advantages[idx], logp_old[idx],
                                      None if topk_logp_old is None else topk_logp_old[idx],
                                      parts))
            except RuntimeError as e:  # rank 0: a collective failed, a rank is likely gone
                if self.ranks is None:
                    raise
                self.ranks.check(intact=self.version == version, cause=e)
        out[-1].update(self.guard.counters())  # running counts: once, not averaged
        logp = torch.cat(parts) if sum(p.shape[0] for p in parts) == B else None
        return out, logp

    def _step(
        self,
        batch: RolloutTensors,
        advantages: torch.Tensor,
        logp_old: torch.Tensor,
        topk_logp_old: torch.Tensor | None,
        logp_parts: list[torch.Tensor],
    ) -> dict[str, float]:
        """One optimizer step on a mini-batch (this rank's shard of it, data-parallel)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        B = batch.input_ids.shape[0]
        # Micro-batch losses are re-weighted so their sum equals the loss on the whole
        # mini-batch; data-parallel, the denominators count every rank's rows and tokens.
        token_mean = self.estimator.params["agg"] == "token-mean"
        n_tokens = batch.response_mask.sum()
        if self.shard is not None:
            n_tokens, B = self.shard.sum(n_tokens), B * self.shard.world_size
        n_tokens = n_tokens.clamp(min=1)
        total = n_tokens if token_mean else B
        sums: dict[str, float] = {}
        loss_sum, bad = 0.0, None
        local: list[torch.Tensor] = []
        for i in range(0, batch.input_ids.shape[0], self.cfg.micro_batch):
            sl = slice(i, i + self.cfg.micro_batch)
            micro = batch.select(sl)
            logp, topk_logp = token_logprobs(self.model, micro, self.sampling)
            local.append(logp.detach())
            # Guard: a non-finite input or log-prob would poison the weights; one host sync.
            bad = first_nonfinite({"logp_old": logp_old[sl], "logp_rollout": micro.logp_rollout,
                                   "advantages": advantages[sl], "logp": logp, "topk_logp": topk_logp},
                                  micro.response_mask)
            if bad is not None:
                break
            out: LossOutput = self.estimator(
                TokenBatch(
                    logp=logp,
                    logp_old=logp_old[sl],
                    logp_rollout=micro.logp_rollout,
                    advantages=advantages[sl],
                    mask=micro.response_mask,
                    topk_ids=micro.topk_ids,
                    topk_logp_rollout=micro.topk_logp_rollout,
                    topk_logp=topk_logp,
                    topk_logp_old=None if topk_logp_old is None else topk_logp_old[sl],
                )
            )
            share = (micro.response_mask.sum() if token_mean else micro.input_ids.shape[0]) / total
            if not torch.isfinite(out.loss):
                bad = "loss"
                break
            (out.loss * share).backward()
            loss_sum += out.loss.item() * float(share)
            # Token statistics fold by token share; the losses by the aggregation's share.
            tok_share = float(micro.response_mask.sum() / n_tokens)
            for k, v in out.metrics.items():
                sums[k] = combine(k, sums.get(k), float(v),
                                  float(share) if k.startswith("loss/") else tok_share)
        if self.shard is not None:  # every rank's verdict, rows and partial sums
            bad, loss_sum, sums = self._reduce(bad, loss_sum, sums, local, logp_parts)
        else:
            logp_parts += local
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
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
        """Data parallel: agree on skipping (any rank's non-finite value skips the step on
        all), sum the gradients, and fold the ranks' partial metric sums (peaks by max) and
        log-probs (the mini-batch's rows, in order) into the whole mini-batch's."""
        shard = self.shard
        verdicts = shard.gather((bad, loss_sum, sums))
        bad = next((v[0] for v in verdicts if v[0] is not None), None)
        if bad is not None:
            return bad, loss_sum, sums
        shard.sum_grads([p for p in self.model.parameters() if p.requires_grad])
        logp_parts.append(shard.gather_rows(torch.cat(local)))
        merged: dict[str, float] = {}
        for _, _, rank_sums in verdicts:
            for k, v in rank_sums.items():
                merged[k] = max(merged[k], v) if k.endswith("/max") and k in merged else \
                    merged.get(k, 0.0) + v
        return None, sum(v[1] for v in verdicts), merged


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
