"""Rank 0's work for the other trainer ranks, over torch.distributed (`Channel`), so that a
rank may be on another machine; and moving what arrives to a rank's device (`on_device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Between steps the ranks wait in the channel as long as rank 0 generates, evaluates or
# checkpoints. A rank 0 that exits closes its connections, which ends the wait at once.
IDLE = timedelta(days=7)


class Channel:
    """Rank 0's work for the other ranks over torch.distributed, so that a rank may be on
    another machine: the work's structure (each tensor replaced by its shape and dtype) in
    one broadcast of a pickled object, then each tensor in a broadcast of its own (a pickled
    tensor costs 5-10x as much). A gloo group of its own: host tensors on every backend, and
    the `IDLE` timeout between steps."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE)

    def send(self, obj: Any) -> None:
        tensors: list[torch.Tensor] = []

        def slot(t: torch.Tensor) -> Any:
            tensors.append(t.detach().to("cpu").contiguous())
            return _Slot(len(tensors) - 1, tuple(t.shape), t.dtype)

        skeleton = _map_tensors(obj, slot)
        dist.broadcast_object_list([skeleton], src=0, group=self.group)
        for t in tensors:
            dist.broadcast(t, src=0, group=self.group)

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        slots: list[_Slot] = []
        _map_slots(box[0], slots.append)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
        for t in tensors:
            dist.broadcast(t, src=0, group=self.group)
        return _map_slots(box[0], lambda s: tensors[s.index])


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a tensor was in the work `Channel.send` broadcast: its place and layout."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def on_device(obj: Any, device: torch.device | str) -> Any:
    """`obj` with every tensor in it on `device` (tensors already there are kept, not copied)."""
    return _map_tensors(obj, lambda t: t.to(device))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` (tensors in dicts, lists, tuples, dataclasses) with `fn` applied to each tensor."""
    return _map_leaves(obj, torch.Tensor, fn)


def _map_slots(obj: Any, fn: Callable[[_Slot], Any]) -> Any:
    return _map_leaves(obj, _Slot, fn)


def _map_leaves(obj: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`obj` with `fn` applied to each value of type `kind` in its dicts, lists, tuples and
    dataclasses."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_leaves(v, kind, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(v, kind, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_leaves(getattr(obj, f.name), kind, fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj
