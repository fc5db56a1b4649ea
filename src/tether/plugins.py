"""Your own code by explicit import path: 'package.module:name' or 'path/to/file.py:name'.

Used for `reward.fn` (tether.rewards) and `task.name` (tether.tasks). Nothing is imported
but the module or file you name; a module is looked up in the current directory first
(as `python -m` does), then in the installed packages. Every failure is an InputError
that names the setting, what was looked for and what was found.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from tether.errors import InputError


class MissingTarget(InputError):
    """The named module or file does not exist (nothing of the user's ran)."""


def split_spec(spec: str, kind: str = "function") -> tuple[str, str]:
    """`'pkg.mod:name'` or `'path/to/file.py:name'` -> (module or file, name); ValueError else."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"must be 'package.module:{kind}' or 'path/to/file.py:{kind}'")
    return target, name


def import_object(spec: str, where: str, kind: str = "function") -> Any:
    """The object `spec` names; `where` ("reward.fn='...'") prefixes every error message."""
    try:
        target, name = split_spec(spec, kind)
    except ValueError as e:
        raise InputError(f"{where}: {e}") from None
    try:
        module = _import_file(Path(target), where) if _is_file(target) else _import_module(target, where, kind)
    except MissingTarget:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's module failed while importing: say where
        raise InputError(f"{where}: importing {target} failed: {describe_exception(e)}") from None
    obj = getattr(module, name, None)
    if obj is None:
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise InputError(f"{where}: {target} has no {name!r}; it defines: {', '.join(found) or 'nothing callable'}")
    return obj


def describe_exception(e: BaseException) -> str:
    """`ZeroDivisionError: division by zero (at my_rewards.py:12)`: the innermost frame."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, SyntaxError) and e.filename:
        return f"{text} (at {e.filename}:{e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_module(name: str, where: str, kind: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # `tether` scripts miss it; `python -m` has it
        sys.path.insert(0, cwd)
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package is missing, or the name is malformed
        found = None
    if found is None:
        raise MissingTarget(
            f"{where}: no module named {name!r} (searched the current directory and the "
            f"installed packages); for a file give 'path/to/file.py:{kind}'"
        )
    return importlib.import_module(name)


def _import_file(path: Path, where: str) -> Any:
    path = path.expanduser()
    if not path.is_file():
        raise MissingTarget(f"{where}: file {path} does not exist")
    module_name = f"tether_user_{path.stem}"
    loaded = sys.modules.get(module_name)
    if loaded is not None and Path(loaded.__file__ or "").resolve() == path.resolve():
        return loaded  # the same file again (a task checked at load, then built): run it once
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise MissingTarget(f"{where}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
