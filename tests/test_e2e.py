"""End to end on the tiny model: the synchronous loop learns, and the commands run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tether.config import load_config
from tether.logger import read_jsonl
from tether.loops import train
from tether.models import build_char_tokenizer
from tether.tasks import ALPHABET, CountdownTask
from tether.testbed import ensure_default_model
from tether.testbed.warmstart import sft_batch

STEPS = 16


def test_grpo_run_raises_mean_reward(warm_model_dir, tmp_path):
    # A pool of 32 problems seen again and again: the "can it fit?" check, fixed seed.
    cfg = load_config("configs/countdown.yaml", [
        f"model.path={warm_model_dir}", f"run.dir={tmp_path / 'run'}", f"train.steps={STEPS}",
        "task.train_size=32", "train.lr=5e-4", "eval.every=0", "eval.samples=0",
        "run.progress=false",
    ])
    result = train(cfg)
    first, last = result.rewards[:4], result.rewards[-4:]
    print("rewards", [round(r, 3) for r in result.rewards], "acc", result.accuracy_before,
          "->", result.accuracy_after)
    assert sum(last) / 4 > sum(first) / 4 + 0.08
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    for key in ("reward/mean", "time/generate", "time/old_logprob", "time/train", "time/sync",
                "loss/total", "response/length_mean"):
        assert key in rows[1], key
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    # The final checkpoint is a Hugging Face directory in safetensors.
    assert (result.run_dir / "final" / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(result.run_dir / "final")


def _tether(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tether.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_cli_help_config_and_estimators():
    out = _tether("train", "--help")
    assert out.returncode == 0 and "key=value" in out.stdout
    out = _tether("config", "--config", "configs/countdown.yaml", "train.lr=0.01")
    assert out.returncode == 0 and "lr: 0.01" in out.stdout
    out = _tether("config", "--fields")
    assert out.returncode == 0 and "rollout.precision" in out.stdout
    out = _tether("estimators")
    assert out.returncode == 0 and "cis" in out.stdout and "vespo" in out.stdout


def test_cli_bad_config_exits_2_without_traceback():
    out = _tether("train", "--config", "configs/countdown.yaml", "train.lr=-1")
    assert out.returncode == 2
    assert "train.lr" in out.stderr and "Traceback" not in out.stderr


def test_init_model_prints_a_loadable_directory(warm_model_dir):
    # Built already by the fixture: init-model finds it in the cache and prints its path.
    from tests.conftest import TEST_CACHE, TEST_WARMSTART_STEPS

    out = _tether("init-model", f"model.cache_dir={TEST_CACHE}",
                  f"model.warmstart_steps={TEST_WARMSTART_STEPS}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(warm_model_dir)
    assert json.loads((warm_model_dir / "config.json").read_text())["model_type"] == "qwen3"


def test_steps_answer_warm_starts_and_trains(tmp_path, warm_model_dir):
    # answer=expr keeps the key the default models were cached under before the option.
    assert ensure_default_model(warm_model_dir.parent, warmstart_steps=120, verbose=False,
                                task_kwargs={"answer": "expr"}) == warm_model_dir
    # The warm start's targets are step chains: labels = the chain, then eos.
    task = CountdownTask(num_numbers=5, answer="steps", eval_size=4)
    tok = build_char_tokenizer(ALPHABET)
    _, labels = sft_batch(task, tok, 0, 2)
    for i in range(2):
        target = tok.decode([t for t in labels[i].tolist() if t != -100])
        assert target == task.warmstart_problem(i).solution + "<eos>"
        assert task.reward(task.warmstart_problem(i), task.warmstart_problem(i).solution).total == 1.0
    # 3 warm-start steps into a fresh cache, then one RL step on the steps format.
    cfg = load_config("configs/countdown_steps.yaml", [
        f"model.cache_dir={tmp_path / 'models'}", "model.warmstart_steps=3",
        f"run.dir={tmp_path / 'run'}", "train.steps=1", "rollout.prompts_per_step=2",
        "rollout.group_size=2", "task.eval_size=4", "eval.samples=2", "eval.batch_size=4",
        "run.progress=false"])
    result = train(cfg)
    (model_dir,) = [p for p in (tmp_path / "models").iterdir() if p.is_dir()]  # and its .lock
    assert model_dir.name.startswith("tiny-dense-") and model_dir != warm_model_dir
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["version"] == 1
    assert 1 <= rows[1]["response/length_mean"] <= 48
    assert {"eval/accuracy_sampled", "eval/reward_sampled"} <= rows[1].keys()
    assert (result.run_dir / "final" / "model.safetensors").is_file()
    # Three warm-start steps solve nothing: every reward is 0, so every advantage is 0 and the
    # step leaves each weight exactly as it was (no weight decay here).
    assert rows[1]["reward/mean"] == 0.0 and cfg.train.weight_decay == 0
    assert _weight_steps(model_dir, result.run_dir / "final").max() == 0


def _weight_steps(before: Path, after: Path) -> torch.Tensor:
    """|after - before| of every weight, flattened."""
    a, b = (load_file(d / "model.safetensors") for d in (before, after))
    return torch.cat([(b[k] - a[k]).abs().flatten() for k in a])


def test_one_rl_step_is_one_adamw_step_at_the_configured_lr(warm_model_dir, tmp_path):
    cfg = load_config("configs/countdown.yaml", [
        f"model.path={warm_model_dir}", f"run.dir={tmp_path}", "train.steps=1",
        "rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=12",
        "task.eval_size=4", "eval.every=0", "eval.samples=0", "run.progress=false"])
    train(cfg)
    row = read_jsonl(tmp_path / "metrics.jsonl")[1]
    assert 0 < row["reward/mean"] < 1 and row["version"] == 1  # some group has a signal
    # AdamW's first update is lr * g / (|g| + eps) (no weight decay here): every weight moved
    # by lr where |g| >> eps, or not at all (a character no response used keeps its embedding
    # row, a zero gradient). 1% covers fp32 rounding: a weight near 1 has an ulp of 0.12% of lr.
    step = _weight_steps(warm_model_dir, tmp_path / "final")
    moved = step[step > 0]
    lr = cfg.train.lr
    assert cfg.train.weight_decay == 0 and moved.max() <= lr * 1.01
    assert (moved > 0.99 * lr).float().mean() > 0.9 and moved.numel() > step.numel() / 2


def test_seq_weights_are_one_on_policy_and_spread_with_stale_minibatches(warm_model_dir, tmp_path):
    """diagnostics.seq_weights: at N = 1 on an exact generator every W is 1 (log W = 0,
    phi = 1, each response an equal share); with 2 mini-batches the second trains a version
    stale, so log W spreads and phi leaves 1."""
    def run(name: str, minibatches: int) -> dict:
        cfg = load_config("configs/countdown.yaml", [
            f"model.path={warm_model_dir}", f"run.dir={tmp_path / name}", "train.steps=2",
            "train.estimator=vespo", f"train.minibatches={minibatches}", "train.lr=1e-3",
            "rollout.prompts_per_step=4", "rollout.group_size=5", "eval.every=0", "eval.samples=0",
            "diagnostics.seq_weights=true", "diagnostics.monitor_every=0", "run.progress=false"])
        train(cfg)
        return read_jsonl(tmp_path / name / "metrics.jsonl")[-1]

    on = run("n1", 1)
    assert [on[f"staleness/seq_log_ratio/{q}"] for q in ("q05", "q50", "q95")] == [0.0, 0.0, 0.0]
    # mu against pi_old: the same fp32 weights, sampled with a KV cache and scored in one pass.
    assert abs(on["total/seq_log_ratio/q05"]) < 1e-3 and abs(on["total/seq_log_ratio/q95"]) < 1e-3
    assert [on[f"objective/coef_seq/{q}"] for q in ("q05", "q50", "q95", "max")] == [1.0] * 4
    assert on["objective/coef_seq/top_share"] == pytest.approx(1 / 20)  # one of 20 responses
    stale = run("n2", 2)
    assert stale["staleness/seq_log_ratio/q05"] < stale["staleness/seq_log_ratio/q95"]
    assert stale["objective/coef_seq/q05"] < 1.0 or stale["objective/coef_seq/max"] > 1.0
    assert abs(stale["staleness/seq_log_ratio/q05"] - stale["total/seq_log_ratio/q05"]) < 1e-3


def test_chain_task_trains_on_its_own_default_model(tmp_path):
    """task.name=chain: the default model is warm-started on chains, with the 256 positions
    their 142-token prompt + answer need, and the loop runs on it."""
    cache = str(tmp_path / "models")
    cfg = load_config("configs/chain.yaml", [
        f"model.cache_dir={cache}", "model.warmstart_steps=2", f"run.dir={tmp_path / 'run'}",
        "train.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "task.eval_size=4",
        "eval.every=1", "run.progress=false"])
    result = train(cfg)
    model_dir = next(Path(cache).glob("tiny-dense-*"))
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == 256
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and "eval/accuracy" in rows[-1]
    assert result.run_dir.is_dir()
