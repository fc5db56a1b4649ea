"""benchmarks/simulate_async.py against what the admission rule gives by hand, with fixed
phase times (no spread)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "simulate_async", Path(__file__).resolve().parents[1] / "benchmarks" / "simulate_async.py")
sim = sys.modules["simulate_async"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(sim)


def _run(workers: int, eta: int, policy: str = "every", **phases: float) -> dict[str, float]:
    p = sim.Phases({k: [v] for k, v in phases.items()})
    return sim.simulate(p, workers, eta, steps=60, batch=100, policy=policy)


@pytest.mark.parametrize("gen,train,workers,eta,step", [
    (10.0, 6.0, 1, 1, 10.0),  # one worker: the slower side sets the pace
    (4.0, 6.0, 1, 2, 6.0),
    (10.0, 6.0, 2, 2, 6.0),  # two workers make a batch every 5 s: the trainer's 6 s binds
    (10.0, 6.0, 3, 3, 6.0),
    (10.0, 2.0, 2, 4, 5.0),  # two workers, 10 s each: one batch per 5 s
])
def test_the_pace_is_the_bottleneck(gen, train, workers, eta, step):
    r = _run(workers, eta, generate=gen, train=train)
    assert r["step_s"] == pytest.approx(step, rel=0.02)
    assert r["staleness_max"] <= eta


def test_eta_zero_is_the_synchronous_loop():
    """eta = 0: nothing is sampled before the trainer publishes, so each step is generate
    then train, one after the other; staleness 0."""
    r = _run(1, 0, generate=10.0, train=6.0, publish=1.0)
    assert r["step_s"] == pytest.approx(17.0, rel=0.02) and r["staleness_max"] == 0


def test_staleness_kept_versions_and_idle():
    """A fast generator runs eta versions ahead: every batch is eta stale (with every:1),
    the trainer never waits, eta + 1 versions are kept."""
    r = _run(2, 2, generate=1.0, train=6.0)
    assert r["staleness_mean"] == pytest.approx(2.0, abs=0.1) and r["trainer_idle"] < 0.01
    assert r["kept_max"] == 3
    slow = _run(1, 2, generate=12.0, train=6.0)  # the trainer waits half the time
    assert slow["trainer_idle"] == pytest.approx(0.5, abs=0.03) and slow["staleness_mean"] < 1.0
