"""The trainer side: collate rollouts, score log-probs, group advantages, optimizer steps.

The trainer scores every sampled token twice: `logp_old` without grad at the weights of
the batch's version (a kept snapshot), and `logp` with grad at the current weights.
Both use the same processed distribution as the generator (`process_logits`), so with
equal weights and numerics all three log-probs agree. Every trainer forward goes through
`decode` (and `score_tokens` on top of it), which replays the batch's MoE routing when
it carries one (`RolloutTensors.routed_experts`: R3, the generator's; R2, the `logp_old`
forward's; tether.models.routing). `train.precision=bf16` runs all of them under bf16
autocast (`autocast`), the fp32 master weights untouched.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel

from tether.config import TrainConfig
from tether.distributed import Shard, TrainerRanks
from tether.estimators import LossOutput, TokenBatch, build_estimator
from tether.guards import StepGuard, first_nonfinite
from tether.models.routing import pad_routes, route
from tether.rollout.hf import distinct_prompts, process_logits
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
    # MoE routing replay: the experts every trainer forward on this batch uses at each
    # position, (B, P+T, layers, k) uint8/int16; None: the routers choose (no replay).
    routed_experts: torch.Tensor | None = None

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

    def to(self, device: torch.device | str) -> RolloutTensors:
        return RolloutTensors(**{f.name: (None if (v := getattr(self, f.name)) is None else
                                          v.to(device, non_blocking=True)) for f in fields(self)})


def collate(rollouts: list[Rollout], pad_id: int, device: torch.device | str = "cpu") -> RolloutTensors:
    """Rollouts -> tensors on `device`, token ids untouched (a sampled pad or a mid-group eos
    stays as is). Built on the host, then moved in one transfer per field."""
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
    routed = _routes_buffer(rollouts, P + T)
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
        if routed is not None:
            routed[i, P - p:P + n - 1] = torch.from_numpy(r.routed_experts)
    batch = RolloutTensors(
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
        routed_experts=routed,
    )
    return batch.to(device)


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The trainer's numerics (`train.precision`): bf16 autocast on `device`, or fp32 (a no-op)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def _routes_buffer(rollouts: list[Rollout], width: int) -> torch.Tensor | None:
    """(B, width, layers, k) filled with `pad_routes`, when the rollouts carry routed experts."""
    have = [r.routed_experts is not None for r in rollouts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("collate: some rollouts carry routed experts and some do not")
    first = rollouts[0].routed_experts
    return pad_routes(len(rollouts), width, *first.shape[1:], torch.from_numpy(first[:0]).dtype)


def decode(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    routed_experts: torch.Tensor | None = None, record: bool = False, prompt_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The trainer's one forward, up to the output embedding: hidden states (B, L, H) of
    left-padded rows, and with `record` the experts each MoE layer chose (B, L, layers, k)
    (None for a dense model).

    `routed_experts` (B, L, layers, k): replay these experts instead of the routers' top-k,
    gate weights from the model's own router logits (tether.models.routing). The output
    embedding is applied by the caller, to the positions it needs (`score_tokens`: only
    the sampled tokens', a chunk at a time). `prompt_len` > 0: the first `prompt_len`
    columns are prompts, which rows may share (`decode_shared_prompts`).
    """
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    if 0 < prompt_len < input_ids.shape[1] and routed_experts is None and not record:
        hidden = decode_shared_prompts(model, input_ids, attention_mask, position_ids, prompt_len)
        if hidden is not None:
            return hidden, None
    with route(model, routed_experts, record) as routes:
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids).last_hidden_state
        experts = routes.pop(tuple(input_ids.shape)) if routes is not None else None
    return hidden, experts


# Responses run in buckets of about this many rows of similar length, each cut to its own
# longest response: a batch's responses end at different lengths (eos), and a dense
# (rows, longest) forward would spend the difference on padding.
BUCKET_ROWS = 32


def decode_shared_prompts(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    position_ids: torch.Tensor, prompt_len: int,
) -> torch.Tensor | None:
    """`decode` of left-padded prompts then right-padded responses, with less compute:

    - each distinct prompt runs once (a group's G responses share it); its keys and
      values are indexed out to the rows that continue it, whose backward sums their
      gradients into it;
    - the responses run in buckets of `BUCKET_ROWS` rows sorted by length, each bucket
      only as long as its longest response.

    The same function as the plain forward, up to float summation order: hidden states
    (B, L, H), zero at the response padding no bucket computed. None when it saves
    nothing (every prompt distinct and every response as long as the longest).
    """
    B, L = input_ids.shape
    P = prompt_len
    ids, mask, inverse = distinct_prompts(input_ids[:, :P], attention_mask[:, :P])
    lengths = attention_mask[:, P:].sum(dim=1)
    if ids.shape[0] == B and bool((lengths == L - P).all()):
        return None
    decoder = model.get_decoder()
    cache = DynamicCache()
    prompts = decoder(input_ids=ids, attention_mask=mask,
                      position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                      past_key_values=cache, use_cache=True).last_hidden_state  # (U, P, H)
    kv = [(layer.keys, layer.values) for layer in cache.layers]  # (U, heads, P, d) each
    order = lengths.argsort(stable=True)
    parts = []
    for rows in order.split(BUCKET_ROWS):
        t = int(lengths[rows].max())
        bucket, prompt_of = DynamicCache(), inverse[rows]
        for i, (k, v) in enumerate(kv):
            bucket.update(k[prompt_of], v[prompt_of], i)
        h = decoder(input_ids=input_ids[rows, P:P + t], attention_mask=attention_mask[rows, :P + t],
                    position_ids=position_ids[rows, P:P + t], past_key_values=bucket,
                    use_cache=True).last_hidden_state  # (rows, t, H)
        parts.append(torch.nn.functional.pad(h, (0, 0, 0, L - P - t)))
    responses = torch.cat(parts)[order.argsort()]  # back to the batch's row order
    return torch.cat([prompts[inverse], responses], dim=1)


def forward(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
    routed_experts: torch.Tensor | None = None, record: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decode` plus the output embedding at every position: logits (B, L, V) (for analyses
    that need the whole distribution; training never builds this tensor)."""
    hidden, experts = decode(model, input_ids, attention_mask, routed_experts, record)
    return model.get_output_embeddings()(hidden), experts


@dataclass
class Scores:
    """What a trainer forward says about a batch's sampled tokens."""

    logp: torch.Tensor  # (B, T), 0 on padding
    topk: torch.Tensor | None  # (B, T, K) at the batch's top-K ids, when it has them
    experts: torch.Tensor | None  # (B, P+T, layers, k) the MoE experts used, when recorded


# Logits of at most this many elements exist at once (64 MiB in fp32): the output embedding
# runs on chunks of tokens, so a 152k vocabulary never materialises (tokens, V) in full.
LOGIT_CHUNK_ELEMENTS = 1 << 24


def score_tokens(model: PreTrainedModel, batch: RolloutTensors, sampling: SamplingParams,
                 record: bool = False, precision: str = "fp32") -> Scores:
    """Log-probs of the sampled tokens and of the top-K ids under `model`, replaying
    `batch.routed_experts` when set; `record`: also the experts its MoE layers used.
    `precision`: the trainer's numerics (`autocast`); the log-softmax is fp32 either way.

    Costs nothing on padding: columns that are padding in every row are cut before the
    forward, and the output embedding runs only on the sampled tokens' positions, in
    chunks (`sampled_logprobs`). Differentiable when called with grad enabled.
    """
    B, T = batch.response_ids.shape
    P = batch.prompt_len
    cols = batch.attention_mask.any(dim=0).nonzero()
    lo, hi = int(cols[0]), int(cols[-1]) + 1  # the micro-batch's non-padding columns
    routed = None if batch.routed_experts is None else batch.routed_experts[:, lo:hi]
    with autocast(batch.input_ids.device, precision):
        hidden, experts = decode(model, batch.input_ids[:, lo:hi], batch.attention_mask[:, lo:hi],
                                 routed, record, prompt_len=P - lo)
    if experts is not None:  # back to the batch's width, padding routed as `pad_routes`
        full = pad_routes(B, P + T, *experts.shape[2:], experts.dtype)
        full[:, lo:hi] = experts
        experts = full
    n = hi - P  # response positions that hold a token in some row
    valid = batch.response_mask[:, :n].bool()
    h = hidden[:, P - 1 - lo:hi - 1 - lo][valid]  # (N, H): position P+t-1 predicts token t
    topk_ids = None if batch.topk_ids is None else batch.topk_ids[:, :n][valid]
    with autocast(batch.input_ids.device, precision):
        lp, tk = sampled_logprobs(model.get_output_embeddings(), h,
                                  batch.response_ids[:, :n][valid], topk_ids, sampling)
    logp = lp.new_zeros(B, T)
    logp[:, :n][valid] = lp
    topk = None
    if tk is not None:
        topk = tk.new_zeros(B, T, tk.shape[-1])
        topk[:, :n][valid] = tk
    return Scores(logp, topk, experts)


def sampled_logprobs(head: nn.Module, hidden: torch.Tensor, ids: torch.Tensor,
                     topk_ids: torch.Tensor | None, sampling: SamplingParams,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(ids) (N,) and log p(topk_ids) (N, K) under the processed distribution
    (`process_logits`: temperature, top-k, top-p) of logits = head(hidden), (N, H).

    The logits exist a chunk of tokens at a time (`LOGIT_CHUNK_ELEMENTS`); with grad and
    more than one chunk, each chunk's logits are recomputed in the backward pass instead
    of kept, so memory stays at one chunk's whatever the vocabulary.
    """
    rows = max(1, LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])

    def chunk(h: torch.Tensor, y: torch.Tensor, k: torch.Tensor | None):
        logp_all = process_logits(head(h), sampling.temperature, sampling.top_k, sampling.top_p)
        logp_all = logp_all.clamp(min=LOGP_FLOOR)
        return logp_all.gather(-1, y[:, None]).squeeze(-1), None if k is None else logp_all.gather(-1, k)

    if hidden.shape[0] <= rows:
        return chunk(hidden, ids, topk_ids)
    parts = []
    for i in range(0, hidden.shape[0], rows):
        args = (hidden[i:i + rows], ids[i:i + rows], None if topk_ids is None else topk_ids[i:i + rows])
        parts.append(checkpoint(chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                     else chunk(*args))
    return (torch.cat([p[0] for p in parts]),
            None if topk_ids is None else torch.cat([p[1] for p in parts]))


@torch.no_grad()
def score_batch(model: PreTrainedModel, batch: RolloutTensors, sampling: SamplingParams,
                micro_batch: int, record: bool = False, precision: str = "fp32") -> Scores:
    """`score_tokens` over `micro_batch` rows at a time, without grad, in eval mode."""
    model.eval()
    parts = [score_tokens(model, batch.select(slice(i, i + micro_batch)), sampling, record,
                          precision)
             for i in range(0, batch.input_ids.shape[0], micro_batch)]

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    return Scores(cat("logp"), cat("topk"), cat("experts"))


def token_logprobs(
    model: PreTrainedModel, batch: RolloutTensors, sampling: SamplingParams, precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp (B, T), top-K logp (B, T, K) or None) of `score_tokens`. Padding positions hold 0."""
    scores = score_tokens(model, batch, sampling, precision=precision)
    return scores.logp, scores.topk


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, std_norm: bool) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by the group's (population)
    std if `std_norm`. All groups at once: per-group sums by index_add, no loop."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = rewards.new_zeros(int(inverse.max()) + 1)
    count = zeros.index_add(0, inverse, torch.ones_like(rewards))
    centred = rewards - (zeros.index_add(0, inverse, rewards) / count)[inverse]
    if not std_norm:
        return centred
    std = (zeros.index_add(0, inverse, centred * centred) / count).sqrt()
    return centred / (std[inverse] + 1e-6)


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
        scores = self.score(batch, model)
        return scores.logp, scores.topk

    def score(self, batch: RolloutTensors, model: PreTrainedModel, record: bool = False) -> Scores:
        """`score_batch` in `train.micro_batch` rows (`record`: also the experts used)."""
        return score_batch(model, batch, self.sampling, self.cfg.micro_batch, record,
                           self.cfg.precision)

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
        a step stopped before scoring every row. `logp_old` None (one mini-batch, a batch
        sampled at the current weights): pi_old is the training forward's logp, detached.

        An estimator that reads pi_prox (decoupled PPO) gets it scored here, without grad,
        at the weights before the first of these steps, for every mini-batch (as AReaL
        recomputes it once per training step). A batch whose every token was sampled at
        this version needs no forward: pi_prox is then pi_old (same weights, same numerics).
        """
        if logp_old is None and self.cfg.minibatches != 1:
            raise ValueError("logp_old=None needs train.minibatches=1: later mini-batches "
                             "train after the weights moved")
        if self.ranks is not None:  # rank 0: the other ranks train on the same batch
            self.ranks.dispatch(batch, advantages, logp_old, topk_logp_old)
        B = batch.input_ids.shape[0]
        mb = B // self.cfg.minibatches
        # This rank's rows of each mini-batch (all of them with one process).
        idxs = [slice(start, start + mb) if self.shard is None else self.shard.rows(start, mb)
                for start in range(0, B, mb)]
        valid = batch.response_mask.bool()
        score_prox = self.estimator.needs_prox and \
            bool((batch.token_versions[valid] != self.version).any())
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
            bad = first_nonfinite(checked, micro.response_mask)
            if bad is not None:
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
