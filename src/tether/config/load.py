"""Loading: a YAML file and `key=value` overrides -> a validated Config, or a ConfigError
with one line per problem: the dotted key, what is wrong, and where it was set (FILE:LINE).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tether.config.base import ConfigError
from tether.config.checks import check_registries, resolve_sync
from tether.config.schema import Config
from tether.config.task import BUILTIN_TASKS, TASK_TAGS, UserTaskConfig


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {k} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _drop_dotted(tree: dict[str, Any], dotted: str) -> None:
    """`~key` override: remove a key the config file set (as Hydra's `~key`)."""
    *parents, last = dotted.split(".")
    node: Any = tree
    for k in parents:
        node = node.get(k) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        raise ConfigError(f"override ~{dotted}: the config file does not set {dotted}, so there "
                          "is nothing to drop")
    del node[last]


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`["train.lr=3e-4", "rollout.precision=fp8"]` -> a nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=3e-4)")
        _set_dotted(tree, key.strip(), _parse_value(raw))
    return tree


def _parse_value(raw: str) -> Any:
    value = yaml.safe_load(raw) if raw.strip() else None
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _leaf_paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out += _leaf_paths(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format_errors(err: ValidationError, where: dict[str, str] | None = None,
                   task_name: str | None = None) -> str:
    """One line per error: dotted key, what is wrong, and `(FILE:LINE)` when it came from a file."""
    where = where or {}
    lines: list[str] = []
    foreign: list[tuple[str, str, str]] = []  # (key, the task it belongs to, where)
    for e in err.errors():
        # Drop the union tag pydantic inserts ("task.countdown.x" -> "task.x").
        loc = [str(p) for p in e["loc"] if p not in TASK_TAGS]
        if e["type"] in ("union_tag_invalid", "task_name"):
            loc.append("name")
        ctx_error = (e.get("ctx") or {}).get("error")
        fields = getattr(ctx_error, "fields", None) or [".".join(loc) or "(top level)"]
        path = " + ".join(fields)
        at = _where(fields, where)
        if e["type"] == "task_name":
            builtin = ", ".join(map(repr, BUILTIN_TASKS))
            lines.append(f"{path}: unknown task {task_name!r}; valid: {builtin}, or your "
                         f"own class as 'package.module:Class' or 'path/to/file.py:Class'{at}")
        elif e["type"] == "extra_forbidden" and (owner := _other_task(loc, task_name)):
            foreign.append((path, owner, at))
        elif e["type"] == "extra_forbidden":
            lines.append(f"{path}: {_unknown_key(loc, task_name)}{at}")
        elif ctx_error is not None:
            lines.append(f"{path}: {ctx_error}{at}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            lines.append(f"{path}: {e['msg']}{shown}{at}")
    if foreign:  # a task switched on top of a file written for another: one line, one fix
        keys = ", ".join(p for p, _, _ in foreign)
        lines.append(f"{keys}: {'keys' if len(foreign) > 1 else 'a key'} of task {foreign[0][1]}, "
                     f"not of task {task_name}{foreign[0][2]}: remove them from the file, or drop "
                     f"the file's task section with the override ~task (one key: ~{foreign[0][0]})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _where(fields: list[str], where: dict[str, str]) -> str:
    """` (FILE:LINE, command line)`: where each field (or a key under it) was set."""
    found = [w for f in fields for k, w in where.items() if k == f or k.startswith(f + ".")]
    return f" ({', '.join(dict.fromkeys(found))})" if found else ""


def _other_task(loc: list[str], task_name: str | None) -> str | None:
    """The built-in task a `task.KEY` belongs to when the named task has no such key."""
    if len(loc) != 2 or loc[0] != "task" or task_name not in BUILTIN_TASKS:
        return None
    return next((n for n, node in BUILTIN_TASKS.items()
                 if n != task_name and loc[1] in node.model_fields), None)


def _unknown_key(loc: list[str], task_name: str | None) -> str:
    """'unknown key', with the nearest valid name when one is close."""
    close = difflib.get_close_matches(loc[-1], _keys_at(loc[:-1], task_name), n=1)
    return "unknown key" + (f"; did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else "")


def _keys_at(loc: list[str], task_name: str | None = None) -> list[str]:
    """Valid keys of the config section at `loc` (for `task`, the named task's, else all built-ins)."""
    nodes: list[type[BaseModel]] = [Config]
    for key in loc:
        nxt = []
        for node in nodes:
            field = node.model_fields.get(key)
            if field is None:
                continue
            if key == "task" and node is Config:
                nxt += [BUILTIN_TASKS[task_name]] if task_name in BUILTIN_TASKS else list(BUILTIN_TASKS.values())
            elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                nxt.append(field.annotation)
        nodes = nxt
    return sorted({k for node in nodes for k in node.model_fields})


def _key_lines(text: str, source: str) -> dict[str, str]:
    """Dotted key -> "FILE:LINE" for every key written in a YAML file (nodes only, nothing built)."""
    out: dict[str, str] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                out[key] = f"{source}:{key_node.start_mark.line + 1}"
                walk(value_node, key + ".")

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply dotted overrides, validate; raise ConfigError naming the key."""
    tree: dict[str, Any] = {}
    where: dict[str, str] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        try:
            tree = yaml.safe_load(text) or {}
            where = _key_lines(text, str(p))
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            at = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
            context = f" ({e.context} at line {e.context_mark.line + 1})" if e.context_mark and e.problem else ""
            raise ConfigError(f"{at}: YAML syntax error: {e.problem or e.context}{context}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    overrides = overrides or []
    for item in (o for o in overrides if o.startswith("~")):
        _drop_dotted(tree, item[1:].strip())
        where = {k: w for k, w in where.items() if k != item[1:] and not k.startswith(item[1:] + ".")}
    extra = parse_overrides([o for o in overrides if not o.startswith("~")])
    for key in _leaf_paths(extra):  # an override wins over the file: point at it instead
        where[key] = "command line"
    tree = _merge(tree, extra)
    if isinstance(tree.get("task"), dict) and "name" not in tree["task"]:  # the default task
        tree["task"] = {"name": Config.model_fields["task"].default.name, **tree["task"]}
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        task_name = tree.get("task", {}).get("name") if isinstance(tree.get("task"), dict) else None
        raise ConfigError(_format_errors(e, where, task_name)) from None
    check_registries(cfg)
    if isinstance(cfg.task, UserTaskConfig):  # its keys are its constructor's: check them now
        from tether.tasks import user_task_params

        params = user_task_params(cfg.task.name, cfg.task.model_dump(exclude={"name"}))
        cfg = cfg.model_copy(update={"task": UserTaskConfig(name=cfg.task.name, **params)})
    return resolve_sync(cfg)


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written into every run directory)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

