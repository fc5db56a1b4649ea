"""A batch of rollouts as tensors (`RolloutTensors`), and `collate`, which builds one."""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain

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
    # pi_old as scored where the batch was made (async workers, `loop.score_old=worker`), at
    # each token's version; None: the trainer scores it (tether.step.old_logprobs).
    logp_old: torch.Tensor | None = None  # (B, T)
    topk_logp_old: torch.Tensor | None = None  # (B, T, K)

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
    stays as is). Built on the host, one tensor per field from the rollouts' lists chained
    (not one per row: a 256-row batch would make a thousand small tensors), then moved in
    one transfer per field."""
    B = len(rollouts)
    if B == 0:
        raise ValueError("collate: empty list of rollouts")
    P = max(len(r.prompt_ids) for r in rollouts)
    T = max(len(r.response_ids) for r in rollouts)
    p_len = [len(r.prompt_ids) for r in rollouts]
    p_row, p_col = _ragged(p_len)
    row, col = _ragged([len(r.response_ids) for r in rollouts])  # every response token

    def flat(lists: list[list], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(list(chain.from_iterable(lists)), dtype=dtype)

    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + T), dtype=torch.long)
    p_start = P - torch.tensor(p_len)  # left padding
    input_ids[p_row, p_start[p_row] + p_col] = flat([r.prompt_ids for r in rollouts], torch.long)
    attn[p_row, p_start[p_row] + p_col] = 1
    input_ids[row, P + col] = flat([r.response_ids for r in rollouts], torch.long)
    attn[row, P + col] = 1

    def per_token(lists: list[list], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(B, T) or (B, T, K): each row's list at its response positions, zeros after."""
        values = flat(lists, dtype)
        out = values.new_zeros((B, T, *values.shape[1:]))
        out[row, col] = values
        return out

    resp_mask = torch.zeros((B, T))
    resp_mask[row, col] = 1
    K = len(rollouts[0].topk_ids[0]) if rollouts[0].topk_ids else 0
    token_versions = torch.tensor([r.version for r in rollouts])[:, None].repeat(1, T)
    if any(r.token_versions is not None for r in rollouts):  # partial rollouts
        token_versions[row, col] = flat([r.token_versions or [r.version] * len(r.response_ids)
                                         for r in rollouts], torch.long)
    routed = _routes_buffer(rollouts, P + T)
    if routed is not None:
        for i, r in enumerate(rollouts):
            p, n = len(r.prompt_ids), len(r.response_ids)
            routed[i, P - p:P + n - 1] = torch.from_numpy(r.routed_experts)
    carried = all(r.logp_old is not None for r in rollouts)  # pi_old scored by the worker
    batch = RolloutTensors(
        input_ids=input_ids,
        attention_mask=attn,
        response_ids=input_ids[:, P:].clone(),
        response_mask=resp_mask,
        logp_rollout=per_token([r.logp_rollout for r in rollouts]),
        rewards=torch.tensor([float(r.reward or 0.0) for r in rollouts]),
        group_ids=torch.tensor([r.group_id for r in rollouts]),
        token_versions=token_versions,
        topk_ids=per_token([r.topk_ids for r in rollouts], torch.long) if K else None,
        topk_logp_rollout=per_token([r.topk_logp for r in rollouts]) if K else None,
        routed_experts=routed,
        logp_old=per_token([r.logp_old for r in rollouts]) if carried else None,
        topk_logp_old=per_token([r.topk_logp_old for r in rollouts]) if carried and K else None,
    )
    return batch.to(device)


def _ragged(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every element of rows of these lengths, row by row."""
    n = torch.tensor(lengths)
    row = torch.repeat_interleave(torch.arange(len(lengths)), n)
    starts = torch.cumsum(n, 0) - n
    return row, torch.arange(int(n.sum())) - starts[row]


def _routes_buffer(rollouts: list[Rollout], width: int) -> torch.Tensor | None:
    """(B, width, layers, k) filled with `pad_routes`, when the rollouts carry routed experts."""
    have = [r.routed_experts is not None for r in rollouts]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("collate: some rollouts carry routed experts and some do not")
    first = rollouts[0].routed_experts
    return pad_routes(len(rollouts), width, *first.shape[1:], torch.from_numpy(first[:0]).dtype)
