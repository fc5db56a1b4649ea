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
- `weights.publish=delta`: after the first version, each goes as an exact XOR delta
  against the one before (`DeltaSender`, tether.weights.delta), and a worker applies every
  one in order to its own copy (`HeldWeights`): fewer bytes to move, more CPU on both
  sides, one more copy of the weights on each (docs/scale.md).
"""

from __future__ import annotations

import queue as queue_lib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tether.weights.delta import Delta, apply, buckets, encode


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


def pack(version: int, state_dict: dict[str, torch.Tensor], shared: bool = False,
         rounded: frozenset[str] = frozenset(), device: torch.device | None = None) -> PackedWeights:
    """One copy of `state_dict` into a flat buffer, in its order; `shared`: allocated in shared
    memory (moving a filled buffer there would copy the weights a second time); `rounded`:
    names stored in bf16 (copy_ rounds to nearest even, as autocast's cast does); `device`:
    where the buffer lives (default: host memory)."""
    layout, offset = [], 0
    for name, t in state_dict.items():
        dtype = torch.bfloat16 if name in rounded else t.dtype
        n = t.numel() * dtype.itemsize
        layout.append((name, dtype, tuple(t.shape), offset, offset + n))
        offset += -(-n // 8) * 8  # 8-byte aligned: every dtype's view is valid
    buffer = (torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(offset))
              if shared else torch.empty(offset, dtype=torch.uint8, device=device))
    for (name, dtype, shape, a, b), t in zip(layout, state_dict.values()):
        buffer[a:b].view(dtype).view(shape).copy_(t.detach())
    return PackedWeights(version, buffer, tuple(layout))


@dataclass(frozen=True)
class DeltaWeights:
    """Version `version` as an exact delta against `base` (tether.weights.delta)."""

    version: int
    base: int
    delta: Delta


class DeltaSender:
    """The trainer's side of `weights.publish=delta`: each version after the first as an exact
    XOR delta against the one published before it (one packed copy kept to diff against)."""

    def __init__(self, bucket_bytes: int = 64 << 20, level: int = 1, threads: int = 1):
        self.bucket_bytes, self.level, self.threads = bucket_bytes, level, threads
        self.last: PackedWeights | None = None

    def message(self, version: int, state_dict: dict[str, torch.Tensor],
                shared: bool = False) -> PackedWeights | DeltaWeights:
        """The first version whole (`shared`: in shared memory), then deltas."""
        if self.last is None:
            self.last = pack(version, state_dict, shared)
            return self.last
        packed = pack(version, state_dict)
        parts = buckets(packed.layout, self.bucket_bytes)
        out = DeltaWeights(version, self.last.version,
                           encode(packed.buffer, self.last.buffer, parts, self.level, self.threads))
        self.last = packed
        return out


class HeldWeights:
    """A worker's side of `weights.publish=delta`: its own copy of the newest version it was
    sent, to which each delta is applied in order (every one, loaded into the engine or not)."""

    def __init__(self, threads: int = 1):
        self.threads = threads
        self.held: PackedWeights | None = None
        self.owned = False  # the buffer is this process's to modify (not the sender's)

    @property
    def version(self) -> int:
        return -1 if self.held is None else self.held.version

    def take(self, message: PackedWeights | DeltaWeights) -> PackedWeights:
        if isinstance(message, PackedWeights):
            self.held, self.owned = message, False
            return message
        if self.held is None or self.held.version != message.base:
            raise RuntimeError(f"weight delta {message.base} -> {message.version} does not apply "
                               f"to the held version {self.version}")
        buf = self.held.buffer if self.owned else self.held.buffer.clone()
        apply(message.delta, buf, out=buf, threads=self.threads)
        self.held, self.owned = PackedWeights(message.version, buf, self.held.layout), True
        return self.held


def message_bytes(message: PackedWeights | DeltaWeights) -> int:
    return message.delta.nbytes if isinstance(message, DeltaWeights) else message.buffer.numel()


class SharedMemoryPublisher:
    """Sends each published version to every worker's weight queue (a torch.multiprocessing
    queue, which passes the shared buffer by file descriptor, not by value).

    `delta` (`weights.publish=delta`): after the first version, each is sent as an exact
    delta against the one before (`DeltaSender`; its compressed buckets go by value), which
    every worker applies in order (`HeldWeights`). `last_bytes`: what the newest publish
    sent to each worker."""

    def __init__(self, queues: list[Any], version: int = -1, delta: bool = False,
                 bucket_bytes: int = 64 << 20, level: int = 1, threads: int = 1):
        self.queues = queues
        self.version = version  # -1: nothing published yet
        self.sender = DeltaSender(bucket_bytes, level, threads) if delta else None
        self.last_bytes = 0

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        message = (self.sender.message(version, state_dict, shared=True) if self.sender
                   else pack(version, state_dict, shared=True))
        for q in self.queues:
            q.put(message)
        self.last_bytes = message_bytes(message)
        self.version = version


class WeightSubscriber:
    """A worker's end: loads the newest version from its queue into its engine (anything
    with `load_weights(state_dict, version)`: a generator, or tether.rollout.worker's
    `RolloutEngine`)."""

    def __init__(self, queue: Any, engine: Any, threads: int = 1):
        self.queue, self.engine = queue, engine
        self.version = -1
        self.held = HeldWeights(threads)

    def poll(self) -> bool:
        """Load the newest version waiting, if newer than the engine's; True if one was loaded."""
        newest = None
        while True:
            try:
                newest = self.held.take(self.queue.get_nowait())
            except queue_lib.Empty:
                break
        return newest is not None and self._load(newest)

    def wait_for(self, version: int, timeout: float = 600.0) -> None:
        """Block until the engine holds `version` or newer (the work item's admission floor)."""
        self.poll()
        while self.version < version:
            self._load(self.held.take(self.queue.get(timeout=timeout)))
            self.poll()

    def _load(self, packed: PackedWeights) -> bool:
        if packed.version <= self.version:
            return False
        self.engine.load_weights(packed.state_dict(), packed.version)
        self.version = packed.version
        return True
