"""Weight snapshots: `logp_old` must be computed at the weights that sampled the batch.

The store keeps a version only while something still needs it (the generator holds it,
or a queued batch was sampled with it); `release` frees the rest. One scratch model is
reused for scoring, so the memory cost is one state dict per live version.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel


class SnapshotStore:
    def __init__(self, template: PreTrainedModel):
        self._template = template
        self._scratch: PreTrainedModel | None = None
        self._loaded: int | None = None
        self._states: dict[int, dict[str, torch.Tensor]] = {}

    def put(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `state_dict` as `version` (no-op if already kept)."""
        if version not in self._states:
            self._states[version] = {k: v.detach().clone() for k, v in state_dict.items()}

    def model_at(self, version: int) -> PreTrainedModel:
        """A model holding `version`'s weights (the scratch model, reloaded if needed)."""
        if version not in self._states:
            raise KeyError(f"weight version {version} was not kept; kept: {sorted(self._states)}")
        if self._scratch is None:
            self._scratch = copy.deepcopy(self._template).eval()
        if self._loaded != version:
            self._scratch.load_state_dict(self._states[version])
            self._loaded = version
        return self._scratch

    def release(self, keep: set[int]) -> None:
        """Free every version not in `keep`."""
        for v in [v for v in self._states if v not in keep]:
            del self._states[v]
            if self._loaded == v:
                self._loaded = None

    @property
    def versions(self) -> list[int]:
        return sorted(self._states)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._states.values() for t in s.values())
