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
  batch and the offer is newer than what its engine holds. With `weights.publish=delta`
  the object store holds the last whole version and the exact deltas after it; an actor
  fetches only the deltas newer than the version it holds. Because calls to an actor run
  in order, an item submitted after a publish is sampled with that version or newer.
- Start: a cluster address that does not answer, or an actor Ray cannot place (no node
  with the resources it asks for), fails within `run.start_timeout` with an
  `EnvironmentFault` naming the key to check. An actor is placed first and builds its
  engine after (`build`), so the bound never counts a long model load.
- Faults: an actor that dies (its pending calls raise `RayActorError`) is replaced by a
  new actor with the same index, offered the newest version, and each of its in-flight
  items is returned as `Lost` (ledger: dropped `worker_died`, issued again). A worker
  that keeps dying (`MAX_RESTARTS`) or raises stops the run with its error.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import warnings
from typing import Any

import torch

from tether.config import Config
from tether.errors import EnvironmentFault, InputError
from tether.models import quiet_transformers
from tether.rollout.backend import Lost
from tether.rollout.worker import BatchResult, RolloutEngine, WorkItem
from tether.setup import actor_config
from tether.weights.publisher import DeltaSender, DeltaWeights, HeldWeights, PackedWeights, pack

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
    batches made on request. Placed empty; `build` makes the engine (calls to an actor run
    in order, so every `make` comes after it)."""

    def __init__(self, index: int, cfg: Config, model_path: str):
        self.index, self.cfg, self.model_path = index, cfg, model_path
        self.engine: RolloutEngine | None = None
        self.offered: tuple[int, list[Any]] | None = None  # (version, [[(version, ref), ...]])
        self.held = HeldWeights(cfg.loop.worker_threads)  # the newest version fetched
        self.idle_since = time.perf_counter()

    def ready(self) -> None:
        """Answers once the actor is placed and its process is up."""

    def build(self) -> None:
        quiet_transformers()
        self.engine = RolloutEngine(self.index, self.cfg, self.model_path)
        self.engine.announce()
        self.idle_since = time.perf_counter()

    def offer(self, version: int, refs: list[Any]) -> None:
        """A newer version exists: `refs` are the whole version, or (weights.publish=delta)
        the last whole one then the deltas after it, as (version, reference) pairs; boxed in
        a list so Ray fetches none now: only the newest offer is fetched, and of a chain
        only what this actor does not hold."""
        if self.offered is None or version > self.offered[0]:
            self.offered = (version, refs)

    def make(self, item: WorkItem) -> BatchResult:
        """Load the newest version offered (if newer than the engine's), then the batch."""
        engine = self.engine
        if engine is None:
            raise RuntimeError(f"worker {self.index}'s engine failed to build (see its error)")
        if self.offered is not None and self.offered[0] > engine.version:
            packed = self._fetch(self.offered[1][0])
            engine.load_weights(packed.state_dict(), packed.version)
        # Calls run in order and the publish an item's min_version names preceded the item.
        if engine.version < item.min_version:
            raise RuntimeError(f"worker {engine.index} holds version {engine.version} "
                               f"< the item's min_version {item.min_version}")
        result = self.engine.make(item, time.perf_counter() - self.idle_since)
        self.idle_since = time.perf_counter()
        return result

    def _fetch(self, refs: list[tuple[int, Any]]) -> PackedWeights:
        """The newest version in `refs`: the whole one (unless this actor holds it or a later
        one of the chain), then each delta newer than what it holds, applied in order."""
        (first, whole), *deltas = refs
        if self.held.version < first or self.held.version > refs[-1][0]:
            version, layout, buffer = ray.get(whole)
            with warnings.catch_warnings():  # the object store's buffer is read-only: the
                warnings.simplefilter("ignore")  # engine copies it, HeldWeights clones it
                self.held.take(PackedWeights(version, torch.from_numpy(buffer), layout))
        for version, ref in deltas:
            if version > self.held.version:
                self.held.take(ray.get(ref))
        assert self.held.held is not None
        return self.held.held


class RayBackend:
    """The driver's side: actors, the calls pending on them, the newest published version."""

    def __init__(self, cfg: Config, model_path: str, run_name: str):
        self.started_ray = not ray.is_initialized()
        if self.started_ray:  # else: the caller's Ray (a test, a notebook) is used as is
            connect(cfg.loop.ray_address, cfg.run.start_timeout)
        self.cfg, self.model_path = cfg, model_path
        self.run_name = run_name
        self.remote_cls = ray.remote(RolloutActor)
        self.actors: list[Any] = []
        self.pending: dict[Any, tuple[int, Any, WorkItem]] = {}  # ref -> (index, actor, item)
        try:
            self.actors = [self._start(i) for i in range(cfg.loop.workers)]
            self._await_placed(cfg.run.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.restarts = [0] * cfg.loop.workers
        self.version = -1  # the newest published version
        # What an actor needs for it: [(version, ref)], the whole version, then with
        # weights.publish=delta the deltas since it (chain_bytes of them).
        self.weights: list[tuple[int, Any]] = []
        w = cfg.weights
        self.sender = (DeltaSender(w.bucket_mb << 20, w.zstd_level, w.delta_threads)
                       if w.publish == "delta" else None)
        self.published_bytes = self.whole_bytes = self.chain_bytes = 0

    def _start(self, index: int, restart: int = 0) -> Any:
        actor = self.remote_cls.options(
            name=actor_name(self.run_name, os.getpid(), index, restart),
            num_cpus=self.cfg.loop.worker_cpus, num_gpus=self.cfg.loop.worker_gpus,
            max_restarts=0,  # replaced by the driver, which knows which items were lost
        ).remote(index, actor_config(self.cfg), self.model_path)
        actor.build.remote()  # its error, if any, comes back with the first batch
        return actor

    def _await_placed(self, timeout: float) -> None:
        """Every actor placed within `timeout` seconds, or an EnvironmentFault saying what
        each asked for and what the cluster has free."""
        waiting = {actor.ready.remote(): i for i, actor in enumerate(self.actors)}
        ready, late = ray.wait(list(waiting), num_returns=len(waiting), timeout=timeout)
        ray.get(ready)  # an actor that died starting raises here
        if late:
            c = self.cfg.loop
            raise EnvironmentFault(
                f"rollout worker actor(s) {sorted(waiting[r] for r in late)} not started within "
                f"{timeout:g} s (run.start_timeout): each asks Ray for {c.worker_cpus:g} CPU and "
                f"{c.worker_gpus:g} GPU (loop.worker_cpus, loop.worker_gpus), and the cluster "
                f"has {_free()} free; lower them, or add nodes")

    def submit(self, item: WorkItem) -> None:
        load = [0] * len(self.actors)
        for i, _, _ in self.pending.values():
            load[i] += 1
        i = min(range(len(self.actors)), key=load.__getitem__)
        self.pending[self.actors[i].make.remote(item)] = (i, self.actors[i], item)

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """One `ray.put` of the version (whole, or with weights.publish=delta its delta
        against the version before: a new whole one when the deltas since the last whole
        one would outweigh it), offered to every actor."""
        message = self.sender.message(version, state_dict) if self.sender else pack(version, state_dict)
        if isinstance(message, DeltaWeights) and self.chain_bytes + message.delta.nbytes < self.whole_bytes:
            self.weights.append((version, ray.put(message)))
            self.chain_bytes += message.delta.nbytes
            self.published_bytes = message.delta.nbytes
        else:
            if isinstance(message, DeltaWeights):  # the chain is as heavy as a whole version
                message = self.sender.last
            self.weights = [(version, ray.put((version, message.layout, message.buffer.numpy())))]
            self.published_bytes = self.whole_bytes = message.buffer.numel()
            self.chain_bytes = 0
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
        if self.weights:
            self.actors[index].offer.remote(self.version, [self.weights])

    def stop(self) -> None:
        """Kill the actors (what they were making was dropped in the ledger); shut Ray down
        if this backend started it (once)."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.pending = [], {}
        if self.started_ray:
            self.started_ray = False
            ray.shutdown()


def connect(address: str | None, timeout: float) -> None:
    """`ray.init` for `loop.ray_address` (None: a new local Ray, even where `ray start` left
    one running), failing within `timeout` seconds, naming the key, where Ray itself would
    retry forever: a host that does not resolve, a port nothing listens on, a listener
    that is not Ray."""
    key = f"loop.ray_address={address}"
    hint = ("check the address `ray start --head` printed (host:port of its GCS, 6379 by "
            "default), or leave loop.ray_address empty for a local Ray")
    if address in (None, "local"):
        # In this thread: Ray ends the processes it starts when the thread that started them ends.
        ray.init(address="local", include_dashboard=False)
        return
    if address != "auto":
        host, port = _host_port(address, key)
        try:
            socket.create_connection((host, port), timeout=min(timeout, 10.0)).close()
        except OSError as e:
            raise EnvironmentFault(f"{key}: cannot reach {host}:{port}: {e}; {hint}") from None
    done: list[BaseException | None] = []

    def join() -> None:  # joining a cluster starts no process here, so a thread may do it
        try:
            ray.init(address=address, include_dashboard=False)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            done.append(e)

    thread = threading.Thread(target=join, daemon=True, name="tether-ray-join")
    thread.start()
    thread.join(timeout)
    if not done:
        raise EnvironmentFault(f"{key}: Ray did not connect within {timeout:g} s "
                               f"(run.start_timeout); {hint}")
    if isinstance(done[0], ConnectionError):
        raise EnvironmentFault(f"{key}: {done[0]}; {hint}") from None
    if done[0] is not None:
        raise done[0]


def _host_port(address: str, key: str) -> tuple[str, int]:
    """host and port of 'host:port', '[v6]:port' or 'ray://host:port' (Ray's client)."""
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise InputError(f"{key}: expected 'auto', 'host:port' or 'ray://host:port'")
    return host.strip("[]"), int(port)


def _free() -> dict[str, float]:
    """What the cluster has free now, of CPUs and GPUs."""
    free = ray.available_resources()
    return {k: free.get(k, 0.0) for k in ("CPU", "GPU")}
