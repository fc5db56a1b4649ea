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
- Start (tether.rollout.ray_start): a cluster address that does not answer fails within
  `run.start_timeout`; so does placement (one placement group reserves every worker's
  resources, spread over the nodes), naming what each worker asks for and what the cluster
  has. The process start and the engine build are not bounded: a line says every 30 s
  which worker is still starting, and a build that fails stops the run with its own error.
  An earlier driver's actors of the same run (a killed driver's, before Ray ends them)
  are killed first, so a resumed run finds the resources free.
- Faults: an actor that dies (its pending calls raise `RayActorError`; its node lost, say)
  is replaced by a new actor with the same index in the same bundle (which Ray reserves
  again on a surviving node), offered the newest version, and each of its in-flight
  items is returned as `Lost` (ledger: dropped `worker_died`, issued again). A worker
  that keeps dying (`MAX_RESTARTS`) or raises stops the run with its error. A node that
  joins mid-run hosts only such re-reserved bundles: the worker count is fixed at start.
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
from tether.rollout.ray_start import Startup, release, reserve, sweep
from tether.rollout.worker import BatchResult, RolloutEngine, WorkItem
from tether.setup import actor_config
from tether.weights.publisher import DeltaSender, DeltaWeights, HeldWeights, PackedWeights, pack

try:
    import ray
    from ray.exceptions import RayActorError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # the config check names the extra first; this is the fallback
    raise ImportError("loop.backend=ray needs Ray: pip install -e '.[ray]'") from e

MAX_RESTARTS = 3  # per worker: an engine that cannot even start is not retried forever
# Ray starts its workers at nice 15 so that its driver stays responsive. Here the workers
# are the run's throughput: beside any process at nice 0 (another training on a shared
# node, CI) a nice-15 actor gets about 3% of a core, and took 6 minutes to import its
# modules on this 2-core machine with both cores busy. A local Ray runs them at nice 0.
LOCAL_RAY_CONFIG = {"worker_niceness": 0}


def actor_name(run_name: str, driver_pid: int, index: int, restart: int = 0) -> str:
    """The Ray name of worker `index`'s actor: unique per run directory and driver process,
    and per replacement (`restart` > 0)."""
    return f"tether-{run_name}-{driver_pid}-rollout-{index}" + (f".{restart}" if restart else "")


class RolloutActor:
    """A rollout worker in a Ray actor: an engine, the newest weights offered to it, and
    batches made on request. Placed empty; `ready` answers once its process is up, `build`
    makes the engine (calls to an actor run in order, so every `make` comes after both)."""

    def __init__(self, index: int, cfg: Config, model_path: str):
        self.index, self.cfg, self.model_path = index, cfg, model_path
        self.engine: RolloutEngine | None = None
        self.offered: tuple[int, list[Any]] | None = None  # (version, [[(version, ref), ...]])
        self.held = HeldWeights(cfg.loop.worker_threads)  # the newest version fetched
        self.idle_since = time.perf_counter()

    def ready(self) -> int:
        """Answers once the actor's process is up (its resources were reserved before), with
        the process's niceness (Ray's `worker_niceness`; see `LOCAL_RAY_CONFIG`)."""
        return os.nice(0)

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
        self.group = None
        try:
            sweep(run_name, os.getpid())
            self.group = reserve(cfg, f"tether-{run_name}-{os.getpid()}", cfg.run.start_timeout)
            self.startup = Startup(cfg, self.group)
            self.actors = [self._start(i) for i in range(cfg.loop.workers)]
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
        """Worker `index`'s actor, in its bundle of the placement group: its process start and
        engine build are followed by `Startup.poll`."""
        actor = self.remote_cls.options(
            name=actor_name(self.run_name, os.getpid(), index, restart),
            num_cpus=self.cfg.loop.worker_cpus, num_gpus=self.cfg.loop.worker_gpus,
            max_restarts=0,  # replaced by the driver, which knows which items were lost
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index),
        ).remote(index, actor_config(self.cfg), self.model_path)
        self.startup.add(index, actor)
        return actor

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
        """What came back within `timeout` seconds; first, how the actors still starting
        fare (`Startup.poll`: a failed build raises its own error before the batches it
        failed; an actor that died starting is replaced)."""
        if not self.pending:
            time.sleep(timeout)
            self._poll_startup()
            return []
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        self._poll_startup()
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

    def _poll_startup(self) -> None:
        for index, cause in self.startup.poll():
            self._restart(index, cause)

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
        if self.group is not None:
            release(self.group)
            self.group = None
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
        ray.init(address="local", include_dashboard=False, _system_config=LOCAL_RAY_CONFIG)
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
