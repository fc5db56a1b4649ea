"""Weight snapshots: `logp_old` must be computed at the weights that sampled the batch.

The generator holds its weights in its own numerics (bf16, fp8), from which the
trainer's fp32 `logp_old` cannot be recomputed, so the trainer keeps an fp32 copy of
every version something still needs (DESIGN.md section 4):
- the version the generator holds (the next batch will be sampled with it),
- every version a queued rollout was sampled with (async mode),
- with `sync.lag` k > 0, the versions not yet delivered that a later lagged delivery
  (trainer version - k) can still land on.
The synchronous loop's `Synchronizer` and the asynchronous loop compute that set each
step and call `release`; the store frees the rest. One scratch model is reused for
scoring, so the memory cost is one state dict per live version (`nbytes`, logged as `snapshots/bytes`).
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

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """The kept state dict of `version` (not a copy: do not modify)."""
        if version not in self._states:
            raise KeyError(f"weight version {version} was not kept; kept: {self.versions}")
        return self._states[version]

    def model_at(self, version: int) -> PreTrainedModel:
        """A model holding `version`'s weights (the scratch model, reloaded if needed)."""
        state = self.state(version)
        if self._scratch is None:
            self._scratch = copy.deepcopy(self._template).eval()
        if self._loaded != version:
            self._scratch.load_state_dict(state)
            self._loaded = version
        return self._scratch

    def release(self, keep: set[int]) -> list[int]:
        """Free every version not in `keep`; return the freed versions."""
        freed = [v for v in self._states if v not in keep]
        for v in freed:
            del self._states[v]
            if self._loaded == v:
                self._loaded = None
        return sorted(freed)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, version: int) -> bool:
        return version in self._states

    @property
    def versions(self) -> list[int]:
        return sorted(self._states)

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept state dicts (the scratch model is not counted)."""
        return sum(t.numel() * t.element_size() for s in self._states.values() for t in s.values())
