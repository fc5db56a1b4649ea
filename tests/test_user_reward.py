"""A user's reward function: loaded only from the path named, time-limited, never fatal.

A raise, a non-number, NaN or a timeout scores that one sample 0, is counted and
reported with the place in the user's code; the run goes on (the last test trains with
a reward that fails on a third of the samples).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest

from tether.config import load_config
from tether.logger import read_jsonl
from tether.loops import train
from tether.rewards import GuardedReward, call_with_timeout, load_reward_fn
from tether.tasks import Problem, Reward

PROBLEM = Problem(id="p-1", prompt="3,7,9:42=")

USER_MODULE = '''
import time

from tether.tasks import Reward


def length(problem, response):
    return len(response) / 10


def parts(problem, response):
    return Reward(0.5, {"correct": 0.0, "style": 0.5})


def flaky(problem, response):
    if "*" in response:
        raise KeyError("no star allowed")
    return 1.0 if response else 0.0


def spins(problem, response):
    # Gives up after a minute, so a broken timeout fails the test instead of hanging it.
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        try:
            pass
        except Exception:  # a broad except must not swallow the timeout
            pass
    return 1.0


def naps(problem, response):
    time.sleep(0.05)
    return 0.25


def wrong_type(problem, response):
    return "high"


def not_a_number(problem, response):
    return float("nan")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards.py"


def test_loads_from_module_or_file(user_module):
    assert load_reward_fn("my_rewards:length")(PROBLEM, "12345") == 0.5
    assert load_reward_fn(f"{user_module}:length")(PROBLEM, "12") == 0.2


def test_numbers_and_rewards_pass_through(user_module):
    guarded = GuardedReward(load_reward_fn("my_rewards:parts"), "my_rewards:parts", 1.0)
    assert guarded(PROBLEM, "x") == Reward(0.5, {"correct": 0.0, "style": 0.5})
    guarded = GuardedReward(load_reward_fn("my_rewards:length"), "my_rewards:length", 1.0)
    assert guarded(PROBLEM, "12345") == Reward(0.5, {}) and guarded.errors == 0


@pytest.mark.parametrize("name,reported", [
    ("flaky", "KeyError: 'no star allowed' (at "),
    ("wrong_type", "returned 'high' (str), not a number or Reward"),
    ("not_a_number", "returned nan, not a finite number"),
])
def test_a_failing_call_scores_zero_and_is_reported(user_module, caplog, name, reported):
    guarded = GuardedReward(load_reward_fn(f"my_rewards:{name}"), f"my_rewards:{name}", 1.0)
    with caplog.at_level(logging.WARNING, logger="tether.rewards"):
        assert guarded(PROBLEM, "3*7") == Reward(0.0, {"error": 1.0, "timeout": 0.0})
    assert guarded.errors == 1
    assert reported in caplog.text and "problem p-1" in caplog.text
    if name == "flaky":
        assert "my_rewards.py:" in caplog.text  # the line in the user's code


def test_a_runaway_call_is_cut_at_the_timeout(user_module, caplog):
    handler = signal.getsignal(signal.SIGALRM)
    guarded = GuardedReward(load_reward_fn("my_rewards:spins"), "my_rewards:spins", 0.2)
    with caplog.at_level(logging.WARNING, logger="tether.rewards"):
        assert guarded(PROBLEM, "x") == Reward(0.0, {"error": 1.0, "timeout": 1.0})
    assert guarded.errors == 1 and "ran longer than reward.timeout=0.2 s" in caplog.text
    # The alarm is disarmed and the caller's handler is back.
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is handler
    # A call that ends within its timeout keeps its value (no early cut).
    guarded = GuardedReward(load_reward_fn("my_rewards:naps"), "my_rewards:naps", 30.0)
    assert guarded(PROBLEM, "x") == Reward(0.25, {}) and guarded.errors == 0


def test_off_the_main_thread_the_timeout_still_holds():
    # A helper thread runs the call (abandoned if it overruns; this one ends by itself).
    result = {}

    def worker():
        try:
            call_with_timeout(time.sleep, (1.0,), 0.1)
        except BaseException as e:  # noqa: BLE001 -- recorded for the assertion
            result["raised"] = type(e).__name__
        result["value"] = call_with_timeout(lambda a, b: a + b, (2, 3), 1.0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert result == {"raised": "RewardTimeout", "value": 5}


def test_a_run_survives_a_failing_reward(warm_model_dir, tmp_path, user_module, caplog):
    cfg = load_config(None, [
        f"model.path={warm_model_dir}", f"run.dir={tmp_path / 'run'}", "reward.fn=my_rewards:flaky",
        "train.steps=2", "run.threads=1", "run.progress=false", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=10", "task.name=countdown",
        "task.eval_size=8", "eval.every=0", "eval.batch_size=8", "diagnostics.monitor_every=0",
    ])
    with caplog.at_level(logging.WARNING, logger="tether.rewards"):
        result = train(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[1:]
    errors = [r["reward/errors"] for r in rows]
    print("reward/errors per step:", errors, "reward/mean:", result.rewards)
    assert sum(errors) > 0 and all(r["version"] == i + 1 for i, r in enumerate(rows))
    assert "KeyError: 'no star allowed'" in caplog.text
