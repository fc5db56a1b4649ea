"""The ESS-governed admission window (loop.window=ess) and what a trip does to the batches
already in flight (loop.after_trip): the window's rule exactly, and real async runs where
every stale batch trips, so the rules are forced rather than waited for."""

from __future__ import annotations

import signal
from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.hypothesis_budget import examples
from tests.race_gates import gate, outpace_training, tether_train, wait_until
from tests.test_async import ASYNC, _cfg
from tether.config import ConfigError, load_config
from tether.ledger import audit
from tether.logger import read_jsonl
from tether.loops import train
from tether.weights.window import StalenessWindow

# ess:1 trips on every batch with a token behind the trainer (ESS < 1 once weights moved);
# a fresh batch has ESS exactly 1 and never trips.
TRIP_ALWAYS = ["sync.policy=ess:1", "train.estimator=dlc", "loop.window=ess",
               "loop.max_staleness=4", "train.lr=1e-3"]


def test_window_halves_what_was_in_flight_and_grows_by_one():
    w = StalenessWindow(32, floor=1, adaptive=True)
    assert w.size == 32
    assert w.update(True, 10) == 5  # half the tripping batch's staleness, not of the ceiling
    assert [w.update(False, 3) for _ in range(3)] == [6, 7, 8]
    assert w.update(True, 20) == 4  # half the window when the batch was staler than it
    assert w.update(True, 1) == 1  # never below the floor
    w.size = 31
    assert w.update(False, 0) == 32 and w.update(False, 0) == 32  # never above the ceiling
    fixed = StalenessWindow(4)
    assert [fixed.update(t, 9) for t in (True, False, True)] == [4, 4, 4]
    with pytest.raises(ValueError):
        StalenessWindow(2, floor=3)


@given(st.integers(0, 64), st.integers(0, 64),
       st.lists(st.tuples(st.booleans(), st.integers(0, 80)), max_size=60))
@examples(200)
def test_window_stays_within_its_bounds(ceiling, floor, events):
    floor = min(floor, ceiling)
    w = StalenessWindow(ceiling, floor, adaptive=True)
    for tripped, stale in events:
        before = w.size
        after = w.update(tripped, stale)
        assert floor <= after <= ceiling
        if tripped:
            assert after == max(floor, min(before, stale) // 2) and after <= max(before, floor)
        else:
            assert after == min(ceiling, before + 1)


def test_config_refuses_a_window_no_trip_can_move():
    with pytest.raises(ConfigError, match="loop.window=ess acts on ESS trips"):
        load_config(None, ["loop.mode=async", "loop.window=ess", "sync.policy=bounded:1"])
    with pytest.raises(ConfigError, match="loop.after_trip=regenerate acts on ESS trips"):
        load_config(None, ["loop.mode=async", "loop.after_trip=regenerate", "sync.policy=every:1"])
    with pytest.raises(ConfigError, match="loop.window_min"):
        load_config(None, ["loop.mode=async", "loop.max_staleness=2", "loop.window_min=3"])
    with pytest.raises(ConfigError, match="loop.mode=async"):
        load_config(None, ["loop.window=ess", "sync.policy=ess:0.5"])


def _check_window_rows(rows: list[dict], ceiling: int, floor: int = 1) -> None:
    """Each row logs the window in force at its batch's turn; the next row's follows from it
    by the rule, whatever the race did (drops between rows leave it alone under on_trip=train)."""
    for r in rows:
        assert r["staleness/versions/max"] <= r["async/window"] <= ceiling
    for a, b in pairwise(rows):
        w = StalenessWindow(ceiling, floor, adaptive=True, size=int(a["async/window"]))
        assert b["async/window"] == w.update(bool(a["sync/tripped"]), int(a["staleness/versions/max"]))


@pytest.mark.parametrize("rule, reason", [("window", "outside_window"),
                                          ("regenerate", "sampled_before_resync")])
def test_a_trip_reaches_the_batches_in_flight(warm_model_dir, tmp_path, monkeypatch, rule, reason):
    steps, run_dir = 8, tmp_path / "run"
    cfg = _cfg(warm_model_dir, run_dir, f"train.steps={steps}", *TRIP_ALWAYS,
               f"loop.after_trip={rule}", "loop.window_min=0")

    # Generation outpaces training (race_gates.outpace_training): slots 0..4 are sampled at
    # version 0; slot 1 trains at version 1 and trips, which shrinks the window to 0 and
    # publishes version 2, so slots 2..4 come up 2..4 versions stale: dropped by the rule.
    # At window 0 the sides take turns, each batch is fresh (ESS 1) and widens it to 1,
    # where the next is 1 version stale and trips.
    outpace_training(monkeypatch)
    train(cfg)
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems
    assert a.open == [] and a.awaiting_reissue == [] and a.trained == steps * 4
    assert a.dropped[reason] >= 3 * 4 and set(a.dropped) <= {"outside_window", reason}
    assert a.issued == a.trained + sum(a.dropped.values())  # each drop issued again, once
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    _check_window_rows(rows, ceiling=4, floor=0)
    windows = [r["async/window"] for r in rows]
    assert windows[:3] == [4, 4, 0]  # slot 0 fresh, slot 1 trips at staleness 1
    assert any(b < a for a, b in pairwise(windows))  # shrinks on a trip ...
    assert any(b > a for a, b in pairwise(windows))  # ... and grows back without
    assert sum(r["sync/tripped"] for r in rows) >= 2
    if rule == "regenerate":  # nothing trained was sampled before the re-sync in force
        assert all(r["generator_version"] >= r["async/resync_version"] for r in rows)
    assert 0 < rows[-1]["async/trained_per_generated"] < 1  # the drops' waste, counted


def test_fixed_window_with_ess_policy_drops_nothing(warm_model_dir, tmp_path):
    """A fixed window keeps today's behaviour under an ESS policy too: trips publish, but
    every batch admitted is trained."""
    steps, run_dir = 6, tmp_path / "run"
    train(_cfg(warm_model_dir, run_dir, f"train.steps={steps}", "sync.policy=ess:1",
               "train.estimator=dlc", "loop.max_staleness=2", "train.lr=1e-3"))
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok and a.trained == steps * 4 and sum(a.dropped.values()) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    assert {r["async/window"] for r in rows} == {2.0}
    assert rows[-1]["async/trained_per_generated"] == 1.0


def test_sigterm_with_the_ess_window_resumes_with_the_ledger_clean(warm_model_dir, tmp_path):
    steps, run_dir, gate_dir = 10, tmp_path / "run", tmp_path / "gate"
    args = [f"model.path={warm_model_dir}", *ASYNC, f"train.steps={steps}", *TRIP_ALWAYS,
            "run.checkpoint_every=0"]
    # A worker holds the batch with problem 24 (the seventh fresh batch, issued once at least
    # two batches left the window of five) until the SIGTERM has been sent.
    args += gate(gate_dir, load_config(None, args), hold="countdown-train-24")
    run = tether_train(*args, f"run.dir={run_dir}")
    held = wait_until(lambda: (gate_dir / "held").exists(), lambda: run.poll() is None)
    assert held, run.communicate()[1][-2000:]
    run.send_signal(signal.SIGTERM)
    (gate_dir / "release").touch()
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped = audit(run_dir / "ledger.jsonl")
    assert stopped.ok and stopped.open == [], stopped.problems
    assert stopped.dropped["in_flight_at_stop"] > 0  # the held batch, at least

    resumed = tether_train("--resume", str(run_dir))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems
    assert a.open == [] and a.awaiting_reissue == [] and a.trained == steps * 4
    assert set(a.dropped) <= {"in_flight_at_stop", "outside_window", "sampled_before_resync"}
    assert a.issued == a.trained + sum(a.dropped.values())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps + 1))
    _check_window_rows(rows[1:], ceiling=4)  # the window is restored across the resume


def test_the_shipped_config_runs_dlc_under_the_ess_window():
    cfg = load_config("configs/async_dlc.yaml")
    # after_trip auto: regenerate under the ESS window (the better rule in E-DLC's race)
    assert (cfg.loop.mode, cfg.loop.window, cfg.loop.after_trip) == ("async", "ess", "regenerate")
    fixed = load_config("configs/async_dlc.yaml", ["loop.window=fixed"])
    assert fixed.loop.after_trip == "window"  # a fixed window trains what it admitted
    assert cfg.train.estimator == "dlc" and cfg.sync.policy == "ess:0.5"  # the preset's policy
