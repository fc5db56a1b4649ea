"""How `loop.backend=ray` starts its actors: three phases, each waited for on its own.

1. **Placement** (`reserve`), bounded by `run.start_timeout`: one placement group holds a
   bundle of `loop.worker_cpus` CPUs and `loop.worker_gpus` GPUs per worker, spread over
   the nodes (Ray's SPREAD strategy). The group is ready when Ray has reserved every
   bundle, before any process starts, so a busy machine's slow imports are not counted.
   A group not ready in time is removed and the run fails naming what each worker asks
   for, what the cluster has free and in all: resources this run holds are never blamed.
2. **Process start** (`RolloutActor.ready`) and 3. **engine build** (`RolloutActor.build`:
   the model and the engine loaded, which takes minutes on loaded cores), not bounded:
   `Startup.poll` says which worker is still in which phase every `PROGRESS_EVERY`
   seconds, and a build that fails raises its own error at once, naming the worker.

A replacement actor (its predecessor died, e.g. with its node) goes into the same bundle;
when the bundle's node is gone Ray reserves it on a surviving node, and a bundle that
finds no room within `run.start_timeout` fails the run the same way (placement).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from tether.config import Config
from tether.errors import EnvironmentFault, InputError

PROGRESS_EVERY = 30.0  # seconds between the lines saying a worker is still starting


def reserve(cfg: Config, name: str, timeout: float) -> PlacementGroup:
    """A placement group of `loop.workers` bundles, ready within `timeout` seconds, or an
    EnvironmentFault naming the phase (placement) and what the cluster reports."""
    c = cfg.loop
    bundle = {"CPU": c.worker_cpus, **({"GPU": c.worker_gpus} if c.worker_gpus else {})}
    group = placement_group([bundle] * c.workers, strategy="SPREAD", name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        release(group)
        raise placement_fault(cfg, list(range(c.workers)), timeout)
    return group


def release(group: PlacementGroup, wait_s: float = 30.0) -> None:
    """Remove `group` and wait (up to `wait_s`) until Ray has freed its resources: removal
    is asynchronous, and the next run on the same Ray (a resume, a notebook's next cell)
    would otherwise find them still held."""
    remove_placement_group(group)
    deadline = time.monotonic() + wait_s
    while placement_group_table(group).get("state") != "REMOVED" and time.monotonic() < deadline:
        time.sleep(0.05)


def placement_fault(cfg: Config, workers: list[int], timeout: float) -> EnvironmentFault:
    c = cfg.loop
    return EnvironmentFault(
        f"placement: rollout worker actor(s) {workers} not started within {timeout:g} s "
        f"(run.start_timeout): each asks Ray for {c.worker_cpus:g} CPU and {c.worker_gpus:g} "
        f"GPU (loop.worker_cpus, loop.worker_gpus), and the cluster has {resources(free=True)} "
        f"free of {resources(free=False)} in all; lower them, or add nodes")


def resources(free: bool) -> dict[str, float]:
    """What the cluster has free now (or in all), of CPUs and GPUs."""
    have = ray.available_resources() if free else ray.cluster_resources()
    return {k: have.get(k, 0.0) for k in ("CPU", "GPU")}


def bundle_placed(group: PlacementGroup) -> bool:
    """Every bundle of `group` holds its resources on a live node (not being rescheduled)."""
    return placement_group_table(group).get("state") == "CREATED"


@dataclass
class Starting:
    """One actor between its creation and its engine's end of build."""

    ready: Any  # the ObjectRef of RolloutActor.ready: the process is up
    build: Any  # the ObjectRef of RolloutActor.build: the engine is built
    since: float = field(default_factory=time.monotonic)
    up: bool = False  # `ready` answered
    reported: float = field(default_factory=time.monotonic)


class Startup:
    """The actors still starting, by worker index; `poll` advances and reports them."""

    def __init__(self, cfg: Config, group: PlacementGroup):
        self.cfg, self.group = cfg, group
        self.starting: dict[int, Starting] = {}
        self.told_niceness = False

    def add(self, index: int, actor: Any) -> None:
        self.starting[index] = Starting(actor.ready.remote(), actor.build.remote())

    def poll(self) -> list[tuple[int, RayActorError]]:
        """Advance every starting actor without waiting. Raise a failed build's own error;
        return (index, error) of each actor that died starting (its node lost, say), for the
        caller to replace; print a line for each still starting every `PROGRESS_EVERY` s.
        An actor whose bundle lost its node waits for Ray to reserve it again, bounded by
        `run.start_timeout` (placement)."""
        died = []
        now = time.monotonic()
        for index, s in list(self.starting.items()):
            done, _ = ray.wait([s.ready, s.build], num_returns=2, timeout=0)
            try:
                if s.ready in done and not s.up:
                    self._check_niceness(index, ray.get(s.ready))
                    s.up = True
                if s.build in done:
                    ray.get(s.build)
                    del self.starting[index]
                    continue
            except RayActorError as e:
                del self.starting[index]
                died.append((index, e))
                continue
            except RayTaskError as e:
                raise build_error(index, e) from None
            if not s.up and not bundle_placed(self.group) \
                    and now - s.since > self.cfg.run.start_timeout:
                raise placement_fault(self.cfg, [index], self.cfg.run.start_timeout)
            if now - s.reported >= PROGRESS_EVERY:
                s.reported = now
                phase = "building its engine" if s.up else "starting its process"
                print(f"tether: rollout worker {index} still {phase}, {now - s.since:.0f} s after "
                      "it was placed (not bounded by run.start_timeout)", file=sys.stderr,
                      flush=True)
        return died

    def _check_niceness(self, index: int, niceness: int) -> None:
        """Say once that a joined cluster runs its workers niced (Ray's default 15): any
        busy process on their node then takes their CPU first."""
        if niceness > 0 and not self.told_niceness:
            self.told_niceness = True
            print(f"tether: rollout worker {index} runs at nice {niceness} (the cluster's "
                  "worker_niceness): other processes on its node take its CPU first; start "
                  "the cluster with RAY_worker_niceness=0 ray start ... to give it a full "
                  "share", file=sys.stderr, flush=True)


def build_error(index: int, e: RayTaskError) -> Exception:
    """The error an actor's engine build raised, as the run reports it: tether's own input
    and environment errors keep their type (and exit status), anything else carries the
    actor's traceback."""
    cause = e.cause
    where = f"rollout worker {index} (a Ray actor) could not build its engine"
    if isinstance(cause, (InputError, EnvironmentFault)):
        return type(cause)(f"{where}: {cause}")
    return RuntimeError(f"{where}:\n{e}")


def sweep(run_name: str, driver_pid: int) -> list[str]:
    """Kill the actors an earlier driver of this run left on the cluster (a driver killed
    with SIGKILL: Ray ends a dead driver's actors itself, a few seconds later); return their
    names."""
    prefix = f"tether-{run_name}-"
    left = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix) and not a["name"].startswith(f"{prefix}{driver_pid}-")]
    for name, namespace in left:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # gone meanwhile
            pass
    return [name for name, _ in left]
