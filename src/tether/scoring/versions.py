"""pi_old of a batch whose tokens may come from several weight versions.

A rollout batch is usually sampled at one version; under partial rollouts one response
spans several, and every token records its own (`RolloutTensors.token_versions`). This
scores each token at the version that sampled it. Where the weights of a version come
from (the trainer's own, a kept snapshot, a rollout worker's published copy) is the
caller's `model_at`; which source of pi_old a step uses is tether.step's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from tether.scoring.batch import RolloutTensors
from tether.scoring.logprobs import TokenScorer

ModelAt = Callable[[int], nn.Module]  # weight version -> a model holding it


def score_at_versions(scorer: TokenScorer, batch: RolloutTensors, model_at: ModelAt,
                      ) -> tuple[torch.Tensor, torch.Tensor | None, RolloutTensors]:
    """`logp_old` (B, T) and top-K (B, T, K): each token at the version that sampled it; and
    the batch the training forwards are to score.

    One no-grad forward per distinct version, over the rows holding a token of it (a row
    of one version is scored once; a partial rollout's row once per version it spans).
    The usual batch, sampled at one version, is one forward over the whole batch.
    Routing replay R2 (`train.routing_replay=r2`): the returned batch carries the experts
    these forwards chose (`routed_experts`), which the `logp` forwards then replay; a
    partial rollout's position takes them from the version of the token it predicts.
    Otherwise the batch is returned as it came (under R3 it carries the generator's).
    `scorer`: the `Trainer`, or a rollout worker's `TokenScorer` (`loop.score_old=worker`):
    both score here, so a worker's pi_old is the trainer's bit for bit at equal threads.
    """
    r2 = scorer.cfg.routing_replay == "r2"
    valid = batch.response_mask.bool()
    distinct = batch.token_versions[valid].unique().tolist() or [int(batch.versions[0])]
    if len(distinct) == 1:
        s = scorer.score(batch, model_at(int(distinct[0])), record=r2)
        return s.logp, s.topk, replace(batch, routed_experts=s.experts) if r2 else batch
    logp = torch.zeros_like(batch.logp_rollout)
    topk = None if batch.topk_ids is None else batch.topk_logp_rollout.new_zeros(batch.topk_ids.shape)
    experts = None
    P, T = batch.prompt_len, batch.response_ids.shape[1]
    for v in distinct:
        at_v = (batch.token_versions == v) & valid  # (B, T)
        rows = at_v.any(dim=1).nonzero().squeeze(1)
        s = scorer.score(batch.select(rows), model_at(int(v)), record=r2)
        sel = at_v[rows]
        logp[rows] = torch.where(sel, s.logp, logp[rows])
        if topk is not None:
            topk[rows] = torch.where(sel[..., None], s.topk, topk[rows])
        if s.experts is not None:
            if experts is None:
                experts = s.experts.new_zeros((batch.input_ids.shape[0], *s.experts.shape[1:]))
                fresh = valid.new_ones(batch.input_ids.shape[0])
            first = fresh[rows]  # a row's prompt keeps the routing of its oldest version
            experts[rows[first]] = s.experts[first]
            fresh[rows] = False
            at = sel.new_zeros(sel.shape[0], P + T)
            at[:, P - 1:P + T - 1] = sel  # the positions that predict version v's tokens
            experts[rows] = torch.where(at[..., None, None], s.experts, experts[rows])
    return logp, topk, replace(batch, routed_experts=experts) if r2 else batch
