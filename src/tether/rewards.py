"""Your own reward function: loaded from an explicit import path, run under a time limit.

    reward:
      fn: my_rewards:brevity          # a module on the path (like `python -m`, cwd first)
      # fn: rewards/mine.py:brevity   # or a file
      timeout: 5.0                    # seconds per call

The function is called once per sampled response as `fn(problem, response)`, where
`problem` is a `tether.tasks.Problem` (id, prompt, solution, meta) and `response` the
decoded text without eos. It returns a number or a `tether.tasks.Reward` (total and
named parts, logged). Nothing else is ever imported or executed: tether's own rewards
parse the model's text and never run it, and your function is loaded only from the path
you name, at the start of the run (an error there stops the run before any compute).

A call that raises, returns something that is not a finite number, or runs past
`reward.timeout` scores 0 for that sample, is counted (`reward/errors` per step, parts
`error` and `timeout`) and reported on stderr (the first few, with the place in your
code), and the run goes on.

The time limit is a SIGALRM timer (`signal.setitimer`) when the reward runs in the main
thread, as it does in the synchronous loop: it interrupts Python code between bytecodes
at no cost per call, and the interrupt derives from BaseException, so an
`except Exception` in your code cannot swallow it. It cannot interrupt one long C call
(a huge regex match or big-integer power) until that call returns. Off the main thread
(or without SIGALRM) the call runs in a helper thread that is abandoned, not killed,
when it overruns. A timeout depends on the wall clock, so a run whose rewards time out
is not reproducible bit for bit.
"""

from __future__ import annotations

import inspect
import logging
import math
import signal
import threading
from collections.abc import Callable
from typing import Any

from tether.errors import InputError
from tether.plugins import describe_exception, import_object
from tether.tasks.base import Problem, Reward, Task

log = logging.getLogger("tether.rewards")

MAX_REPORTS = 5
"""Errors of a user's reward reported on stderr; the rest are only counted."""

RewardFn = Callable[[Problem, str], Reward]


class RewardTimeout(BaseException):
    """A reward call ran past `reward.timeout` (BaseException: `except Exception` misses it)."""


def build_reward_fn(spec: str | None, timeout: float, task: Task) -> RewardFn:
    """The task's own reward, or the user's `spec` wrapped by `GuardedReward`."""
    if spec is None:
        return task.reward
    return GuardedReward(load_reward_fn(spec), spec, timeout)


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """Import `module:function` or `file.py:function`; an InputError names what failed."""
    name = spec.rpartition(":")[2]
    where = f"reward.fn={spec!r}"
    fn = import_object(spec, where)
    if not callable(fn):
        raise InputError(f"{where}: {name} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(None, "")
    except TypeError:
        raise InputError(f"{where}: {name} must take two arguments (problem, response)") from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    return fn


class GuardedReward:
    """A user's reward function that never stops the run: errors and timeouts score 0."""

    def __init__(self, fn: Callable[..., Any], spec: str, timeout: float):
        self.fn, self.spec, self.timeout = fn, spec, timeout
        self.errors = 0

    def __call__(self, problem: Problem, response: str) -> Reward:
        try:
            value = call_with_timeout(self.fn, (problem, response), self.timeout)
            return _as_reward(value)
        except RewardTimeout:
            return self._failed(problem, f"ran longer than reward.timeout={self.timeout:g} s",
                                timeout=True)
        except Exception as e:  # noqa: BLE001 -- whatever the user's code raises, the run goes on
            return self._failed(problem, describe_exception(e))

    def _failed(self, problem: Problem, what: str, timeout: bool = False) -> Reward:
        self.errors += 1
        if self.errors <= MAX_REPORTS:
            more = "; further errors are only counted (reward/errors)" if self.errors == MAX_REPORTS else ""
            log.warning("reward.fn %s on problem %s: %s; the sample scores 0%s",
                        self.spec, problem.id, what, more)
        return Reward(0.0, {"error": 1.0, "timeout": float(timeout)})


def _as_reward(value: Any) -> Reward:
    if isinstance(value, Reward):
        total = value.total
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        total, value = float(value), Reward(float(value), {})
    else:
        raise TypeError(f"returned {value!r:.60} ({type(value).__name__}), not a number or Reward")
    if not math.isfinite(total):
        raise ValueError(f"returned {total}, not a finite number")
    return value


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout: float) -> Any:
    """fn(*args), or RewardTimeout after `timeout` seconds (see the module docstring)."""
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        return _call_with_alarm(fn, args, timeout)
    return _call_in_thread(fn, args, timeout)


def _call_with_alarm(fn: Callable[..., Any], args: tuple, timeout: float) -> Any:
    def on_alarm(signum: int, frame: Any) -> None:
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(fn: Callable[..., Any], args: tuple, timeout: float) -> Any:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller below
            result["error"] = e

    worker = threading.Thread(target=run, name="tether-reward", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():  # cannot be killed: abandoned, still running
        raise RewardTimeout
    if "error" in result:
        raise result["error"]
    return result["value"]
