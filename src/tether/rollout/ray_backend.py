"""`loop.backend=ray`: each rollout worker a Ray actor, weights through the object store.

Imported only when the config asks for Ray (tether.rollout.backend.build_backend), so
`import tether` and the local backend never import ray.

- Placement: one actor per worker (`loop.workers`), each reserving `loop.worker_cpus`
  CPUs and `loop.worker_gpus` GPUs, placed by Ray on any node of the cluster
  (`loop.ray_address`: None starts a local Ray with this machine's CPUs; `auto` joins the
  cluster this machine belongs to). The trainer stays in the driver.
- Work: the driver hands each work item to the actor with the fewest items pending (an
  actor runs its calls one at a time, in the order they were made).
- Weights: a published version is packed once into one flat buffer and put into the
  object store once (`ray.put`); every actor is offered its reference, and fetches it
  (zero-copy on the actor's node after one transfer per node) only when it starts a
  batch and the offer is newer than what its engine holds. Because calls to an actor run
  in order, an item submitted after a publish is sampled with that version or newer.
- Faults: an actor that dies (its pending calls raise `RayActorError`) is replaced by a
  new actor with the same index, offered the newest version, and each of its in-flight
  items is returned as `Lost` (ledger: dropped `worker_died`, issued again). A worker
  that keeps dying (`MAX_RESTARTS`) or raises stops the run with its error.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import torch

from tether.config import Config
from tether.rollout.backend import Lost
from tether.rollout.worker import BatchResult, RolloutEngine, WorkItem
from tether.weights.publisher import PackedWeights, pack

try:
    import ray
    from ray.exceptions import RayActorError
except ImportError as e:  # the config check names the extra first; this is the fallback
    raise ImportError("loop.backend=ray needs Ray: pip install -e '.[ray]'") from e

MAX_RESTARTS = 3  # per worker: an engine that cannot even start is not retried forever


def actor_name(run_name: str, driver_pid: int, index: int, restart: int = 0) -> str:
    """The Ray name of worker `index`'s actor: unique per run directory and driver process,
    and per replacement (`restart` > 0)."""
    return f"tether-{run_name}-{driver_pid}-rollout-{index}" + (f".{restart}" if restart else "")


class RolloutActor:
    """A rollout worker in a Ray actor: an engine, the newest weights offered to it, and
    batches made on request."""

    def __init__(self, index: int, cfg: Config, model_path: str):
        self.engine = RolloutEngine(index, cfg, model_path)
        self.offered: tuple[int, list[Any]] | None = None  # (version, [object ref])
        self.idle_since = time.perf_counter()

    def offer(self, version: int, ref: list[Any]) -> None:
        """A newer version exists (the reference is boxed in a list so Ray does not fetch it
        now: only the newest offer is ever fetched)."""
        if self.offered is None or version > self.offered[0]:
            self.offered = (version, ref)

    def make(self, item: WorkItem) -> BatchResult:
        """Load the newest version offered (if newer than the engine's), then the batch."""
        engine = self.engine
        if self.offered is not None and self.offered[0] > engine.version:
            version, layout, buffer = ray.get(self.offered[1][0])
            with warnings.catch_warnings():  # the object store's buffer is read-only; the
                warnings.simplefilter("ignore")  # engine copies it into its own weights
                packed = PackedWeights(version, torch.from_numpy(buffer), layout)
            engine.load_weights(packed.state_dict(), version)
        # Calls run in order and the publish an item's min_version names preceded the item.
        if engine.version < item.min_version:
            raise RuntimeError(f"worker {engine.index} holds version {engine.version} "
                               f"< the item's min_version {item.min_version}")
        result = self.engine.make(item, time.perf_counter() - self.idle_since)
        self.idle_since = time.perf_counter()
        return result


class RayBackend:
    """The driver's side: actors, the calls pending on them, the newest published version."""

    def __init__(self, cfg: Config, model_path: str, run_name: str):
        self.started_ray = not ray.is_initialized()
        if self.started_ray:  # else: the caller's Ray (a test, a notebook) is used as is
            # "local": a new Ray on this machine even where `ray start` left one running.
            ray.init(address=cfg.loop.ray_address or "local", include_dashboard=False)
        self.cfg, self.model_path = cfg, model_path
        self.run_name = run_name
        self.remote_cls = ray.remote(RolloutActor)
        self.actors = [self._start(i) for i in range(cfg.loop.workers)]
        self.restarts = [0] * cfg.loop.workers
        self.pending: dict[Any, tuple[int, Any, WorkItem]] = {}  # ref -> (index, actor, item)
        self.version, self.weights = -1, None  # the newest version and its object ref

    def _start(self, index: int, restart: int = 0) -> Any:
        return self.remote_cls.options(
            name=actor_name(self.run_name, os.getpid(), index, restart), num_cpus=self.cfg.loop.worker_cpus, num_gpus=self.cfg.loop.worker_gpus,
            max_restarts=0,  # replaced by the driver, which knows which items were lost
        ).remote(index, self.cfg, self.model_path)

    def submit(self, item: WorkItem) -> None:
        load = [0] * len(self.actors)
        for i, _, _ in self.pending.values():
            load[i] += 1
        i = min(range(len(self.actors)), key=load.__getitem__)
        self.pending[self.actors[i].make.remote(item)] = (i, self.actors[i], item)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        packed = pack(version, state_dict)
        self.weights = ray.put((version, packed.layout, packed.buffer.numpy()))
        for actor in self.actors:
            actor.offer.remote(version, [self.weights])
        self.version = version

    def receive(self, timeout: float) -> list[BatchResult | Lost]:
        if not self.pending:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        out: list[BatchResult | Lost] = []
        for ref in ready:
            index, actor, item = self.pending.pop(ref)
            try:
                out.append(ray.get(ref))  # a worker's exception propagates: the run stops
            except RayActorError as e:
                if self.actors[index] is actor:  # its first lost call: replace it once
                    self._restart(index, e)
                out.append(Lost(item, index, "worker_died"))
        return out

    def _restart(self, index: int, cause: Exception) -> None:
        self.restarts[index] += 1
        if self.restarts[index] > MAX_RESTARTS:
            raise RuntimeError(f"rollout worker {index} died {self.restarts[index]} times; "
                               f"last: {cause}") from cause
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._start(index, self.restarts[index])
        if self.weights is not None:
            self.actors[index].offer.remote(self.version, [self.weights])

    def stop(self) -> None:
        """Kill the actors (what they were making was dropped in the ledger); shut Ray down
        if this backend started it."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.pending.clear()
        if self.started_ray:
            ray.shutdown()
