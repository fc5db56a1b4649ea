"""The training loop with vLLM as its rollout engine (skipped where vLLM is not installed)."""

from __future__ import annotations

import pytest

from tether.config import load_config
from tether.logger import read_jsonl
from tether.loops import train
from tether.rollout.vllm_engine import INSTALL_HINT, vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason=INSTALL_HINT)


def test_countdown_run_with_vllm_raises_reward(warm_model_dir, tmp_path):
    cfg = load_config("configs/countdown.yaml", [
        "rollout.engine=vllm", "rollout.precision=bf16", f"model.path={warm_model_dir}",
        f"run.dir={tmp_path / 'run'}", "train.steps=12", "task.train_size=32", "train.lr=5e-4",
        "eval.every=0", "eval.samples=0", "run.progress=false",
    ])
    result = train(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    assert sum(result.rewards[-3:]) / 3 > sum(result.rewards[:3]) / 3 + 0.05
    # bf16 kernels against the fp32 trainer: a small, nonzero numerical mismatch every step.
    assert all(0 < r["numerical/k3_kl/mean"] < 1e-2 for r in rows)
    assert all(r["generator_version"] == r["version"] for r in rows)  # synced every step
