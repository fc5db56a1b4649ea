"""Nothing lost: a run killed with SIGKILL resumes from its last checkpoint bit for bit.

The end-to-end test runs `tether train` twice in subprocesses on the warm tiny model: once
straight through, once killed at a fixed step after its first checkpoint (held there by
its reward, tests/race_gates.py, so the kill lands at that step and no other) and resumed
with `--resume`. Every metrics row but the time/* keys must be equal. The run uses an
fp8 generator lagging one version and two optimizer steps per batch, so the checkpoint
must carry a kept snapshot, the optimizer moments, the sync state and the versions.
The unit tests below check the pieces: the pickle-free codec, atomic writes and pruning,
a damaged checkpoint, and the resume rules for overrides.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.race_gates import gate, lines, wait_until
from tether.checkpoint import (
    RunState,
    _decode,
    _Encoder,
    checkpoint_due,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    trim_metrics,
)
from tether.config import ConfigError, TrainConfig, load_config
from tether.logger import read_jsonl
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.trainer import Trainer
from tether.weights import parse_sync_policy
from tether.weights.publisher import InProcessPublisher
from tether.weights.snapshots import SnapshotStore
from tether.weights.synchronizer import Synchronizer

STEPS = 8
RUN = [
    "run.threads=1", "run.progress=false", "run.checkpoint_every=2", "run.keep_checkpoints=2",
    f"train.steps={STEPS}", "train.lr=1e-3", "train.minibatches=2",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=10",
    "rollout.precision=fp8", "sync.lag=1",
    "weights.snapshot_compress=xor",  # the kept versions go through the checkpoint as deltas
    "task.name=countdown", "task.eval_size=16", "eval.every=4", "eval.batch_size=16",
    "diagnostics.monitor_every=3", "diagnostics.monitor_prompts=2",
]
# The killed run dies while generating step KILL_AFTER + 1: after step 5, its checkpoint
# (every 2 steps) is a step behind, so a logged row is trimmed and re-run, and the rest
# spans an evaluation (step 8) and a monitor step (6). TETHER_KILL_AFTER=k (3..7) picks another.
KILL_AFTER = int(os.environ.get("TETHER_KILL_AFTER", "5"))


def _train(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tether.cli", "train", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_jsonl(run_dir / "metrics.jsonl")]


def test_killed_run_resumes_bit_identical(warm_model_dir, tmp_path):
    assert 3 <= KILL_AFTER < STEPS
    common = [f"model.path={warm_model_dir}", *RUN]
    cfg = load_config(None, common)
    # Both runs reward through the same gate module (tests/race_gates.py); only the killed
    # one's holds: at step KILL_AFTER + 1's first problem, steps up to KILL_AFTER logged and
    # checkpointed.
    straight = _train(*common, f"run.dir={tmp_path / 'straight'}",
                      *gate(tmp_path / "gate-straight", cfg))
    killed_dir, gate_dir = tmp_path / "killed", tmp_path / "gate-killed"
    hold = f"countdown-train-{KILL_AFTER * 4}"  # 4 prompts a step
    victim = _train(*common, f"run.dir={killed_dir}", *gate(gate_dir, cfg, hold=hold))
    metrics = killed_dir / "metrics.jsonl"
    assert wait_until((gate_dir / "held").exists, lambda: victim.poll() is None), \
        f"run ended before the kill: {victim.communicate()[1][-2000:]}"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    ckpt_step = list_checkpoints(killed_dir)[-1][0]
    rows_at_kill = lines(metrics) - 1
    assert victim.returncode == -signal.SIGKILL
    assert rows_at_kill == KILL_AFTER and ckpt_step == KILL_AFTER // 2 * 2

    resumed = _train("--resume", str(killed_dir))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "Traceback" not in err
    _, err = straight.communicate(timeout=300)
    assert straight.returncode == 0, err[-2000:]

    a, b = _rows(tmp_path / "straight"), _rows(killed_dir)
    print(f"killed after step {rows_at_kill}, last checkpoint step {ckpt_step}; "
          f"{STEPS - ckpt_step} steps re-run, {len(b[0])}-{len(b[-1])} keys per row compared")
    assert [r["step"] for r in b] == list(range(STEPS + 1))  # every step logged exactly once
    for row_a, row_b in zip(a, b):
        assert row_a == row_b, f"step {row_a['step']} differs"
    # Two optimizer steps per batch; the lagged generator holds the previous batch's weights.
    assert b[-1]["version"] == 2 * STEPS and b[-1]["generator_version"] == 2 * STEPS - 2


def test_sigterm_stops_after_the_step_with_a_checkpoint(warm_model_dir, tmp_path):
    args = [f"model.path={warm_model_dir}", *RUN[:2], "run.checkpoint_every=0", "train.steps=50",
            "rollout.prompts_per_step=2", "rollout.group_size=2", "task.name=countdown",
            "task.eval_size=4", "eval.every=0"]
    # The run holds in step 3's reward (problem 4, 2 prompts a step) until the signal is sent.
    gate_dir = tmp_path / "gate"
    run = _train(*args, f"run.dir={tmp_path / 'run'}",
                 *gate(gate_dir, load_config(None, args), hold="countdown-train-4"))
    assert wait_until((gate_dir / "held").exists, lambda: run.poll() is None), \
        run.communicate()[1][-2000:]
    run.send_signal(signal.SIGTERM)
    (gate_dir / "release").touch()
    _, err = run.communicate(timeout=120)
    last = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"]
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert f"stopped by SIGTERM after step {last}; a checkpoint was saved" in err
    assert "Traceback" not in err
    assert last == 3 and [s for s, _ in list_checkpoints(tmp_path / "run")] == [last]


# --- the pieces ----------------------------------------------------------------------------


def test_codec_round_trips_types_without_pickle(monkeypatch):
    tied = torch.randn(3, 2)
    tree = {
        "model": {"embed": tied, "lm_head": tied, "scalar": torch.tensor(3.0)},
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.ones(2)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "uint8": torch.get_rng_state(),
        "nested": [None, True, "$not-a-tag", {"$odd": 1}],
    }
    enc = _Encoder()
    meta = json.loads(json.dumps(enc.encode(tree, "")))  # what state.json holds
    assert len(enc.tensors) == 6  # the tied tensor is stored once
    monkeypatch.setattr(pickle, "loads", None)  # decoding must not need pickle
    back = _decode(meta, enc.tensors)
    assert back["model"]["embed"] is back["model"]["lm_head"]
    assert torch.equal(back["model"]["embed"], tied)
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert list(back["optimizer"]["state"]) == [0]
    assert back["python"] == tree["python"]
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    assert back["numpy"][1].dtype == np.uint32 and np.array_equal(back["numpy"][1], tree["numpy"][1])
    assert back["nested"] == tree["nested"]


def _state(model) -> RunState:
    sampling = SamplingParams(n=2, max_new_tokens=4)
    trainer = Trainer(model, TrainConfig(lr=1e-2), sampling)
    generator = HFGenerator(model, 1, 0, "bf16")
    sync = Synchronizer(parse_sync_policy("every:1"), InProcessPublisher(generator),
                        SnapshotStore(model), model.state_dict(), lag=1)
    return RunState(trainer, sync)


def test_checkpoint_restores_every_part(tokenizer, tmp_path):
    from tether.models import build_tiny_model

    model = build_tiny_model(len(tokenizer), seed=1)
    state = _state(model)
    # Two optimizer steps on a stand-in loss, a lagged delivery, one skipped step, RNG use.
    for _ in range(2):
        state.trainer.optimizer.zero_grad()
        model(torch.tensor([[2, 3, 4]])).logits.square().mean().backward()
        state.trainer.optimizer.step()
        state.trainer.version += 1
        state.sync.after_step(state.trainer.version - 1, state.trainer.version,
                              model.state_dict(), None)
    state.trainer.guard.record("logp")
    torch.rand(3)
    save_checkpoint(tmp_path, 2, state, keep=2)
    expected_rand = torch.rand(5)

    fresh = _state(build_tiny_model(len(tokenizer), seed=1))
    assert load_checkpoint(tmp_path, fresh) == 2
    assert torch.equal(torch.rand(5), expected_rand)  # the RNG continues where it was saved
    t0, t1 = state.trainer, fresh.trainer
    assert t1.version == t0.version == 2 and t1.guard.state_dict() == t0.guard.state_dict()
    for k, v in t0.model.state_dict().items():
        assert torch.equal(v, t1.model.state_dict()[k]), k
    s0, s1 = t0.optimizer.state_dict(), t1.optimizer.state_dict()
    assert s0["param_groups"] == s1["param_groups"]
    for i, st in s0["state"].items():
        for k, v in st.items():
            assert torch.equal(v, s1["state"][i][k]), (i, k)
    assert fresh.sync.snapshots.versions == state.sync.snapshots.versions == [1, 2]
    assert fresh.sync.generator_version == state.sync.generator_version == 1
    for k, v in state.sync.publisher.generator.model.state_dict().items():  # bf16 weights of version 1
        assert torch.equal(v, fresh.sync.publisher.generator.model.state_dict()[k]), k


def test_saves_are_atomic_and_pruned(tokenizer, random_model, tmp_path):
    state = _state(random_model)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-00000003-killed").mkdir(parents=True)  # a save killed half-way
    (root / ".tmp-step-00000003-killed" / "state.json").write_text("{")
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, state, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000004"]
    assert sorted(p.name for p in (root / "step-00000004").iterdir()) == [
        "state.json", "state.safetensors"]
    assert (checkpoint_due(4, 2, 9), checkpoint_due(5, 2, 9), checkpoint_due(9, 2, 9),
            checkpoint_due(3, 0, 9)) == (True, False, True, False)


def test_a_damaged_checkpoint_is_named(random_model, tmp_path):
    state = _state(random_model)
    ckpt = save_checkpoint(tmp_path, 1, state, keep=1)
    (ckpt / "state.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="step-00000001 cannot be read.*remove that directory"):
        load_checkpoint(tmp_path, state)


def test_resume_trims_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "rew')
    trim_metrics(path, 3)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3]


def test_resume_refuses_trajectory_changes(tmp_path):
    from tether.checkpoint import resume_config
    from tether.config import dump_config, load_config

    (tmp_path / "config.yaml").write_text(dump_config(load_config(None, ["train.steps=4"])))
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    cfg = resume_config(tmp_path, ["train.steps=10", "eval.every=1", "run.checkpoint_every=1"])
    assert (cfg.train.steps, cfg.eval.every, cfg.run.dir) == (10, 1, str(tmp_path))
    with pytest.raises(ConfigError, match="train.lr cannot change when resuming"):
        resume_config(tmp_path, ["train.lr=0.5"])
    with pytest.raises(ConfigError, match="past train.steps=1"):
        resume_config(tmp_path, ["train.steps=1"])
