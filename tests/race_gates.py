"""Gates that decide the races of the asynchronous tests by construction, not by timing.

A test makes this module the run's reward (`reward.fn`, the public extension point that
runs wherever rewards are computed: the synchronous trainer, every rollout worker
process, every Ray actor). `gate(gate_dir, cfg, ...)` copies the module into `gate_dir`
with its rules beside it (rules.json) and returns the config overrides; the copy reads
its rules and writes its markers in its own directory, so each run has its own gates and
any process can load them by path. The reward itself is the run's task's (built from the
task section in rules.json): training is what it would be without the gates.

Rules (each optional):

- `barrier=N`: a rollout worker's first reward on a training problem waits until N
  distinct workers have reached theirs. No worker can finish a batch before N workers
  each hold one, so N workers make batches.
- `hold=ID`: the first process to reward problem ID (e.g. "countdown-train-12") writes
  the marker `held` (its identity: the Ray actor's name, or the process name and pid)
  and waits until the test writes `release` (without one: until it is killed). Later
  calls, in any process (the rest of its group, a re-issued attempt, a resumed run), pass.
- `hold_node=NODE` (Ray): like `hold`, for the first training problem rewarded by an
  actor on the Ray node whose id (hex) is NODE: a node to kill holds prompts.
- `hold_build=true` (Ray): each actor's engine build, where it imports this module, writes
  `building-<actor>` and waits until the test writes `release-build`: a build that lasts
  as long as the test wants.
- `switch_slot=S` (loop.partial, local rollout workers): the worker making slot S, at its
  first decode-step boundary, writes `mid-batch` and waits for a newer weight version,
  which it loads before sampling the rest of the batch: weights land mid-batch. Done by
  patching `RolloutEngine.make` in the worker process when the module is imported there
  (the reward module is imported in each worker as its engine is built).

Waiting here and in the tests is polling a file with no deadline; the hang guards are the
tests' (a subprocess's exit, `communicate(timeout=...)`) and `reward.timeout` (a reward
call blocked past it scores 0 and the run goes on).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GATE = Path(__file__).resolve().parent  # the copy's directory: its rules and markers
TIMEOUT = 600.0  # reward.timeout under gates: only a hang guard
POLL_S = 0.01


def gate(gate_dir: Path, cfg: Any, **rules: Any) -> list[str]:
    """Copy this module into `gate_dir` with `rules`; the overrides that make it the reward
    of a run whose config is `cfg` (its task section is what the reward computes)."""
    gate_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(__file__, gate_dir / "race_gates.py")
    (gate_dir / "rules.json").write_text(json.dumps({"task": cfg.task.model_dump(mode="json"),
                                                     **rules}))
    return [f"reward.fn={gate_dir / 'race_gates.py'}:reward", f"reward.timeout={TIMEOUT}"]


def wait_until(done: Callable[[], bool], alive: Callable[[], bool]) -> bool:
    """Poll until `done()` (True), or until `alive()` turns False first (False): no deadline."""
    while not done():
        if not alive():
            return done()
        time.sleep(POLL_S)
    return True


@contextmanager
def beside(act: Callable[[Callable[[], bool]], None]) -> Iterator[None]:
    """Run `act(running)` in a thread while the body (a run) runs; `running()` turns False
    when the body ends, so an act waiting on a gate the run never reached ends too."""
    finished = threading.Event()
    thread = threading.Thread(target=act, args=(lambda: not finished.is_set(),), daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()


def tether_train(*args: str) -> subprocess.Popen:
    """`tether train ARGS` in a child process (one torch thread), its output captured."""
    return subprocess.Popen([sys.executable, "-m", "tether.cli", "train", *args],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def outpace_training(monkeypatch: Any) -> None:
    """Generation outpaces training, by construction: the trainer (in this process) takes its
    next batch only once every batch issued has arrived, so a whole window is sampled before
    the first of it trains."""
    from tether.loops import async_loop

    real_next_batch = async_loop._next_batch

    def next_batch_when_all_arrived(sched: Any, backend: Any, trainer_version: int) -> Any:
        while len(sched.ready) < len(sched.outstanding):
            for event in backend.receive(timeout=1.0):
                sched.take(event, trainer_version)
        return real_next_batch(sched, backend, trainer_version)

    monkeypatch.setattr(async_loop, "_next_batch", next_batch_when_all_arrived)


def lines(path: Path) -> int:
    """Complete lines in a file being appended to (0 while it does not exist)."""
    return path.read_text().count("\n") if path.is_file() else 0


# -- the copy's side: the reward and the rules -----------------------------------------------

_task = None


def _rules() -> dict[str, Any]:
    return json.loads((GATE / "rules.json").read_text())


def reward(problem: Any, response: str) -> Any:
    """The task's reward, after the gates this call meets."""
    global _task
    rules = _rules()
    if _task is None:
        from tether.config import Config
        from tether.tasks import task_from_config

        _task = task_from_config(Config.model_validate({"task": rules["task"]}).task)
    if "-train-" in problem.id:  # held-out problems (evaluation, monitor) pass
        if rules.get("barrier") and (worker := _rollout_worker()) is not None:
            _barrier(worker, rules["barrier"])
        if problem.id == rules.get("hold") or (
                rules.get("hold_node") and _ray_actor() and _node() == rules["hold_node"]):
            _hold()
    return _task.reward(problem, response)


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _rollout_worker() -> str | None:
    """'rollout-I' (Ray: 'rollout-I[.R]', R a replacement) in a rollout worker; None in the
    trainer's process."""
    name = multiprocessing.current_process().name  # a local worker: tether-rollout-I
    if name.startswith("tether-rollout-"):
        return name.removeprefix("tether-")
    actor = _ray_actor()  # tether-<run>-<driver pid>-rollout-I[.R]
    return actor[actor.index("rollout-"):] if actor and "-rollout-" in actor else None


def _ray_actor() -> str | None:
    if "ray" not in sys.modules or multiprocessing.current_process().name != "MainProcess":
        return None
    import ray

    return ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None


def _barrier(worker: str, n: int) -> None:
    (GATE / f"worker-{worker}").touch()
    while len(list(GATE.glob("worker-*"))) < n:
        time.sleep(POLL_S)


def _hold() -> None:
    """The first caller claims `held` atomically (with its identity in it) and waits."""
    me = _ray_actor() or f"{multiprocessing.current_process().name} {os.getpid()}"
    tmp = GATE / f".held-{os.getpid()}"
    tmp.write_text(me)
    try:
        os.link(tmp, GATE / "held")  # fails if it exists: one holder, ever
    except FileExistsError:
        return
    finally:
        tmp.unlink()
    while not (GATE / "release").exists():
        time.sleep(POLL_S)


def _install_switch(slot: int) -> None:
    """In a local rollout worker: slot `slot` takes a newer version at its first decode-step
    boundary (`refresh` is the worker's `WeightSubscriber.poll`)."""
    from tether.rollout import worker

    make = worker.RolloutEngine.make

    def make_switching(self: Any, item: Any, idle_s: float, refresh: Any = None) -> Any:
        if item.slot != slot or refresh is None:
            return make(self, item, idle_s, refresh)
        subscriber, first = refresh.__self__, [True]

        def switch() -> bool:
            if not first[0]:
                return refresh()
            first[0] = False
            (GATE / "mid-batch").write_text(str(subscriber.version))
            subscriber.wait_for(subscriber.version + 1)  # the trainer publishes it next
            return True

        return make(self, item, idle_s, switch)

    worker.RolloutEngine.make = make_switching


if (GATE / "rules.json").exists() and multiprocessing.current_process().name.startswith(
        "tether-rollout-") and "switch_slot" in _rules():
    _install_switch(_rules()["switch_slot"])
if (GATE / "rules.json").exists() and _rules().get("hold_build") and (_actor := _ray_actor()):
    (GATE / f"building-{_actor}").touch()
    while not (GATE / "release-build").exists():
        time.sleep(POLL_S)


def kill_rank_1_before(monkeypatch: Any, step: int) -> None:
    """Trainer rank 1 (a process of this one) SIGKILLed and reaped as the synchronous loop's
    `step`-th training step (1-based) starts, so rank 0 finds it gone at a known point."""
    from tether.loops import sync_loop

    real_train_step, calls = sync_loop.train_step, []

    def train_step(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == step:
            rank = next(p for p in multiprocessing.active_children() if p.name == "tether-rank-1")
            rank.kill()
            rank.join()
        return real_train_step(*args, **kwargs)

    monkeypatch.setattr(sync_loop, "train_step", train_step)
