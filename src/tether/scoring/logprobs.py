"""The forward that turns (weights, tokens) into the processed log-probs of sampled tokens.

Every scoring forward (the trainer's logp with grad, pi_old in the trainer or in a rollout
worker, kept versions, the probe, the TRL plug-in) goes through `decode` (and
`score_tokens` on top of it), which replays the batch's MoE routing when it carries one
(`RolloutTensors.routed_experts`: R3, the generator's; R2, the `logp_old` forward's;
tether.models.routing). The sampled tokens are scored under the same processed
distribution the engines sample from (tether.scoring.distribution.process_logits).
`train.precision=bf16` runs the forwards under bf16 autocast (`autocast`), the fp32
master weights untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedModel

from tether.config import TrainConfig
from tether.models.routing import pad_routes, route
from tether.rollout.types import SamplingParams
from tether.scoring.batch import RolloutTensors
from tether.scoring.distribution import distinct_prompts, process_logits

LOGP_FLOOR = -1e4  # a token outside the trainer's top-k/top-p set has logp -inf; keep it finite


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """The trainer's numerics (`train.precision`): bf16 autocast on `device`, or fp32 (a no-op)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


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
    # Gradient checkpointing in training drops the KV cache that shared prompts are read
    # from (transformers' checkpointed layers; TRL turns it on): then the plain forward.
    checkpointed = model.training and getattr(model, "is_gradient_checkpointing", False)
    if 0 < prompt_len < input_ids.shape[1] and routed_experts is None and not record \
            and not checkpointed:
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


# Logits of at most this many elements exist at once (fp32: 64 MiB on a CPU, 1 GiB on a
# GPU, where fewer, larger matmuls keep it busy): the output embedding runs on chunks of
# tokens, so a 152k vocabulary never materialises (tokens, V) in full.
LOGIT_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}


# A model sharded with FSDP2 (tether.trainer.sharding) has this method, registered as a
# forward of its root unit: what runs inside it has the root's weights (embeddings, final
# norm, LM head) gathered, and their gradients reduced after the backward, as in `model(...)`.
FORWARD_METHOD = "tether_forward"


def as_forward(model: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` as `model`'s forward (`FORWARD_METHOD`); fn itself for a model without it.
    tether's forwards call the decoder and the output embedding apart, not `model(...)`."""
    method = getattr(model, FORWARD_METHOD, None)
    return fn(*args) if method is None else method(fn, *args)


def score_tokens(model: PreTrainedModel, batch: RolloutTensors, sampling: SamplingParams,
                 record: bool = False, precision: str = "fp32") -> Scores:
    """`_score_tokens` as the model's forward (`as_forward`)."""
    return as_forward(model, _score_tokens, model, batch, sampling, record, precision)


def _score_tokens(model: PreTrainedModel, batch: RolloutTensors, sampling: SamplingParams,
                  record: bool, precision: str) -> Scores:
    """Log-probs of the sampled tokens and of the top-K ids under `model`, replaying
    `batch.routed_experts` when set; `record`: also the experts its MoE layers used.
    `precision`: the trainer's numerics (`autocast`) up to the output embedding, which
    with the log-softmax runs in fp32 either way.

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
        full = pad_routes(B, P + T, *experts.shape[2:], experts.dtype, experts.device)
        full[:, lo:hi] = experts
        experts = full
    n = hi - P  # response positions that hold a token in some row
    valid = batch.response_mask[:, :n].bool()
    h = hidden[:, P - 1 - lo:hi - 1 - lo][valid]  # (N, H): position P+t-1 predicts token t
    topk_ids = None if batch.topk_ids is None else batch.topk_ids[:, :n][valid]
    # The output embedding in its weights' dtype (fp32 for the trainer) whatever
    # `precision`: bf16 logits would be rounded (to ~3 significant digits) before the fp32
    # log-softmax (MiniMax-M1, arXiv 2506.13585, keeps its LM head in fp32 for this reason).
    head = model.get_output_embeddings()
    lp, tk = sampled_logprobs(head, h.to(head.weight.dtype),
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

    The logits exist a chunk of tokens at a time (`LOGIT_CHUNK_ELEMENTS` of `hidden`'s
    device); with grad and more than one chunk, each chunk's logits are recomputed in the
    backward pass instead of kept, so memory stays at one chunk's whatever the vocabulary.
    """
    rows = max(1, logit_chunk_elements(hidden.device) // head.weight.shape[0])

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


def logit_chunk_elements(device: torch.device) -> int:
    """The most logits `sampled_logprobs` builds at once on `device` (the CPU's size for a
    device without its own)."""
    return LOGIT_CHUNK_ELEMENTS.get(device.type, LOGIT_CHUNK_ELEMENTS["cpu"])


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


class TokenScorer:
    """The trainer's scoring: its processed distribution (`sampling`), `train.micro_batch`
    rows per forward and `train.precision`. The `Trainer` scores with it; so does a rollout
    worker that scores pi_old of its own batch (`loop.score_old=worker`), so both give the
    same numbers for the same batch and weights."""

    def __init__(self, cfg: TrainConfig, sampling: SamplingParams):
        self.cfg, self.sampling = cfg, sampling

    def score(self, batch: RolloutTensors, model: PreTrainedModel, record: bool = False) -> Scores:
        """`score_batch` in `train.micro_batch` rows (`record`: also the experts used)."""
        return score_batch(model, batch, self.sampling, self.cfg.micro_batch, record,
                           self.cfg.precision)

    @torch.no_grad()
    def score_old(
        self, batch: RolloutTensors, model: PreTrainedModel
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and top-K) of the batch's tokens under `model`, micro-batched, without
        grad: pi_old when `model` holds the weights that sampled them."""
        scores = self.score(batch, model)
        return scores.logp, scores.topk
