"""`loop.backend=ray`: rollout workers as Ray actors on a local Ray the test starts (2 CPUs,
2 workers), every prompt accounted for in the ledger, and a worker killed mid-run by its
handle: replaced, its prompts dropped as `worker_died` and trained on their next attempt."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tether.config import ConfigError, load_config
from tether.ledger import audit
from tether.logger import read_jsonl
from tether.loops import train

ray = pytest.importorskip("ray")

ASYNC = ["run.progress=false", "run.threads=1", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=12", "task.eval_size=16",
         "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0", "loop.mode=async",
         "loop.backend=ray", "loop.workers=2", "loop.max_staleness=2", "train.lr=1e-3"]


@pytest.fixture(scope="module")
def local_ray():
    # "local": a new Ray even where a `ray start` cluster runs (or left its address behind)
    ray.init(address="local", num_cpus=2, include_dashboard=False)
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
    assert {r["async/worker"] for r in rows} == {0.0, 1.0}  # both actors made batches
    assert max(r["numerical/abs_log_ratio/max"] for r in rows) < 1e-4  # fp32 weights arrived intact


def test_killed_worker_is_replaced_and_its_prompts_reissued(local_ray, warm_model_dir, tmp_path):
    from tether.rollout.ray_backend import actor_name

    steps = 8
    ledger = tmp_path / "ledger.jsonl"
    killed, finished = threading.Event(), threading.Event()

    def kill_worker_0_after_first_step():
        # Watches until the run ends, not for a fixed time: on a loaded machine the actors
        # took over 2 minutes to reach the first trained step.
        while not finished.is_set():
            if ledger.exists() and '"trained"' in ledger.read_text():
                ray.kill(ray.get_actor(actor_name(tmp_path.name, os.getpid(), 0)))
                killed.set()
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_worker_0_after_first_step, daemon=True)
    killer.start()
    try:
        train(_cfg(warm_model_dir, tmp_path, f"train.steps={steps}"))
    finally:
        finished.set()
    killer.join()
    assert killed.is_set()
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
