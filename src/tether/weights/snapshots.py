"""Weight snapshots: `logp_old` must be computed at the weights that sampled the batch.

The generator holds its weights in its own numerics (bf16, fp8), from which the
trainer's fp32 `logp_old` cannot be recomputed, so the trainer keeps a copy of every
version something still needs (DESIGN.md section 4):
- the version the generator holds (the next batch will be sampled with it),
- every version a queued rollout was sampled with (async mode),
- with `sync.lag` k > 0, the versions not yet delivered that a later lagged delivery
  (trainer version - k) can still land on.
The synchronous loop's `Synchronizer` and the asynchronous loop compute that set each
step and call `release`; the store frees the rest. One scratch model is reused for
scoring. A kept version costs what its form stores (docs/scale.md, `weights.*`):
- `rounded`: the tensors the trainer's forward only ever reads cast to bf16
  (`train.precision=bf16`; `compute_dtype_names` finds them) are kept in bf16, the rest
  as they are. Scoring under the same autocast then reads bit for bit the same values.
- `compress`: the newest version whole, each older one as an exact XOR delta against the
  next kept one (tether.weights.delta), all in host memory; a version is rebuilt bit for
  bit by walking down from the newest.
- `offload`: kept in host memory where the trainer is on a GPU.
`nbytes` is logged as `snapshots/bytes`, and per kept version as `snapshots/bytes_per_version`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from itertools import pairwise
from types import MappingProxyType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import PreTrainedModel

from tether.scoring import RolloutTensors, autocast, decode
from tether.scoring.versions import score_at_versions
from tether.weights import delta
from tether.weights.publisher import pack


class SnapshotStore:
    def __init__(self, template: PreTrainedModel, rounded: frozenset[str] = frozenset(),
                 compress: bool = False, offload: bool = False, bucket_bytes: int = 64 << 20,
                 level: int = 1, threads: int = 1):
        self._template = template
        self._scratch: PreTrainedModel | None = None
        self._loaded: int | None = None
        self.rounded, self.compress, self.level, self.threads = rounded, compress, level, threads
        self.host = offload or compress  # deltas are compressed on the host
        self.bucket_bytes = bucket_bytes
        self._layout: delta.Layout | None = None
        self._parts: tuple[delta.Bucket, ...] = ()
        self._flat: dict[int, torch.Tensor] = {}  # whole buffers: every version, or the newest
        self._deltas: dict[int, delta.Delta] = {}  # compress: v -> v ^ (next kept version)

    @classmethod
    def of(cls, cfg: Any, model: PreTrainedModel) -> SnapshotStore:
        """The store `weights.*` asks for, holding copies of `model`'s state dict."""
        w = cfg.weights
        bf16 = (cfg.train.precision, cfg.rollout.precision) == ("bf16", "bf16")
        rounded = w.snapshot_dtype == "train" or (w.snapshot_dtype == "auto" and bf16)
        names = compute_dtype_names(model, cfg.train.precision) if rounded else frozenset()
        return cls(model, names, w.snapshot_compress == "xor", w.snapshot_offload,
                   w.bucket_mb << 20, w.zstd_level, w.delta_threads)

    def put(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `state_dict` as `version` (no-op if already kept)."""
        if version in self:
            return
        flat = self._pack(state_dict)
        if not self.compress or not self._flat:
            self._flat[version] = flat
            return
        newer = [v for v in self.versions if v > version]
        older = [v for v in self.versions if v < version]
        if not newer:  # the usual case: the old head becomes a delta against the new one
            (head, head_flat), = self._flat.items()
            self._deltas[head] = self._encode(head_flat, flat)
            self._flat = {version: flat}
            return
        if older:  # inserted between two kept versions: the older one's delta changes
            self._deltas[older[-1]] = self._encode(self._buffer(older[-1]), flat)
        self._deltas[version] = self._encode(flat, self._buffer(newer[0]))

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """The kept state dict of `version`, in its stored dtypes (views: do not modify)."""
        assert self._layout is not None
        buf = self._buffer(version)
        return {name: buf[a:b].view(dtype).view(shape) for name, dtype, shape, a, b in self._layout}

    def model_at(self, version: int) -> PreTrainedModel:
        """A model holding `version`'s weights (the scratch model, reloaded if needed)."""
        if self._scratch is None:
            self._scratch = copy.deepcopy(self._template).eval()
        if self._loaded != version:
            self._scratch.load_state_dict(self.state(version))  # upcasts what is kept rounded
            self._loaded = version
        return self._scratch

    def pi_old(self, trainer: Any, batch: RolloutTensors,
               ) -> tuple[torch.Tensor, torch.Tensor | None, RolloutTensors]:
        """pi_old of `batch` at the versions that sampled each token (`score_at_versions`):
        `trainer`'s own weights (the Trainer: `model`, `version`, `score`) for its current
        version, else the kept ones."""
        model_at = lambda v: trainer.model if v == trainer.version else self.model_at(v)
        return score_at_versions(trainer, batch, model_at)

    def release(self, keep: set[int]) -> list[int]:
        """Free every version not in `keep`; return the freed versions."""
        versions = self.versions
        freed = [v for v in versions if v not in keep]
        kept = [v for v in versions if v in keep]
        if self.compress and freed and kept:
            was, now = dict(pairwise(versions)), dict(pairwise(kept))
            redo = [k for k in kept[:-1] if was[k] != now[k]]  # its reference is freed
            head = kept[-1]
            bufs = {v: self._buffer(v) for v in {*redo, *(now[k] for k in redo), head}}
            for k in redo:
                self._deltas[k] = self._encode(bufs[k], bufs[now[k]])
            self._deltas.pop(head, None)
            self._flat = {head: bufs[head]}
        for v in freed:
            self._flat.pop(v, None)
            self._deltas.pop(v, None)
            if self._loaded == v:
                self._loaded = None
        return freed

    def __len__(self) -> int:
        return len(self._flat) + len(self._deltas)

    def __contains__(self, version: int) -> bool:
        return version in self._flat or version in self._deltas

    @property
    def versions(self) -> list[int]:
        return sorted([*self._flat, *self._deltas])

    @property
    def nbytes(self) -> int:
        """Bytes held by the kept versions (the scratch model is not counted)."""
        return (sum(t.numel() for t in self._flat.values())
                + sum(d.nbytes for d in self._deltas.values()))

    @property
    def deltas(self) -> Mapping[int, delta.Delta]:
        """The versions kept as deltas (`compress`), read only: version -> its XOR against
        the next kept version, bucket by bucket, compressed (`delta.Delta`: `buckets`, `blobs`,
        `nbytes`); empty without `compress`. For a compression ratio by element size."""
        return MappingProxyType(self._deltas)

    def metrics(self, freed: list[int]) -> dict[str, float]:
        """The `snapshots/*` row keys, after a `release` that freed `freed`."""
        n = self.nbytes
        return {"snapshots/count": float(len(self)), "snapshots/bytes": float(n),
                "snapshots/bytes_per_version": n / max(len(self), 1),
                "snapshots/freed": float(len(freed))}

    # -- internals ---------------------------------------------------------------------

    def _pack(self, state_dict: dict[str, torch.Tensor]) -> torch.Tensor:
        """`state_dict` as one flat buffer in the store's layout (the first version's order: a
        restored dict may come reordered, and deltas XOR byte for byte)."""
        if self._layout is not None:
            state_dict = {name: state_dict[name] for name, *_ in self._layout}
        device = torch.device("cpu") if self.host else next(iter(state_dict.values())).device
        packed = pack(0, state_dict, rounded=self.rounded, device=device)
        if self._layout is None:
            self._layout = packed.layout
            self._parts = delta.buckets(self._layout, self.bucket_bytes)
        return packed.buffer

    def _encode(self, buf: torch.Tensor, ref: torch.Tensor) -> delta.Delta:
        return delta.encode(buf, ref, self._parts, self.level, self.threads)

    def _buffer(self, version: int) -> torch.Tensor:
        """`version`'s whole buffer: kept, or rebuilt from the newest down the deltas."""
        if version in self._flat:
            return self._flat[version]
        if version not in self._deltas:
            raise KeyError(f"weight version {version} was not kept; kept: {self.versions}")
        chain = [v for v in self.versions if v >= version]
        buf = self._flat[chain[-1]].clone()
        for v in reversed(chain[:-1]):
            delta.apply(self._deltas[v], buf, out=buf, threads=self.threads)
        return buf


class _Uses(TorchDispatchMode):
    """Which parameters (by storage) each op reads, and whether the op is a cast to bf16."""

    def __init__(self, owner: dict[int, str]):
        super().__init__()
        self.owner, self.cast, self.other = owner, set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:  # a view reads nothing; what is done with it is seen next
            names = {self.owner.get(t.untyped_storage().data_ptr())
                     for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)} - {None}
            bf16_cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
            (self.cast if bf16_cast else self.other).update(names)
        return func(*args, **kwargs)


@torch.no_grad()
def compute_dtype_names(model: PreTrainedModel, precision: str) -> frozenset[str]:
    """The state-dict names whose every read in the trainer's forward (`decode` under
    `train.precision`'s autocast) is a cast to bf16: storing them rounded changes no value
    the forward computes. Found by watching one forward of a few random tokens; the output
    embedding runs in fp32 (tether.scoring) and is never among them."""
    if precision != "bf16":
        return frozenset()
    sd = model.state_dict()
    owner = {t.untyped_storage().data_ptr(): n for n, t in sd.items()}
    uses = _Uses(owner)
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with autocast(device, precision), uses:
        decode(model, ids, torch.ones_like(ids), None, False, prompt_len=4)
    head = model.get_output_embeddings()
    keep = uses.cast - uses.other
    if head is not None:
        keep.discard(owner.get(head.weight.untyped_storage().data_ptr()))
    by_storage = {n: owner[t.untyped_storage().data_ptr()] for n, t in sd.items()}
    return frozenset(n for n, o in by_storage.items() if o in keep)
