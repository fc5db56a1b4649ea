"""MoE routing: record the experts each token was sent to, and replay them (R2, R3).

A mixture-of-experts layer sends each token to the top-k experts of its router's
softmax. A tiny numerical difference between generator and trainer (bf16 against fp32,
another kernel) can change that choice, and a token routed to other experts gets a very
different log-prob: the mismatch multiplies (CIS's setting). Routing replay removes it:
- R3 (rollout routing replay, arXiv 2510.11370): the generator records the experts it
  chose at every position; the trainer's `logp_old` and `logp` forwards use them.
- R2: the experts the trainer chose in its `logp_old` forward are replayed in the `logp`
  forwards of the same batch (staleness then cannot move the routing either).
Replay fixes only *which* experts; their gate weights are recomputed from the trainer's
own router logits, softmax over all experts gathered at the replayed ones (renormalised
where the router normalises its top-k), so gradients still reach the router weights.

Routes are stored as (B, L, layers, k) in the smallest integer dtype that holds an
expert id: uint8 up to 256 experts (1 byte per token, layer and chosen expert), int16
beyond. Supported routers: those of `ROUTERS` (transformers' top-k softmax routers of
Qwen3-MoE, Qwen2-MoE and Mixtral); another MoE model gets an error naming its class.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RouterKind:
    """How a router class turns its softmax top-k into gate weights."""

    normalise: bool | None  # renormalise the top-k weights; None: the router's norm_topk_prob
    scores_in_logit_dtype: bool  # cast the gate weights back to the logits' dtype


# transformers class name -> its top-k rule (each forward: logits = h W^T; softmax in fp32;
# top-k; optional renormalisation), read off transformers 5's modeling files.
ROUTERS: dict[str, RouterKind] = {
    "Qwen3MoeTopKRouter": RouterKind(normalise=None, scores_in_logit_dtype=True),
    "Qwen2MoeTopKRouter": RouterKind(normalise=None, scores_in_logit_dtype=True),
    "MixtralTopKRouter": RouterKind(normalise=True, scores_in_logit_dtype=False),
}


def routes_dtype(num_experts: int) -> torch.dtype:
    """uint8 while an expert id fits in a byte (<= 256 experts), else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class _RouterState:
    """What a patched router does besides its own top-k (see `_routed_forward`)."""

    noise_std: float = 0.0
    noise: torch.Generator | None = None
    replay: torch.Tensor | None = None  # (N, k) long: the experts of this forward's N tokens
    recorded: list[torch.Tensor] = field(default_factory=list)  # (N, k) per forward
    record: bool = False


def _routed_forward(router: nn.Module, kind: RouterKind, state: _RouterState):
    def forward(hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, router.weight.shape[1])
        logits = F.linear(h, router.weight)  # (N, E)
        if state.noise_std > 0:
            # Drawn where the generator lives (a CUDA generator draws only CUDA tensors).
            noise = torch.randn(logits.shape, generator=state.noise, dtype=torch.float32,
                                device=state.noise.device)
            logits = logits + (noise * state.noise_std).to(logits.device, logits.dtype)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        if state.replay is not None:
            if state.replay.shape != (h.shape[0], router.top_k):
                raise ValueError(f"routing replay: {tuple(state.replay.shape)} experts for "
                                 f"{h.shape[0]} tokens x top-{router.top_k}")
            idx = state.replay.to(probs.device)  # no-op when the batch is where the model is
            top = probs.gather(-1, idx)  # grad reaches the router through the softmax
        else:
            top, idx = torch.topk(probs, router.top_k, dim=-1)
        normalise = router.norm_topk_prob if kind.normalise is None else kind.normalise
        if normalise:
            top = top / top.sum(dim=-1, keepdim=True)
        if state.record:
            state.recorded.append(idx)
        return logits, top.to(logits.dtype) if kind.scores_in_logit_dtype else top, idx
    return forward


def is_moe(model: nn.Module) -> bool:
    """A model whose config declares experts (Qwen-MoE's num_experts, Mixtral's num_local_experts)."""
    cfg = getattr(model, "config", None)
    experts = getattr(cfg, "num_experts", 0) or getattr(cfg, "num_local_experts", 0)
    return bool(experts) and bool(getattr(cfg, "num_experts_per_tok", 0))


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router) of every MoE layer, in order; ValueError when tether
    cannot patch this model's routers (the error names the model and router classes)."""
    found, unknown = [], set()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ROUTERS:
            m = re.search(r"layers\.(\d+)\.", name)
            found.append((int(m.group(1)) if m else len(found), module))
        elif kind.endswith("Router") or (name.endswith("mlp.gate") and hasattr(module, "top_k")):
            unknown.add(kind)
    if unknown or (not found and is_moe(model)):
        raise ValueError(
            f"routing replay / router noise: {type(model).__name__} routes with "
            f"{', '.join(sorted(unknown)) or 'a router tether does not know'}; tether can patch "
            f"{', '.join(ROUTERS)} (Qwen3-MoE, Qwen2-MoE, Mixtral)"
        )
    return found


def _state(router: nn.Module) -> _RouterState:
    """The router's patch state, installing the patched forward on first use."""
    state = getattr(router, "_tether_routing", None)
    if state is None:
        state = _RouterState()
        router._tether_routing = state
        router.forward = _routed_forward(router, ROUTERS[type(router).__name__], state)
    return state


def _unpatch(router: nn.Module) -> None:
    """Back to the class's own forward (a patched model must not be deep-copied: the copy's
    forward would still close over this router)."""
    del router.forward
    del router._tether_routing


def add_router_noise(model: nn.Module, std: float, generator: torch.Generator) -> int:
    """Perturb every router's logits by N(0, std^2) before its top-k, for good; the count.

    The generator's stand-in for engine-to-engine routing disagreement (numerics.py). Noise
    comes from `generator`; recording (`route`) then sees the routing actually used.
    """
    found = routers(model)
    for _, router in found:
        state = _state(router)
        state.noise_std, state.noise = std, generator
    return len(found)


class Routes:
    """The experts recorded by `route(..., record=True)`, one forward at a time."""

    def __init__(self, model: nn.Module, found: list[tuple[int, nn.Module]]):
        self.found = found
        cfg = model.config
        self.dtype = routes_dtype(getattr(cfg, "num_experts", 0) or cfg.num_local_experts)

    def pop(self, shape: tuple[int, int]) -> torch.Tensor:
        """The experts of the last forward over `shape` = (B, S) tokens: (B, S, layers, k)."""
        per_layer = [_state(r).recorded.pop() for _, r in self.found]
        for _, r in self.found:
            _state(r).recorded.clear()
        return torch.stack(per_layer, dim=1).reshape(*shape, len(per_layer), -1).to(self.dtype)


@contextmanager
def route(model: nn.Module, replay: torch.Tensor | None = None,
          record: bool = False) -> Iterator[Routes | None]:
    """Within the block, the model's routers replay `replay` and/or record their choice.

    replay: (B, L, layers, k) integer experts for the next forwards over (B, L) tokens
    (one forward, or several over the same tokens); None: the routers choose. record:
    `Routes.pop` returns each forward's experts. Without either, nothing is patched, so a
    run without replay computes exactly what it did before routing replay existed. On a
    dense model, replay must be None and recording yields nothing (None).
    """
    if replay is None and not record:
        yield None
        return
    found = routers(model)
    if not found:
        if replay is not None:
            raise ValueError(f"routing replay: {type(model).__name__} is not a MoE model")
        yield None
        return
    if replay is not None and replay.shape[2] != len(found):
        raise ValueError(f"routing replay: routes for {replay.shape[2]} MoE layers, "
                         f"{type(model).__name__} has {len(found)}")
    fresh = [getattr(r, "_tether_routing", None) is None for _, r in found]  # unpatch after
    states = [_state(r) for _, r in found]
    for i, state in enumerate(states):
        state.record, state.recorded = record, []
        if replay is not None:
            state.replay = replay[:, :, i].reshape(-1, replay.shape[-1]).long()
    try:
        yield Routes(model, found) if record else None
    finally:
        for (_, router), state, was_fresh in zip(found, states, fresh):
            state.record, state.recorded, state.replay = False, [], None
            if was_fresh:
                _unpatch(router)


def pad_routes(rows: int, width: int, layers: int, k: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """(rows, width, layers, k) routes for positions nobody routed (padding, a response's
    last token): experts 0..k-1 everywhere, distinct like a real choice; those positions
    feed no scored log-prob. A fresh tensor on `device`, to be filled with real routes."""
    return torch.arange(k, dtype=dtype, device=device).expand(rows, width, layers, k).clone()
