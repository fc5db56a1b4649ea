"""The sharded trainer (`train.sharding=fsdp`) against the replicated one, end to end.

- Two FSDP ranks train the run two replicated ranks train: every row of metrics, pi_old of
  every token (scored at sharded kept versions, sync.lag) and the final weights bit for bit
  at the same thread count, dense fp32 and MoE bf16; one process on the whole batch agrees
  to float rounding.
- Two "nodes" (two torchrun invocations on this machine, one rank each) train with async
  rollouts from two workers, every prompt trained once, the replicated run bit for bit; a
  node's rank SIGKILLed stops the run, which resumes on one rank.
- A rank SIGKILLed mid-run stops it with its last checkpoint, which resumes at one rank and
  at four (torch.distributed.checkpoint reshards it) and finishes as the uninterrupted run.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.race_gates import kill_rank_1_before, wait_until
from tether.checkpoint import list_checkpoints, resume_config
from tether.config import ConfigError, load_config
from tether.errors import RankFailed
from tether.ledger import audit
from tether.logger import read_jsonl
from tether.loops import train

STEPS = 5
# Two sums the sharded trainer takes in another order: the gradient norm (shard by shard,
# then over ranks), so clipping would scale the two runs' gradients by factors a few ulps
# apart; and with several micro-batches a rank's gradient (reduce-scattered after each,
# docs/distributed.md). With a bound no gradient reaches and one micro-batch per rank (8
# rows), what remains is the same function. Diagnostics that read a whole trainer model
# are off under fsdp, so off in both.
SETTINGS = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
            "train.micro_batch=8", "train.lr=1e-4", "run.threads=1", "train.grad_clip=1e6",
            "task.eval_size=16", "eval.every=0", "eval.samples=0", "run.progress=false",
            "diagnostics.monitor_every=0", "diagnostics.routing=false",
            "log.dump_logprobs=true", f"train.steps={STEPS}"]
NOT_COMPARED = ("time/", "snapshots/bytes", "train/grad_norm")


def _run(model_dir: Path, run_dir: Path, sharding: str, world_size: int, *extra: str) -> Path:
    train(load_config("configs/countdown.yaml",
                      [f"model.path={model_dir}", f"run.dir={run_dir}", f"train.sharding={sharding}",
                       f"train.world_size={world_size}", *SETTINGS, *extra]))
    return run_dir


def _rows(run_dir: Path, *ignored: str) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith((*NOT_COMPARED, *ignored))}
            for row in read_jsonl(run_dir / "metrics.jsonl")]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def dense_fsdp(warm_model_dir, tmp_path_factory) -> Path:
    """Two FSDP ranks, pi_old from kept versions four behind (sync.lag=4), a checkpoint
    every step."""
    return _run(warm_model_dir, tmp_path_factory.mktemp("fsdp") / "run", "fsdp", 2,
                "sync.lag=4", "run.checkpoint_every=1")


@pytest.mark.parametrize("moe", [False, True], ids=["dense-fp32-lag4", "moe-bf16-lag2"])
def test_two_sharded_ranks_train_the_run_two_replicated_ranks_train(
        moe, dense_fsdp, warm_model_dir, random_moe_dir, tmp_path):
    if moe:
        extra = ["sync.lag=2", "train.precision=bf16", "rollout.precision=bf16"]
        sharded = _run(random_moe_dir, tmp_path / "fsdp", "fsdp", 2, *extra)
        model_dir = random_moe_dir
    else:
        extra = ["sync.lag=4", "run.checkpoint_every=1"]
        sharded, model_dir = dense_fsdp, warm_model_dir
    replicated = _run(model_dir, tmp_path / "replicated", "none", 2, *extra)
    assert _rows(sharded) == _rows(replicated)
    # pi_old of every token, and what the generator sampled with, bit for bit.
    assert (sharded / "logprobs.jsonl").read_text() == (replicated / "logprobs.jsonl").read_text()
    a, b = _weights(sharded), _weights(replicated)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for row_a, row_b in zip(read_jsonl(sharded / "metrics.jsonl")[1:],
                            read_jsonl(replicated / "metrics.jsonl")[1:], strict=True):
        assert row_a["train/grad_norm"] == pytest.approx(row_b["train/grad_norm"], rel=1e-6)
        # Each rank keeps its half of every version (rows split in two, the odd row on rank 0).
        assert row_a["snapshots/bytes"] <= 0.51 * row_b["snapshots/bytes"]
    if moe:
        return
    # One process on the whole batch: the same run up to float rounding (each rank sums its
    # own tokens, and micro-batches cut their own padding), as docs/distributed.md bounds it.
    single = _run(model_dir, tmp_path / "single", "none", 1, *extra)
    _close(sharded, single)


def _close(run_dir: Path, reference: Path) -> None:
    """Loss per step to 1e-6 and final weights to 1e-6: the replicated trainer's own bounds
    (tests/test_distributed.py)."""
    rows, ref = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(STEPS + 1))
    for a, b in zip(rows[1:], ref[1:], strict=True):
        assert a["loss/total"] == pytest.approx(b["loss/total"], abs=1e-6), a["step"]
        assert a["reward/mean"] == b["reward/mean"], a["step"]  # the same samples
    w, v = _weights(run_dir), _weights(reference)
    assert max((w[k] - v[k]).abs().max().item() for k in w) < 1e-6


def _nodes(run_dir: Path, model_dir: Path, *extra: str) -> list[subprocess.Popen]:
    """Two torchrun invocations on this machine, node 1 then node 0, one rank each (node 0's
    is rank 0, which runs the loop), meeting through torchrun's rendezvous."""
    args = ["--config", "configs/countdown.yaml", f"model.path={model_dir}", f"run.dir={run_dir}",
            "train.sharding=fsdp", "train.world_size=2", *SETTINGS, *extra]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                              "--nproc-per-node=1", f"--node-rank={node}",
                              "--master-addr=127.0.0.1", f"--master-port={port}",
                              "-m", "tether.cli", "train", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for node in (1, 0)]


def test_two_nodes_started_by_torchrun_train_the_replicated_async_run(warm_model_dir, tmp_path):
    """Async rollouts, two workers taking turns with the trainer (loop.max_staleness=0: which
    worker samples a batch is a race, what it samples is not; the workers score pi_old),
    on two "nodes": every prompt trained once, and the run is the replicated one's on one
    machine, bit for bit."""
    run_dir, extra = tmp_path / "nodes", ["loop.mode=async", "loop.workers=2",
                                          "loop.max_staleness=0", "loop.window_min=0",
                                          "train.steps=4"]
    for node in _nodes(run_dir, warm_model_dir, *extra):
        out, _ = node.communicate(timeout=900)
        assert node.returncode == 0, out[-3000:]
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok and a.open == [] and a.trained == 4 * 4, a.problems
    assert (run_dir / "checkpoints" / "step-00000004" / "shards").is_dir()
    replicated = _run(warm_model_dir, tmp_path / "replicated", "none", 2, *extra)
    assert _rows(run_dir, "async/", "worker/") == _rows(replicated, "async/", "worker/")
    assert (run_dir / "logprobs.jsonl").read_text() == (replicated / "logprobs.jsonl").read_text()
    w, v = _weights(run_dir), _weights(replicated)
    assert all(torch.equal(w[k], v[k]) for k in w)


def test_a_killed_node_stops_the_run_and_it_resumes_on_one_rank(warm_model_dir, tmp_path):
    """Node 1's rank SIGKILLed once step 2's checkpoint exists: rank 0, on the other node,
    fails its next collective at once (gloo sees the connection close) and stops naming the
    last checkpoint; a plain `tether train --resume` then finishes the run on one rank."""
    run_dir = tmp_path / "run"
    node1, node0 = _nodes(run_dir, warm_model_dir, "run.checkpoint_every=1")
    assert wait_until(lambda: (run_dir / "checkpoints" / "step-00000002").is_dir(),
                      lambda: node0.poll() is None)
    rank1, = (p for p in psutil.Process(node1.pid).children(recursive=True)
              if "tether.cli" in " ".join(p.cmdline()))
    rank1.kill()
    out, _ = node0.communicate(timeout=900)
    node1.communicate(timeout=900)
    # torchrun exits 1, naming its child's status: 4, RankFailed's.
    assert node0.returncode != 0 and re.search(r"exitcode\s*:\s*4", out), out[-3000:]
    assert "a trainer collective failed" in out and "the last checkpoint is" in out, out[-3000:]
    train(resume_config(run_dir, ["train.world_size=1"]), resume=True)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS + 1))


@pytest.fixture(scope="module")
def killed(warm_model_dir, tmp_path_factory, dense_fsdp) -> Path:
    """The dense run again, rank 1 SIGKILLed as step 4's training starts: it stops with the
    checkpoint of step 3 (a sharded trainer writes none at a fault: every rank writes its
    own shards)."""
    monkeypatch = pytest.MonkeyPatch()
    kill_rank_1_before(monkeypatch, 4)
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    try:
        with pytest.raises(RankFailed, match=r"trainer rank 1 .* died during step 4; .*the last "
                                             r"checkpoint is .*step-00000003"):
            _run(warm_model_dir, run_dir, "fsdp", 2, "sync.lag=4", "run.checkpoint_every=1")
    finally:
        monkeypatch.undo()
    assert list_checkpoints(run_dir)[-1][0] == 3
    return run_dir


@pytest.mark.parametrize("world_size", [1, 4])
def test_killed_run_resumes_at_another_world_size(world_size, killed, dense_fsdp, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    cfg = resume_config(run_dir, [f"train.world_size={world_size}"])
    train(cfg, resume=True)
    _close(run_dir, dense_fsdp)


def test_a_sharded_run_refuses_vllm_in_its_own_process():
    with pytest.raises(ConfigError, match="train.sharding=fsdp with rollout.engine=vllm"):
        load_config("configs/countdown.yaml", ["train.sharding=fsdp", "rollout.engine=vllm"])
    load_config("configs/countdown.yaml", ["train.sharding=fsdp", "rollout.engine=vllm",
                                           "loop.mode=async"])
