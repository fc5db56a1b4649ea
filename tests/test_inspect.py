"""`tether inspect` on short real runs, and docs/metrics.md covering every logged column."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from tether.cli import main
from tether.config import load_config
from tether.dump import dump_rows
from tether.logger import read_jsonl
from tether.loops import train

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
SHORT = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=10",
         "task.eval_size=4", "eval.every=0", "run.progress=false", "diagnostics.monitor_every=1",
         "diagnostics.monitor_prompts=2", "diagnostics.monitor_samples=2"]


@pytest.fixture(scope="module")
def dlc_run(warm_model_dir, tmp_path_factory):
    """3 steps of dlc against an fp8 generator lagging 1 version; ess:0.95 re-syncs; the
    sequence weights' quantiles logged (diagnostics.seq_weights)."""
    run_dir = tmp_path_factory.mktemp("dlc")
    train(load_config("configs/dlc_fp8_lag4.yaml", [
        f"model.path={warm_model_dir}", f"run.dir={run_dir}", "train.steps=3", "train.lr=3e-3",
        "sync.lag=1", "sync.policy=ess:0.95", "log.dump_logprobs=true",
        "diagnostics.seq_weights=true", *SHORT]))
    return run_dir


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, random_moe_dir):
    """2 steps on a random-init MoE model under bf16: the routing columns."""
    model_dir = random_moe_dir
    run_dir = tmp_path_factory.mktemp("moe")
    train(load_config("configs/countdown.yaml", [
        f"model.path={model_dir}", f"run.dir={run_dir}", "train.steps=2",
        "rollout.precision=bf16", *SHORT]))
    return run_dir


def documented_keys() -> list[re.Pattern]:
    """Every backticked key in docs/metrics.md, {a,b} expanded, <name> as a wildcard."""
    patterns = []
    for token in re.findall(r"`([^`\s]+)`", DOCS.read_text()):
        parts = re.split(r"\{([^}]*)\}", token)  # literal, alternatives, literal, ...
        choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
        for combo in itertools.product(*choices):
            key = "".join(combo)
            patterns.append(re.compile(re.sub(r"<[^>]+>", "[^/]+", re.escape(key)
                                              .replace(r"\<", "<").replace(r"\>", ">")) + "$"))
    return patterns


def test_every_logged_key_is_documented(dlc_run, moe_run):
    keys = {k for run in (dlc_run, moe_run) for row in read_jsonl(run / "metrics.jsonl") for k in row}
    patterns = documented_keys()
    missing = sorted(k for k in keys if not any(p.match(k) for p in patterns))
    assert not missing, f"add these to docs/metrics.md: {missing}"


def test_dlc_run_logs_every_diagnostic(dlc_run):
    rows = read_jsonl(dlc_run / "metrics.jsonl")[1:]
    for cause in ("numerical", "staleness", "total"):
        for metric in ("k1_kl/mean", "k3_kl/mean", "abs_log_ratio/max", "chi2/token", "chi2/seq",
                       "ppl_ratio/mean", "ess/token", "ess/seq"):
            assert all(f"{cause}/{metric}" in r for r in rows), f"{cause}/{metric}"
    weights = ("numerical/is_weight", "staleness/ratio", "total/is_weight")
    for name in weights:
        for stat in ("mean", "max", "second_moment"):
            assert all(f"{name}/{stat}" in r for r in rows)
    for key in ("monitor/k3_kl/mean", "monitor/kl_share/rare", "sync/ess/token", "sync/tripped",
                "snapshots/count", "snapshots/bytes", "staleness/versions/batch", "loss/centering"):
        assert all(key in r for r in rows), key
    assert [r["staleness/versions/batch"] for r in rows][:2] == [0.0, 1.0]
    # on_trip=train, one mini-batch: the policy decided on the logged ESS, to the bit.
    assert all(r["sync/ess/token"] == r["staleness/ess/token"] for r in rows)
    assert rows[0]["numerical/k3_kl/mean"] > 0  # fp8
    assert rows[1]["staleness/k3_kl/mean"] > 0  # one version behind


def test_the_runs_logprob_dump_gives_its_logged_split(dlc_run, tmp_path, capsys):
    # log.dump_logprobs: each step's mu, pi_old, pi_theta; their split is the logged one.
    logged = {r["step"]: r for r in read_jsonl(dlc_run / "metrics.jsonl")[1:]}
    rows, cfg = dump_rows(dlc_run / "logprobs.jsonl")
    assert [r["step"] for r in rows] == sorted(logged) == [1, 2, 3]
    assert cfg["train"]["estimator"] == "dlc" and cfg["rollout"]["prompts_per_step"] == 16
    for row in rows:
        split_keys = [k for k in row if k.split("/")[0] in ("numerical", "staleness", "total")
                      and k != "staleness/versions/batch"]
        assert len(split_keys) > 30
        for k in split_keys:
            assert row[k] == pytest.approx(logged[row["step"]][k], rel=1e-6, abs=1e-9), k
        assert row["staleness/versions/batch"] == logged[row["step"]]["staleness/versions/batch"]
    # tether inspect reads the dump as it reads the run: same windows, same advice.
    assert main(["inspect", str(dlc_run / "logprobs.jsonl"), "--no-plots"]) == 0
    from_dump = capsys.readouterr().out
    assert main(["inspect", str(dlc_run), "--no-plots"]) == 0
    from_run = capsys.readouterr().out
    table = lambda text: text[text.index("mismatch by cause"):text.index("ESS of pi_theta")]
    assert table(from_dump) == table(from_run)
    assert from_dump[from_dump.index("advice: "):] == from_run[from_run.index("advice: "):]


def test_moe_run_logs_routing_disagreement(moe_run):
    rows = read_jsonl(moe_run / "metrics.jsonl")[1:]
    assert all(0 <= r["numerical/routing_disagreement/mean"] <= 1 for r in rows)
    assert any(r["numerical/routing_disagreement/any_layer"] > 0 for r in rows)


def test_inspect_prints_the_summary_and_writes_plots(dlc_run, tmp_path, capsys):
    assert main(["inspect", str(dlc_run), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    print(text)
    assert "mismatch by cause" in text and "dominates" in text
    # Trainer-side held-out numbers first (step 0 and the last step), the batch reward labelled.
    assert re.search(r"trainer-side, held out: eval/accuracy .*eval/accuracy_sampled .*"
                     r"eval/reward_sampled \d\.\d{3} -> \d\.\d{3}", text)
    assert "generator-side batch reward (reward/mean" in text
    assert "vs tau = 0.95" in text and "syncs:" in text and "monitor" in text
    # fp8 generator lagging one version at lr 3e-3: each cause's line, then the advice.
    assert re.search(r"\n  numerical  k3 .*\n  staleness  k3 .*lowest token ESS .*\nadvice: ", text)
    for name in ("decomposition.png", "ess_sync.png", "learning.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name
        assert f"plot: {tmp_path / name}" in text


def test_inspect_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    help_text = capsys.readouterr().out
    for option in ("RUN_DIR", "--out", "--no-plots", "--tau", "--windows"):
        assert option in help_text
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_inspect_finds_nothing_to_correct_on_policy_and_in_the_async_race(
        warm_model_dir, tmp_path, capsys, mode):
    # An on-policy fp32 run, and configs/async.yaml's race (max_staleness 2 at lr 1e-4):
    # the numerical part is float rounding and the staleness ESS stays far above tau + margin.
    config = "configs/countdown.yaml" if mode == "sync" else "configs/async.yaml"
    run_dir = tmp_path / "run"
    train(load_config(config, [f"model.path={warm_model_dir}", f"run.dir={run_dir}",
                               "train.steps=4", *SHORT]))
    assert main(["inspect", str(run_dir), "--no-plots"]) == 0
    text = capsys.readouterr().out
    # A cause at rounding level is named so, not divided into an eleven-digit ratio.
    assert re.search(r"over the run: .*float rounding \(k3", text) and "x the other" not in text
    assert re.search(r"\n  numerical  k3 \S+/token: float rounding", text)
    assert "advice: nothing to correct: keep train.estimator=grpo sync.policy=" in text
