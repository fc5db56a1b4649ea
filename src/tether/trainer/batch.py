"""A batch of rollouts as tensors (`RolloutTensors`), and `collate`, which builds one."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from tether.models.routing import pad_routes
from tether.rollout.types import Rollout


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

    def sampled_at(self, version: int) -> bool:
        """Every response token was sampled at weight version `version`."""
        return bool((self.token_versions[self.response_mask.bool()] == version).all())

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



def _routes_buffer(rollouts: list[Rollout], width: int) -> torch.Tensor | None:
    """(B, width, layers, k) filled with `pad_routes`, when the rollouts carry routed experts."""
    have = [r.routed_experts is not None for r in rollouts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("collate: some rollouts carry routed experts and some do not")
    first = rollouts[0].routed_experts
    return pad_routes(len(rollouts), width, *first.shape[1:], torch.from_numpy(first[:0]).dtype)
