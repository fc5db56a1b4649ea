"""`tether config --fields`: every key with its default and meaning, section by section."""

from __future__ import annotations

from pydantic import BaseModel

from tether.config.schema import Config
from tether.config.task import BUILTIN_TASKS

SECTIONS = {
    "model": "which model to train",
    "task": "where prompts come from and how answers are rewarded",
    "reward": "your own reward function (optional)",
    "rollout": "the generator: engine, numerics, sampling",
    "train": "the trainer: steps, optimizer, loss estimator",
    "sync": "when the generator receives new weights",
    "loop": "synchronous or asynchronous generation and training",
    "weights": "how kept versions are stored and new ones published (docs/scale.md)",
    "diagnostics": "mismatch diagnostics and the current-model monitor",
    "log": "where metrics go besides RUN_DIR/metrics.jsonl",
    "eval": "held-out accuracy",
    "run": "run directory, seed, threads, checkpoints",
}


def describe_fields(node: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One entry per leaf key, `"path = default\n    description"`; task keys per task kind,
    `task.name` once."""
    lines = []
    for name, field in node.model_fields.items():
        ann = field.annotation
        path = f"{prefix}{name}"
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines += describe_fields(ann, path + ".")
        elif name == "task" and node is Config:
            for i, kind in enumerate(BUILTIN_TASKS.values()):
                lines += [line for line in describe_fields(kind, "task.")
                          if i == 0 or not line.startswith("task.name ")]
        else:
            default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            lines.append(f"{path} = {default}\n    {field.description or ''}")
    return lines


def format_fields() -> str:
    """`tether config --fields`: every key under a header per section (per task kind for task)."""
    out = []
    for section, title in SECTIONS.items():
        out.append(f"[{section}] {title}")
        if section == "task":
            default = type(Config.model_fields["task"].default)
            out += [f"  {line}" for line in describe_fields(default, "task.")
                    if line.startswith("task.name ")]
            for kind, node in BUILTIN_TASKS.items():
                out.append(f"  with task.name={kind}:")
                out += [f"    {line}".replace("\n", "\n  ") for line in describe_fields(node, "task.")
                        if not line.startswith("task.name ")]
            out.append("  with task.name=package.module:Class: its constructor's keyword arguments")
        else:
            node = Config.model_fields[section].annotation
            out += [f"  {line}" for line in describe_fields(node, f"{section}.")]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
