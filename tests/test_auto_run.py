"""train.correction=auto end to end on the warm tiny model (the controller alone:
tests/test_auto.py).

A run whose causes appear as it goes: heavy-tailed logit noise makes the numerical part
material from the start, and a lag that starts after step 3 (`sync.lag_from`) makes
staleness material a few steps later. The run must switch each cause on exactly when the
hysteresis rule says (k = 2 material steps of the last w = 3, from the logged figures), center
and request the engine's top-K only while staleness is handled, and re-sync at every batch
whose ESS falls below 0.5, in either choice. Then SIGTERM after the switches and `--resume`:
the same choices and bit-identical rows after it.
"""

from __future__ import annotations

import signal
from pathlib import Path

from tests.auto_replay import logged, replayed
from tests.race_gates import gate, outpace_training, tether_train, wait_until
from tether.advice import ESS_MARGIN, ESS_TAU
from tether.auto import Controller
from tether.config import load_config
from tether.logger import read_jsonl

STEPS, K, W, M, LAG_FROM, P = 12, 2, 3, 3, 3, 4
RUN = ["run.threads=1", "run.progress=false", "run.checkpoint_every=0", f"train.steps={STEPS}",
       "train.lr=3e-3", f"rollout.prompts_per_step={P}", "rollout.group_size=4",
       "rollout.max_new_tokens=10", "task.name=countdown", "task.eval_size=8", "eval.every=0",
       "sync.lag=6", f"sync.lag_from={LAG_FROM}", "rollout.logit_noise=0.3",
       "rollout.logit_noise_dof=3", "train.correction=auto", f"train.auto_on_after={K}",
       f"train.auto_window={W}", f"train.auto_off_after={M}"]


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_jsonl(run_dir / "metrics.jsonl")[1:]]


def test_auto_switches_with_the_evidence_and_resumes_exactly(warm_model_dir, tmp_path):
    common = [f"model.path={warm_model_dir}", *RUN]
    cfg = load_config(None, common)
    straight = tether_train(*common, f"run.dir={tmp_path / 'straight'}")
    # The other run holds in step 9's reward (after both switches, in a streak towards the
    # next) until SIGTERM is sent.
    stopped_dir, gate_dir = tmp_path / "stopped", tmp_path / "gate"
    stopped = tether_train(*common, f"run.dir={stopped_dir}",
                     *gate(gate_dir, cfg, hold=f"countdown-train-{8 * P}"))
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err[-3000:]
    rows = _rows(tmp_path / "straight")

    # Each switch at the step the rule names, from the logged figures alone (the sync loop's
    # batches always carry the top-K that centering asks for).
    assert logged(rows) == replayed(rows, Controller(P * 4, K, M, W))
    on = [r["step"] for r in rows if r["auto/staleness"] == 1]
    material = [r["step"] for r in rows if r["staleness/ess/token"] < ESS_TAU + ESS_MARGIN]
    # The injected cause: nothing stale before the lag starts; then the switch comes right
    # after the first step that ends a window of W with K material steps in it.
    assert min(material) > LAG_FROM + 1 and on
    first_called = next(s for s in material if sum(s - i in material for i in range(W)) >= K)
    assert on[0] == first_called + 1
    assert rows[0]["auto/numerical"] == 0 and rows[K]["auto/numerical"] > 0  # on after K steps
    assert f"tether: auto: staleness plain -> dlc from step {on[0]}" in err
    assert "tether: auto: numerical none -> " in err
    for r in rows:
        handled = r["auto/staleness"] == 1
        assert (r["auto/numerical"] == 3) == handled  # centering exactly while staleness is handled
        assert (r["auto/topk"] > 0) == handled  # and only then the engine's top-K
        # The re-sync's trigger is armed in either choice: it trips exactly below tau.
        assert r["sync/tripped"] == float(r["sync/ess/token"] < ESS_TAU)
    assert any(r.get("sync/tripped") for r in rows)  # it re-synced the generator

    # SIGTERM while step 9 is held: a checkpoint after it, then --resume.
    assert wait_until((gate_dir / "held").exists, lambda: stopped.poll() is None), \
        stopped.communicate()[1][-3000:]
    stopped.send_signal(signal.SIGTERM)
    (gate_dir / "release").touch()
    _, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped by SIGTERM after step 9" in err
    resumed = tether_train("--resume", str(stopped_dir))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert _rows(stopped_dir) == rows


def test_auto_in_the_async_race(warm_model_dir, tmp_path, monkeypatch):
    """The asynchronous loop: the race makes staleness (generation outpaces training, by
    construction, as in tests/test_async.py), the logit noise the numerical part. auto
    switches as the rule says on the logged figures; the ESS window is fixed while staleness
    is plain; a batch trains centered only when it carries the top-K that new work requests
    once centering is chosen (one admitted before trains uncentered)."""
    from tether.ledger import audit
    from tether.loops import train

    eta, run_dir = 4, tmp_path / "run"
    cfg = load_config("configs/countdown.yaml", [
        f"model.path={warm_model_dir}", f"run.dir={run_dir}", "run.progress=false",
        "run.threads=1", f"rollout.prompts_per_step={P}", "rollout.group_size=4",
        "rollout.max_new_tokens=10", "task.eval_size=8", "eval.every=0",
        "diagnostics.monitor_every=0", "loop.mode=async", f"loop.max_staleness={eta}",
        f"sync.policy=bounded:{eta}", "train.steps=14", "train.lr=3e-3",
        "rollout.logit_noise=0.3", "rollout.logit_noise_dof=3", "train.correction=auto",
        f"train.auto_on_after={K}", f"train.auto_window={W}", f"train.auto_off_after={M}"])

    outpace_training(monkeypatch)
    train(cfg)
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    assert logged(rows) == replayed(rows, Controller(P * 4, K, M, W))
    assert any(r["auto/staleness"] == 1 for r in rows)  # the race made staleness material
    assert any(r["auto/numerical"] == 3 for r in rows)  # and centered batches trained
    for r in rows:
        if r["auto/staleness"] == 0:
            assert r["async/window"] == eta
        if r["auto/numerical"] == 3:
            assert r["auto/topk"] > 0
