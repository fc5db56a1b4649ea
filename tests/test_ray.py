"""`loop.backend=ray`: rollout workers as Ray actors on a local Ray the test starts (2 CPUs,
2 workers), every prompt accounted for in the ledger, and a worker killed mid-run by its
handle while it provably holds prompts: replaced, its prompts dropped as `worker_died` and
trained on their next attempt."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.race_gates import beside, gate, wait_until
from tether.config import ConfigError, load_config
from tether.errors import EnvironmentFault
from tether.ledger import audit
from tether.logger import read_jsonl
from tether.loops import train

ray = pytest.importorskip("ray")
from tether.rollout.ray_backend import LOCAL_RAY_CONFIG

ASYNC = ["run.progress=false", "run.threads=1", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=12", "task.eval_size=16",
         "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0", "loop.mode=async",
         "loop.backend=ray", "loop.workers=2", "loop.max_staleness=2", "train.lr=1e-3"]


@pytest.fixture(scope="module")
def local_ray():
    # "local": a new Ray even where a `ray start` cluster runs (or left its address behind)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _system_config=LOCAL_RAY_CONFIG)
    yield
    ray.shutdown()


def _cfg(model_dir, run_dir, *extra):
    return load_config("configs/countdown.yaml",
                       [f"model.path={model_dir}", f"run.dir={run_dir}", *ASYNC, *extra])


def test_ray_workers_train_every_prompt_exactly_once(local_ray, warm_model_dir, tmp_path):
    steps = 6
    train(_cfg(warm_model_dir, tmp_path, f"train.steps={steps}"))
    a = audit(tmp_path / "ledger.jsonl")
    assert a.ok, a.problems
    assert a.open == [] and a.trained == steps * 4 and sum(a.dropped.values()) == 0
    assert a.max_staleness <= 2
    rows = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Both actors made batches, by construction: the first admission issues slots 0, 1, 2
    # at once, each to the actor with the fewest pending (0, 1, 0), and the run needs all.
    assert {r["async/worker"] for r in rows} == {0.0, 1.0}
    assert max(r["numerical/abs_log_ratio/max"] for r in rows) < 1e-4  # fp32 weights arrived intact


def test_killed_worker_is_replaced_and_its_prompts_reissued(local_ray, warm_model_dir, tmp_path):
    from tether.rollout.ray_backend import actor_name

    steps, run_dir, gate_dir = 8, tmp_path / "run", tmp_path / "gate"
    ledger = run_dir / "ledger.jsonl"
    # Killed while it holds prompts, by construction: the actor rewarding problem 8 (slot 2,
    # actor 0's second batch: slots 0, 1, 2 go to actors 0, 1, 0) holds it in its reward
    # until killed, and the killer kills it once it holds it. Its replacement and the
    # re-issued attempt pass.
    cfg = _cfg(warm_model_dir, run_dir, f"train.steps={steps}")
    cfg = _cfg(warm_model_dir, run_dir, f"train.steps={steps}",
               *gate(gate_dir, cfg, hold="countdown-train-8"))
    killed, finished = [], threading.Event()

    def kill_the_holder():
        if wait_until((gate_dir / "held").exists, lambda: not finished.is_set()):
            killed.append((gate_dir / "held").read_text())
            ray.kill(ray.get_actor(killed[0]))

    killer = threading.Thread(target=kill_the_holder, daemon=True)
    killer.start()
    try:
        train(cfg)
    finally:
        finished.set()
    killer.join()
    assert killed == [actor_name(run_dir.name, os.getpid(), 0)]
    a = audit(ledger)
    assert a.ok, a.problems
    assert a.open == [] and a.trained == steps * 4  # the run finished, nothing lost
    assert a.awaiting_reissue == []
    assert a.dropped["worker_died"] > 0 and set(a.dropped) == {"worker_died"}
    events = [json.loads(line) for line in ledger.read_text().splitlines()]
    died = {(e["prompt"], e["attempt"]) for e in events if e.get("reason") == "worker_died"}
    trained = {e["prompt"]: e["attempt"] for e in events if e["event"] == "trained"}
    for prompt, attempt in died:  # each killed prompt was trained on a later attempt
        assert trained[prompt] > attempt


def test_default_path_never_imports_ray():
    code = ("import sys, tether, tether.loops.async_loop, tether.rollout.backend; "
            "from tether.config import load_config; load_config('configs/async.yaml'); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_ray_is_named_at_load(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "ray" else real(name))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        load_config("configs/ray.yaml")


def test_config_refuses_ray_where_it_cannot_mean_anything():
    for overrides, culprit in [(["loop.backend=ray"], "loop.mode=async"),
                               (["loop.mode=async", "loop.backend=ray", "loop.partial=true"],
                                "loop.partial")]:
        with pytest.raises(ConfigError, match=culprit):
            load_config("configs/countdown.yaml", overrides)


def test_an_unreachable_address_fails_within_seconds_naming_the_key(warm_model_dir, tmp_path):
    """Ray itself would retry forever ("Failed to connect to GCS ..."): the subprocess timeout
    is the bound. It is not tighter because importing torch, transformers and Ray alone took
    12-30 s on 2 busy cores; the refusal itself comes after no wait (no start_timeout). A new
    process: the module's own Ray must not be there to be reused."""
    run = subprocess.run([sys.executable, "-m", "tether.cli", "train", f"model.path={warm_model_dir}",
                          f"run.dir={tmp_path / 'run'}", *ASYNC, "train.steps=2", "run.start_timeout=600",
                          "loop.ray_address=127.0.0.1:1"], check=False, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 5, run.stderr[-2000:]
    assert run.stderr.startswith("tether train: environment: loop.ray_address=127.0.0.1:1: "
                                 "cannot reach 127.0.0.1:1"), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and not (tmp_path / "run").exists()


def test_an_actor_ray_cannot_place_fails_naming_what_it_asks(local_ray, warm_model_dir, tmp_path):
    """A GPU per worker on a cluster without one: Ray would keep the actor pending forever."""
    cfg = _cfg(warm_model_dir, tmp_path / "run", "train.steps=2", "loop.worker_gpus=1",
               "run.start_timeout=3")
    with pytest.raises(EnvironmentFault, match=r"actor\(s\) \[0, 1\] not started within 3 s "
                       r"\(run.start_timeout\): each asks Ray for 1 CPU and 1 GPU .*'GPU': 0.0"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    assert ray.available_resources().get("CPU") == 2.0  # the pending actors were killed


def test_delta_publishing_reaches_actors_and_their_replacements_bit_for_bit(
        local_ray, warm_model_dir, tmp_path):
    """weights.publish=delta through the object store: an actor that held version 0 applies
    the deltas after it; a replacement actor fetches the whole version and the chain; a new
    whole version replaces the chain once the deltas outweigh it. Each ends holding the
    newest version's bytes exactly."""
    import torch

    from tether.models import load_model
    from tether.rollout.ray_backend import RayBackend
    from tether.rollout.worker import WorkItem
    from tether.weights.publisher import pack

    cfg = _cfg(warm_model_dir, tmp_path, "weights.publish=delta", "loop.workers=1",
               "weights.bucket_mb=1")
    model, _ = load_model(warm_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    backend = RayBackend(cfg, str(warm_model_dir), "delta")

    def held(actor) -> torch.Tensor:
        return ray.get(actor.__ray_call__.remote(lambda a: a.held.held.buffer.clone()))

    def step_and_publish(version: int) -> torch.Tensor:
        x = torch.randint(0, 20, (4, 12))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        backend.publish(version, model.state_dict())
        return pack(version, model.state_dict()).buffer

    def make(slot: int, version: int) -> None:
        backend.submit(WorkItem(slot, (slot,), (0,), version, slot))
        while not backend.receive(timeout=5.0):
            pass

    try:
        backend.publish(0, model.state_dict())
        make(0, 0)
        assert len(backend.weights) == 1  # the whole version 0
        whole, backend.whole_bytes = backend.whole_bytes, 1 << 40  # keep the chain, whatever its size
        newest = [step_and_publish(v) for v in (1, 2, 3)][-1]
        assert [v for v, _ in backend.weights] == [0, 1, 2, 3]
        assert backend.published_bytes < whole / 1.2  # a delta
        make(1, 3)
        assert torch.equal(held(backend.actors[0]), newest)  # applied 1, 2, 3 to its 0
        backend._restart(0, RuntimeError("replaced by the test"))
        make(2, 3)
        assert torch.equal(held(backend.actors[0]), newest)  # whole 0, then 1, 2, 3
        backend.whole_bytes = backend.chain_bytes + 1  # the next delta would outweigh it
        newest = step_and_publish(4)
        assert [v for v, _ in backend.weights] == [4]
        make(3, 4)
        assert torch.equal(held(backend.actors[0]), newest)
    finally:
        backend.stop()


def test_an_engine_build_slower_than_start_timeout_is_not_a_fault(local_ray, warm_model_dir,
                                                                   tmp_path):
    """Placement is bounded by run.start_timeout, the engine build is not: each actor's build
    is held (race_gates' hold_build) until start_timeout has passed since both builds
    began, and the run trains to the end."""
    run_dir, gate_dir, timeout = tmp_path / "run", tmp_path / "gate", 2.0
    cfg = _cfg(warm_model_dir, run_dir, "train.steps=2", f"run.start_timeout={timeout:g}")
    cfg = _cfg(warm_model_dir, run_dir, "train.steps=2", f"run.start_timeout={timeout:g}",
               *gate(gate_dir, cfg, hold_build=True))
    def release_late(running):
        if wait_until(lambda: len(list(gate_dir.glob("building-*"))) == 2, running):
            time.sleep(timeout + 1.0)  # past the bound, on purpose
            (gate_dir / "release-build").touch()

    with beside(release_late):
        train(cfg)
    assert (gate_dir / "release-build").exists()  # the builds were held past the bound
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok and a.trained == 2 * 4, a.problems


def test_an_engine_that_fails_to_build_reports_its_own_error(local_ray, warm_model_dir, tmp_path):
    """A model path only the actors read (the driver never loads it here): the run stops with
    the build's own error, naming the worker, not with a placement timeout; the actors and
    their reserved resources are gone after."""
    from tether.errors import InputError
    from tether.rollout.ray_backend import RayBackend

    cfg = _cfg(warm_model_dir, tmp_path, "run.start_timeout=600")
    backend = RayBackend(cfg, str(tmp_path / "nowhere"), "broken")
    try:
        with pytest.raises(InputError, match=r"rollout worker [01] \(a Ray actor\) could not build "
                           r"its engine: model.path=.*nowhere: not a Hugging Face model directory"):
            for _ in range(600):  # a hang guard only: the error comes in seconds
                backend.receive(timeout=1.0)
    finally:
        backend.stop()
    for _ in range(300):  # a hang guard only: Ray frees killed actors' CPUs in moments
        if ray.available_resources().get("CPU") == 2.0:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0


def test_workers_asking_more_cpus_than_the_cluster_has_fail_placement(local_ray, warm_model_dir,
                                                                      tmp_path):
    cfg = _cfg(warm_model_dir, tmp_path / "run", "train.steps=2", "loop.worker_cpus=3",
               "run.start_timeout=2")
    with pytest.raises(EnvironmentFault, match=r"^placement: rollout worker actor\(s\) \[0, 1\] "
                       r"not started within 2 s \(run.start_timeout\): each asks Ray for 3 CPU "
                       r"and 0 GPU .* the cluster has \{'CPU': 2.0, 'GPU': 0.0\} free of "
                       r"\{'CPU': 2.0, 'GPU': 0.0\} in all"):
        train(cfg)
    assert ray.available_resources().get("CPU") == 2.0
