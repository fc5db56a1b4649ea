"""Metrics sinks: JSONL (the source of truth), TensorBoard and W&B offline, read back."""

from __future__ import annotations

import glob
import importlib.util
import math
import struct

import pytest

from tether.config import ConfigError, load_config
from tether.logger import JsonlLogger, NullSink, open_logger, read_jsonl
from tether.loops import train

HAS_TB = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None


def test_jsonl_keeps_non_finite_values_visible(tmp_path):
    log = JsonlLogger(tmp_path / "m.jsonl")
    log.log({"step": 1, "loss/total": float("nan"), "x": float("inf"), "y": 0.5})
    assert read_jsonl(tmp_path / "m.jsonl") == [{"step": 1, "loss/total": "nan", "x": "inf", "y": 0.5}]


def test_sinks_that_are_off_are_null(tmp_path):
    log = open_logger(tmp_path)
    assert all(isinstance(s, NullSink) for s in log.sinks)
    log.log({"step": 0, "a": 1.0})
    log.close()
    assert log.path == tmp_path / "metrics.jsonl" and read_jsonl(log.path) == [{"step": 0, "a": 1.0}]


def test_missing_package_fails_at_load_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.wandb=true needs the wandb package: pip install"):
        load_config("configs/countdown.yaml", ["log.wandb=true"])


@pytest.fixture(scope="module")
def short_run(warm_model_dir, tmp_path_factory):
    if not (HAS_TB or HAS_WANDB):
        pytest.skip("neither tensorboard nor wandb is installed")
    run_dir = tmp_path_factory.mktemp("logged")
    cfg = load_config("configs/countdown.yaml", [
        f"model.path={warm_model_dir}", f"run.dir={run_dir}", "train.steps=2",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "task.eval_size=4", "eval.every=0",
        "run.progress=false", "diagnostics.monitor_every=0",
        f"log.tensorboard={str(HAS_TB).lower()}", f"log.wandb={str(HAS_WANDB).lower()}",
    ])
    train(cfg)
    return run_dir, read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.skipif(not HAS_TB, reason="tensorboard is not installed (pip install 'tether[tensorboard]')")
def test_tensorboard_event_file_matches_jsonl(short_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, rows = short_run
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    numeric = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, int | float)}
    assert numeric <= tags
    for key in ("reward/mean", "numerical/k3_kl/mean", "staleness/ess/token", "eval/accuracy"):
        logged = {r["step"]: r[key] for r in rows if key in r}
        read = {e.step: e.value for e in acc.Scalars(key)}
        assert read.keys() == logged.keys()
        assert all(math.isclose(read[s], logged[s], rel_tol=1e-6, abs_tol=1e-12) for s in read)


def _wandb_records(path: str) -> list[bytes]:
    """Records of a .wandb file: a 7-byte file header, then LevelDB log blocks of 32 KiB whose
    records carry a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, header, pos, out, buf = 32768, 7, 7, [], b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if length == 0 and kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk, pos = data[pos + header:pos + header + length], pos + header + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return out


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed (pip install 'tether[wandb]')")
def test_wandb_offline_run_matches_jsonl(short_run):
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir, rows = short_run
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = {}
    for raw in _wandb_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
            history[int(items["_step"])] = items
    assert sorted(history) == [r["step"] for r in rows]
    for r in rows:
        for key in ("reward/mean", "numerical/k3_kl/mean", "eval/accuracy"):
            if key in r:
                assert float(history[r["step"]][key]) == pytest.approx(r[key], rel=1e-9, abs=1e-15)
