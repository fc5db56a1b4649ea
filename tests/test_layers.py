"""Imports point down the layers (scripts/layers.py, docs/architecture.md): src/ keeps the
rule, and the check catches an upward import wherever it is written."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tether_layers", ROOT / "scripts" / "layers.py")
layers = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = layers  # its dataclass looks itself up there
spec.loader.exec_module(layers)


def test_every_import_in_src_points_down_the_layers():
    assert [str(v) for v in layers.check(ROOT / "src")] == []


def test_a_planted_upward_import_fails_the_check(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "tether", src / "tether",
                    ignore=shutil.ignore_patterns("__pycache__"))
    routing = src / "tether" / "models" / "routing.py"
    n = len(routing.read_text().splitlines())
    # Inside a function, as the upward imports this check was written against were.
    routing.write_text(routing.read_text() + "\n\ndef planted():\n"
                       "    from tether.trainer import Trainer\n    return Trainer\n")
    scoring = src / "tether" / "scoring" / "logprobs.py"
    scoring.write_text("import tether.step\n" + scoring.read_text())
    (src / "tether" / "undeclared.py").write_text("")
    found = {(v.importer, v.imported, v.line) for v in layers.check(src)}
    assert found == {("tether.models.routing", "tether.trainer", n + 4),
                     ("tether.scoring.logprobs", "tether.step", 1),
                     ("tether.undeclared", "-", 1)}


def test_the_layer_of_a_module_is_its_longest_declared_prefix():
    order = [name for name, _ in layers.LAYERS]
    assert order.index(layers.LAYERS[layers.layer_of("tether.weights.snapshots")][0]) > \
        order.index("scoring") > order.index(layers.LAYERS[layers.layer_of("tether.weights.policy")][0])
    assert layers.layer_of("tether.rollout") == order.index("primitives")  # "=rollout": the file alone
    assert layers.layer_of("tether.rollout.hf") == order.index("engines")
    assert layers.layer_of("tether.nowhere") is None  # "=tether" is the package file alone
