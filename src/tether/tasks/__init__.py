"""Tasks: where prompts come from and how responses are rewarded (by parsing, never executing).

Built-in tasks are looked up by name with `build_task`; `register_task` adds a user's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tether.tasks.base import Problem, Reward, Task
from tether.tasks.countdown import ALPHABET, CountdownTask, reachable, solve
from tether.tasks.expr import ExprFailure, ExprLimits, ExprValue, evaluate
from tether.tasks.numeric import NumericAnswerTask, final_number, reference_number

__all__ = [
    "ALPHABET",
    "CountdownTask",
    "ExprFailure",
    "ExprLimits",
    "ExprValue",
    "NumericAnswerTask",
    "Problem",
    "Reward",
    "Task",
    "build_task",
    "evaluate",
    "final_number",
    "reachable",
    "reference_number",
    "register_task",
    "solve",
    "task_names",
]

_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator adding a task factory (usually a class) under `name`; a taken name is an error."""

    def add(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in _TASKS:
            raise ValueError(f"task name {name!r} is already registered to {_TASKS[name]!r}")
        _TASKS[name] = factory
        return factory

    return add


def task_names() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_TASKS)


def build_task(name: str, **kwargs: Any) -> Task:
    """Construct the task registered as `name` with keyword arguments `kwargs`."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; valid names: {', '.join(task_names())}")
    return _TASKS[name](**kwargs)


register_task("countdown")(CountdownTask)
register_task("numeric")(NumericAnswerTask)
