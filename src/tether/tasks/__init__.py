"""Tasks: where prompts come from and how responses are rewarded (by parsing, never executing).

Built-in tasks are looked up by name with `build_task`; `register_task` adds one under a
name for Python callers. From a config, your own task is named by import path
(`task.name: my_pkg.tasks:MyTask`); its other `task.*` keys are its constructor's keyword
arguments, checked against their annotations at load (`user_task_params`). docs/tasks.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tether.errors import InputError
from tether.tasks.base import Problem, Reward, Task, is_correct
from tether.tasks.chain import ChainTask
from tether.tasks.countdown import ALPHABET, CountdownTask, reachable, reachable_steps, solve
from tether.tasks.expr import ExprFailure, ExprLimits, ExprValue, evaluate_expr
from tether.tasks.numeric import NumericAnswerTask, final_number, reference_number

__all__ = [
    "ALPHABET",
    "ChainTask",
    "CountdownTask",
    "ExprFailure",
    "ExprLimits",
    "ExprValue",
    "NumericAnswerTask",
    "Problem",
    "Reward",
    "Task",
    "build_task",
    "evaluate_expr",
    "final_number",
    "is_correct",
    "reachable",
    "reachable_steps",
    "reference_number",
    "register_task",
    "solve",
    "task_from_config",
    "task_names",
    "user_task_params",
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


def task_from_config(task_cfg: Any) -> Task:
    """The task a config's `task` section names: built-in by name, or yours by import path."""
    params = task_cfg.model_dump(exclude={"name"})
    if ":" not in task_cfg.name:
        return build_task(task_cfg.name, **params)
    where = f"task.name={task_cfg.name!r}"
    task = _user_task_factory(task_cfg.name)(**params)
    missing = [m for m in ("train_problem", "eval_problems", "reward") if not callable(getattr(task, m, None))]
    if missing:
        raise InputError(f"{where}: the object it builds lacks {', '.join(m + '()' for m in missing)}; "
                         "a task implements tether.tasks.Task (docs/tasks.md)")
    return task


def user_task_params(spec: str, params: dict[str, Any]) -> dict[str, Any]:
    """Validate a user task's `task.*` keys against its constructor; the converted values.

    Keys are the constructor's keyword arguments, typed by their annotations (untyped: any
    value), required when they have no default; an unknown key is an error unless the
    constructor takes **kwargs. Raises InputError with one line per bad key.
    """
    import difflib
    import inspect
    import typing

    from pydantic import ConfigDict, ValidationError, create_model

    factory = _user_task_factory(spec)
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 -- annotations that do not resolve: validate names only
        hints = {}
    fields: dict[str, Any] = {}
    extra = "forbid"
    for name, p in inspect.signature(factory).parameters.items():
        if p.kind is p.VAR_KEYWORD:
            extra = "allow"
        elif p.kind is not p.VAR_POSITIONAL:
            fields[name] = (hints.get(name, Any), ... if p.default is p.empty else p.default)
    model = create_model(f"{getattr(factory, '__name__', 'Task')}Keys",
                         __config__=ConfigDict(extra=extra, arbitrary_types_allowed=True), **fields)
    try:
        return model.model_validate(params).model_dump(exclude_unset=True)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(map(str, err["loc"]))
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(key, list(fields), n=1)
                hint = f"; did you mean task.{close[0]}?" if close else ""
                lines.append(f"task.{key}: not a keyword argument of {spec}{hint}")
            else:
                lines.append(f"task.{key}: {err['msg']} (got {err.get('input')!r})")
        raise InputError("invalid config:\n  " + "\n  ".join(lines)) from None


def _user_task_factory(spec: str) -> Callable[..., Task]:
    from tether.plugins import import_object

    factory = import_object(spec, f"task.name={spec!r}", kind="Class")
    if not callable(factory):
        raise InputError(f"task.name={spec!r}: {spec.rpartition(':')[2]} is a "
                         f"{type(factory).__name__}, not a class or function")
    return factory


for _builtin in (CountdownTask, ChainTask, NumericAnswerTask):  # each under the name its class declares
    register_task(_builtin.name)(_builtin)
