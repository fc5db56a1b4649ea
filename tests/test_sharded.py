"""The sharded trainer (`train.sharding=fsdp`) against the replicated one, end to end.

- Two FSDP ranks train the run two replicated ranks train: every row of metrics, pi_old of
  every token (scored at sharded kept versions, sync.lag) and the final weights bit for bit
  at the same thread count, dense fp32 and MoE bf16; one process on the whole batch agrees
  to float rounding.
- A rank SIGKILLed mid-run stops it with its last checkpoint, which resumes at one rank and
  at four (torch.distributed.checkpoint reshards it) and finishes as the uninterrupted run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.race_gates import kill_rank_1_before
from tether.checkpoint import list_checkpoints, resume_config
from tether.config import ConfigError, load_config
from tether.errors import RankFailed
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


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)}
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


def test_a_sharded_run_refuses_what_it_does_not_run_yet():
    with pytest.raises(ConfigError, match="train.sharding=fsdp with loop.mode=async"):
        load_config("configs/countdown.yaml", ["train.sharding=fsdp", "loop.mode=async"])
