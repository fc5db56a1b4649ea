"""Where the asynchronous loop's rollout workers run: `loop.backend`.

The loop (tether.loops.async_loop) talks to its workers through one narrow interface,
`RolloutBackend`: submit a work item, receive what came back, publish a weight version,
stop. Two implementations:

- `LocalBackend` (`local`, the default): worker processes on this machine
  (`worker_main`), a shared task queue, weights through shared memory. A worker that dies
  stops the run, naming it.
- `RayBackend` (`ray`, tether.rollout.ray_backend): one Ray actor per worker, on this
  machine or a cluster; weights through the Ray object store. A worker that dies is
  replaced and its in-flight items come back as `Lost`, so the scheduler drops them
  (ledger reason `worker_died`) and issues their prompts again.

Ray is imported only by `RayBackend`, so the default path never needs it.
"""

from __future__ import annotations

import os
import queue as queue_lib
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from tether.config import Config
from tether.rollout.worker import BatchResult, WorkItem, worker_main
from tether.weights.publisher import SharedMemoryPublisher


@dataclass(frozen=True)
class Lost:
    """A work item whose worker died before returning it: drop it and issue it again."""

    item: WorkItem
    worker: int
    reason: str  # a ledger drop reason (tether.ledger.DROP_REASONS)


class RolloutBackend(Protocol):
    version: int  # the newest published weight version (-1: none yet)
    published_bytes: int  # what the newest publish sent to each worker

    def submit(self, item: WorkItem) -> None:
        """Hand a work item to the workers; it comes back through `receive`."""
        ...

    def receive(self, timeout: float) -> list[BatchResult | Lost]:
        """What arrived within `timeout` seconds (possibly nothing)."""
        ...

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Make `state_dict` version `version` for every worker; the caller may modify its
        tensors afterwards."""
        ...

    def stop(self) -> None:
        """End the workers (work not yet started is abandoned: the ledger dropped it)."""
        ...


def build_backend(cfg: Config, model_path: str, run_name: str) -> RolloutBackend:
    """`loop.workers` workers on `loop.backend`, each building its engine from `model_path`
    (started in parallel with whatever the trainer does next)."""
    if cfg.loop.backend == "ray":
        from tether.rollout.ray_backend import RayBackend

        return RayBackend(cfg, model_path, run_name)
    return LocalBackend(cfg, model_path)


class LocalBackend:
    """Worker processes on this machine (`spawn`: fork would copy torch's thread pools),
    one shared task queue, one weight queue per worker (shared memory, docs/async.md)."""

    def __init__(self, cfg: Config, model_path: str):
        ctx = torch.multiprocessing.get_context("spawn")
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        weight_queues = [ctx.Queue() for _ in range(cfg.loop.workers)]
        w = cfg.weights
        self.publisher = SharedMemoryPublisher(weight_queues, delta=w.publish == "delta",
                                               bucket_bytes=w.bucket_mb << 20, level=w.zstd_level,
                                               threads=w.delta_threads)
        self.workers = [ctx.Process(target=worker_main, daemon=True, name=f"tether-rollout-{i}",
                                    args=(i, cfg, model_path, os.getpid(), self.tasks,
                                          self.results, weight_queues[i]))
                        for i in range(cfg.loop.workers)]
        for w in self.workers:
            w.start()

    @property
    def version(self) -> int:
        return self.publisher.version

    @property
    def published_bytes(self) -> int:
        return self.publisher.last_bytes

    def submit(self, item: WorkItem) -> None:
        self.tasks.put(item)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        self.publisher.publish(version, state_dict)

    def receive(self, timeout: float) -> list[BatchResult | Lost]:
        """A batch, or nothing; a worker that died stops the run (it is not restarted)."""
        try:
            return [self.results.get(timeout=timeout)]
        except queue_lib.Empty:
            dead = [w.name for w in self.workers if not w.is_alive()]
            if dead:
                raise RuntimeError(f"rollout worker(s) {', '.join(dead)} exited unexpectedly "
                                   f"(exit codes {[w.exitcode for w in self.workers]})") from None
            return []

    def stop(self) -> None:
        """Tell each worker to stop after its batch; end those that do not within a few seconds."""
        while True:  # work not yet taken was dropped (ledger): nobody should start it
            try:
                self.tasks.get_nowait()
            except queue_lib.Empty:
                break
        for _ in self.workers:
            self.tasks.put(None)
        deadline = time.monotonic() + 5.0
        for w in self.workers:
            w.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                w.terminate()
                w.join()
        # Versions a worker never read can fill its pipe; at exit a queue's feeder thread
        # would then wait forever to write them (seen: an async cell that hung after done).
        for q in [self.tasks, *self.publisher.queues]:
            q.cancel_join_thread()
