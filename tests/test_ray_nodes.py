"""Node-level faults on a real two-node Ray cluster on this machine: a head and a second node
(ray.cluster_utils, as Ray's own multi-node tests do: two raylets, one CPU each). Each rollout
worker reserves half a CPU, so the placement group's SPREAD puts one on each node and the
head has room for a replacement.

- The second node's raylet is SIGKILLed while its actor holds prompts (race_gates'
  hold_node): the run finishes on the head, the lost prompts dropped as `worker_died` and
  trained on a later attempt.
- The driver of a run on the cluster (`loop.ray_address`) is SIGKILLed mid-run: `--resume`
  joins the same cluster and finishes, every prompt trained once, and no actor of the
  first driver remains.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.race_gates import beside, gate, lines, wait_until
from tether.config import load_config
from tether.ledger import audit
from tether.loops import train

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from tether.rollout.ray_backend import LOCAL_RAY_CONFIG

ASYNC = ["run.progress=false", "run.threads=1", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=12", "task.eval_size=16",
         "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0", "loop.mode=async",
         "loop.backend=ray", "loop.workers=2", "loop.worker_cpus=0.5", "loop.max_staleness=2",
         "train.lr=1e-3"]


@pytest.fixture
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "_system_config": LOCAL_RAY_CONFIG})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster, second
    finally:
        ray.shutdown()
        cluster.shutdown()


def _actors_of(driver_pid: int) -> list[str]:
    """Named actors alive on the cluster that the driver with this pid started."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if f"-{driver_pid}-rollout-" in a["name"]]


def test_a_lost_node_is_survived(two_nodes, warm_model_dir, tmp_path):
    cluster, second = two_nodes
    steps, run_dir, gate_dir = 8, tmp_path / "run", tmp_path / "gate"
    args = [f"model.path={warm_model_dir}", f"run.dir={run_dir}", *ASYNC, f"train.steps={steps}"]
    cfg = load_config("configs/countdown.yaml", args)
    cfg = load_config("configs/countdown.yaml",
                      [*args, *gate(gate_dir, cfg, hold_node=second.node_id)])
    killed, nodes = [], []

    def kill_the_second_node(running):
        if wait_until((gate_dir / "held").exists, running):
            groups = ray.util.placement_group_table().values()
            nodes.extend(g["bundles_to_node_id"].values() for g in groups if g["state"] == "CREATED")
            killed.append((gate_dir / "held").read_text())
            second.all_processes["raylet"][0].process.send_signal(signal.SIGKILL)

    with beside(kill_the_second_node):
        train(cfg)
    assert len(killed) == 1 and "-rollout-" in killed[0]  # an actor on the second node held
    assert [sorted(n) for n in nodes] == [sorted([cluster.head_node.node_id, second.node_id])]
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems
    assert a.open == [] and a.trained == steps * 4 and a.awaiting_reissue == []
    assert a.dropped["worker_died"] > 0 and set(a.dropped) == {"worker_died"}
    events = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    died = {(e["prompt"], e["attempt"]) for e in events if e.get("reason") == "worker_died"}
    trained = {e["prompt"]: e["attempt"] for e in events if e["event"] == "trained"}
    assert all(trained[prompt] > attempt for prompt, attempt in died)


def test_a_killed_driver_resumes_on_the_same_cluster(two_nodes, warm_model_dir, tmp_path):
    cluster, _ = two_nodes
    steps, run_dir, gate_dir = 6, tmp_path / "run", tmp_path / "gate"
    args = [f"model.path={warm_model_dir}", f"run.dir={run_dir}", *ASYNC, f"train.steps={steps}",
            f"loop.ray_address={cluster.address}", "run.checkpoint_every=1"]
    # Slot 3 (problems 12..15) is held until the driver is killed: steps 1..2 are trained
    # and checkpointed by then, and the actors hold prompts.
    args += gate(gate_dir, load_config("configs/countdown.yaml", args), hold="countdown-train-12")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def tether(*a: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tether.cli", "train", *a], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = tether("--config", "configs/countdown.yaml", *args)
    started = wait_until(lambda: (gate_dir / "held").exists()
                         and lines(run_dir / "metrics.jsonl") >= 3, lambda: first.poll() is None)
    assert started, first.communicate()[1][-2000:]
    assert len(_actors_of(first.pid)) == 2
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    (gate_dir / "release").touch()

    resumed = tether("--resume", str(run_dir))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems
    assert a.open == [] and a.trained == steps * 4 and a.awaiting_reissue == []
    assert set(a.dropped) <= {"in_flight_at_stop"}
    assert _actors_of(first.pid) == [] and _actors_of(resumed.pid) == []
    # What the runs reserved is free again (Ray frees a dead driver's in seconds).
    for _ in range(300):  # a hang guard only
        if ray.available_resources().get("CPU") == 2.0 and not any(
                g["state"] == "CREATED" for g in placement_group_table().values()):
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0
