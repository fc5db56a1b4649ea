"""The layer rule: every import in src/tether points down the declared layers.

    .venv/bin/python scripts/layers.py          each upward import, or "layers ok"; exit 1 on any

Every module of src/tether belongs to one layer of `LAYERS` (by its dotted name, longest
prefix first). A module may import its own layer and any layer below; an import of a
higher layer is a violation, wherever it is written: at the top, inside a function, under
`if TYPE_CHECKING`. An undeclared module is a violation too, so a new module states its
place. `ALLOWANCES` are the imports that skip the rule, each with its reason.
docs/architecture.md explains the layers; tests/test_layers.py runs this check and shows
that a planted upward import fails it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# Lowest first. A name is a module or a package (all its modules), as `tether.<name>`; a
# name written "=name" is that module or package file alone: the packages whose modules
# sit in different layers (rollout, weights) place each module by name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("=tether", "errors", "lazy", "defaults", "plugins", "logger", "ledger")),
    # Pure pieces that know nothing of one another's users: loss math, architectures,
    # tasks and rewards, the rollout data contract, sync policies, the advice rules.
    ("primitives", ("estimators", "models", "tasks", "rewards", "=rollout", "rollout.types",
                    "rollout.numerics", "=weights", "weights.policy", "weights.gate",
                    "weights.window", "weights.delta", "advice", "auto", "guards")),
    # Validates names against the estimator, task and sync-policy registries below it.
    ("config", ("config",)),
    # (weights, tokens) -> processed token log-probs: the forward everything above shares.
    ("scoring", ("scoring",)),
    # What holds or reads weights through scoring: engines, kept versions, the publisher,
    # the default model's build, diagnostics on scores, the tensor API, run set-up.
    ("engines", ("rollout.hf", "rollout.vllm_engine", "weights.publisher", "weights.snapshots",
                 "weights.synchronizer", "testbed", "diagnostics", "monitor", "evaluate", "api",
                 "dump", "checkpoint", "setup")),
    # The trained model and its ranks; the rollout workers and their backends.
    ("trainer", ("trainer", "distributed", "rollout.worker", "rollout.backend",
                 "rollout.ray_backend", "rollout.ray_start")),
    # One training step on a rewarded batch, and the run both loops build.
    ("step", ("step", "run")),
    ("loops", ("loops",)),
    # What users run: the CLI, experiments and reports, the probe, the integrations.
    ("applications", ("experiments", "probe", "inspection", "report", "integrations", "cli")),
]

# (importer, imported): imports that go against the layers, each with its reason. None today:
# rollout.backend -> rollout.ray_backend (an optional dependency's factory) is in one layer.
ALLOWANCES: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}: {self.why}"


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of `module` (dotted, without `tether.`), by longest prefix."""
    best, where = -1, None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            exact = name.startswith("=")
            name = name.lstrip("=")
            full = "tether" if name == "tether" else f"tether.{name}"
            if (module == full or not exact and module.startswith(full + ".")) and len(full) > best:
                best, where = len(full), i
    return where


def modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `src`/tether."""
    out = {}
    for p in sorted((src / "tether").rglob("*.py")):
        rel = p.relative_to(src).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    return out


def imported(node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The tether modules an import statement loads (`from a import b`: a.b when it is a module)."""
    names = []
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == "tether" or node.module.startswith("tether."):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.append(sub if sub in known else node.module)
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name == "tether" or a.name.startswith("tether.")]
    return names


def check(src: Path) -> list[Violation]:
    """Every upward or undeclared import in `src`/tether, and every undeclared module."""
    known = modules(src)
    out = []
    for module, path in known.items():
        mine = layer_of(module)
        if mine is None:
            out.append(Violation(path, 1, module, "-", "the module is in no layer of LAYERS"))
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in dict.fromkeys(imported(node, known)):  # once per statement
                theirs = layer_of(target)
                if theirs is None:
                    out.append(Violation(path, node.lineno, module, target, "in no layer"))
                elif theirs > mine and (module, target) not in ALLOWANCES:
                    out.append(Violation(
                        path, node.lineno, module, target,
                        f"layer {LAYERS[theirs][0]!r} is above {LAYERS[mine][0]!r}"))
    return out


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] + " Prints each upward "
                            "import (file:line, importer, imported, the two layers); exit 1 "
                            "on any.").parse_args()
    root = Path(__file__).resolve().parents[1]
    found = check(root / "src")
    for v in found:
        print(v)
    print(f"layers: {len(found)} upward import(s)" if found else
          f"layers ok: {len(modules(root / 'src'))} modules in {len(LAYERS)} layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
