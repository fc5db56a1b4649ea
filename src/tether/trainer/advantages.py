"""GRPO group advantages."""

from __future__ import annotations

import torch


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
