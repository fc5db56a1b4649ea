"""Publishing weight versions to rollout engines: version v is published, engines load it.

A published version is immutable: publishing copies the weights out of the trainer's
tensors (into the in-process engine's own, or into one shared buffer), so the trainer
goes on updating its own, and an engine loads a version whole, between batches or,
under partial rollouts, between decode steps.

- `InProcessPublisher`: the engine lives in the trainer's process (the synchronous loop);
  publishing is `generator.load_weights`.
- `SharedMemoryPublisher` / `WeightSubscriber`: rollout worker processes on one machine.
  A version is packed into one flat shared-memory byte buffer (one file descriptor,
  whatever the number of tensors) and sent to every worker's weight queue; the worker
  drains its queue to the newest version and copies it into its engine. The buffer is
  freed when the last process drops it.
"""

from __future__ import annotations

import queue as queue_lib
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Publisher(Protocol):
    version: int  # the newest published version (what an engine loads next)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Publish `state_dict` as `version`; the caller may modify its tensors afterwards."""
        ...


class InProcessPublisher:
    """An engine in this process: publishing loads the weights into it at once."""

    def __init__(self, generator: Any):
        self.generator = generator

    @property
    def version(self) -> int:
        return self.generator.version

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        self.generator.load_weights(state_dict, version)


@dataclass(frozen=True)
class PackedWeights:
    """One version as a flat byte buffer and where each tensor lies in it."""

    version: int
    buffer: torch.Tensor  # (nbytes,) uint8, in shared memory
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # name, dtype, shape, start, end

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Views into the buffer (no copy); an engine copies them into its own weights."""
        return {name: self.buffer[a:b].view(dtype).view(shape)
                for name, dtype, shape, a, b in self.layout}


def pack(version: int, state_dict: dict[str, torch.Tensor], shared: bool = False) -> PackedWeights:
    """One copy of `state_dict` into a flat host buffer; `shared`: allocated in shared memory
    (moving a filled buffer there would copy the weights a second time)."""
    layout, offset = [], 0
    for name, t in state_dict.items():
        n = t.numel() * t.element_size()
        layout.append((name, t.dtype, tuple(t.shape), offset, offset + n))
        offset += n
    buffer = (torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(offset))
              if shared else torch.empty(offset, dtype=torch.uint8))
    for (_, _, _, a, b), t in zip(layout, state_dict.values()):
        buffer[a:b] = t.detach().contiguous().view(-1).view(torch.uint8)
    return PackedWeights(version, buffer, tuple(layout))


class SharedMemoryPublisher:
    """Sends each published version to every worker's weight queue (a torch.multiprocessing
    queue, which passes the shared buffer by file descriptor, not by value)."""

    def __init__(self, queues: list[Any], version: int = -1):
        self.queues = queues
        self.version = version  # -1: nothing published yet

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        packed = pack(version, state_dict, shared=True)
        for q in self.queues:
            q.put(packed)
        self.version = version


class WeightSubscriber:
    """A worker's end: loads the newest version from its queue into its engine (anything
    with `load_weights(state_dict, version)`: a generator, or tether.rollout.worker's
    `RolloutEngine`)."""

    def __init__(self, queue: Any, engine: Any):
        self.queue, self.engine = queue, engine
        self.version = -1

    def poll(self) -> bool:
        """Load the newest version waiting, if newer than the engine's; True if one was loaded."""
        newest = None
        while True:
            try:
                newest = self.queue.get_nowait()
            except queue_lib.Empty:
                break
        return newest is not None and self._load(newest)

    def wait_for(self, version: int, timeout: float = 600.0) -> None:
        """Block until the engine holds `version` or newer (the work item's admission floor)."""
        self.poll()
        while self.version < version:
            self._load(self.queue.get(timeout=timeout))
            self.poll()

    def _load(self, packed: PackedWeights) -> bool:
        if packed.version <= self.version:
            return False
        self.engine.load_weights(packed.state_dict(), packed.version)
        self.version = packed.version
        return True
