"""Sync policies: when the generator receives the trainer's weights (DESIGN.md section 4).

A policy is parsed from a short spec string (`every:1`) and asked once per step, after
the optimizer steps, which weight version the generator should hold next.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EveryK:
    """`every:k`: copy the current weights to the generator after every k-th step."""

    k: int = 1

    def target_version(self, step: int, trainer_version: int, generator_version: int) -> int | None:
        """The version to load into the generator now, or None to keep the current one."""
        return trainer_version if (step + 1) % self.k == 0 else None


SyncPolicy = EveryK

_POLICIES = {"every": EveryK}


def parse_sync_policy(spec: str) -> SyncPolicy:
    """`"every:2"` -> EveryK(2). Raises ValueError listing the valid forms."""
    name, _, arg = spec.partition(":")
    if name not in _POLICIES:
        raise ValueError(f"unknown sync policy {spec!r}; valid: {', '.join(f'{n}:K' for n in _POLICIES)}")
    try:
        k = int(arg)
    except ValueError:
        raise ValueError(f"sync policy {spec!r}: K must be an integer, e.g. {name}:1") from None
    if k < 1:
        raise ValueError(f"sync policy {spec!r}: K must be >= 1")
    return _POLICIES[name](k)
