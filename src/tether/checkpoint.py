"""Checkpoints: everything a run carries from one step to the next, written atomically.

A run's state between steps is the trainer (weights, optimizer moments, weight version,
guard counters), the synchronizer (the generator's weight version, steps since the last
re-sync, and the snapshot store: fp32 weights of every version a later `logp_old` or a
lagged delivery still needs), and the RNG states. Sampling seeds are a function of the step and training problems a function of
their index, so the step number is also the position in the data. Restoring all of it
makes a resumed synchronous run continue bit for bit (tests/test_resume.py).

Layout (docs/reliability.md):

    RUN_DIR/checkpoints/step-00000012/
        state.safetensors   every tensor: weights, optimizer moments, snapshots, RNG states
        state.json          everything else, and where each tensor belongs

Nothing is pickled: tensors go to safetensors, the rest to JSON, and loading reads
both back with safetensors and json alone. A checkpoint is written into a temporary
directory and renamed into place, so a kill at any moment leaves either the whole
checkpoint or none; only then are the oldest beyond `run.keep_checkpoints` removed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from tether.config import Config, ConfigError, load_config, parse_overrides, resumable_keys
from tether.errors import InputError, os_errors_at

FORMAT = 1
CHECKPOINTS = "checkpoints"
SHARDS = "shards"
_STEP_DIR = re.compile(r"^step-(\d{8})$")

RESUME_OVERRIDABLE = tuple(resumable_keys())
"""Config keys (or sections, ending in ".") a resumed run may change: those the schema marks
RESUMABLE (tether.config.sections says why each may). They do not change the trajectory;
every other key does, and is refused on resume."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Shards(Protocol):
    """A sharded trainer's weights, moments and kept versions (tether.trainer.spmd): every
    rank writes its own shards into one directory, and reads them back at any world size."""

    def save(self, path: Path, versions: list[int]) -> None: ...
    def load(self, path: Path, versions: list[int], counters: dict[str, Any]) -> None: ...


@dataclass
class RunState:
    """What a checkpoint holds: the objects the loop carries from step to step.

    `trainer` (tether.trainer.Trainer) has state_dict/load_state_dict and `.model`;
    `sync` (tether.weights.Synchronizer, or the async loop's Scheduler) has `snapshots`,
    state_dict() and load_state_dict(state, snapshots), and owns the generator's version
    and the snapshot store: restoring it puts the kept weights back (and reloads the
    generator, or cuts the ledger and re-issues what was in flight). `extra` takes any further
    stateful part (name -> object with state_dict/load_state_dict). `shards`, when the
    trainer is sharded: the weights, moments and kept versions go to RUN_DIR/checkpoints/
    step-N/shards (torch.distributed.checkpoint, each rank its own), the rest as above.
    """

    trainer: Any
    sync: Any
    extra: dict[str, Stateful] = field(default_factory=dict)
    shards: Shards | None = None  # train.sharding=fsdp: weights, moments, kept versions


# --- save / load -------------------------------------------------------------------------


def save_checkpoint(run_dir: str | Path, step: int, state: RunState, keep: int) -> Path:
    """Write the state after `step` steps to RUN_DIR/checkpoints/step-N; keep the last `keep`."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step:08d}"
    if final.is_dir():  # written already (a resumed run's first step re-reaching it)
        return final
    root.mkdir(parents=True, exist_ok=True)
    tree = _capture(step, state)
    encoder = _Encoder()
    meta = encoder.encode(tree, "")
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step-{step:08d}-"))
    if state.shards is not None:
        state.shards.save(tmp / SHARDS, state.sync.snapshots.versions)
    with os_errors_at(tmp / "state.safetensors"):
        save_file(encoder.tensors, tmp / "state.safetensors", metadata={"format": "pt"})
    (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "step": step, "state": meta}))
    mask = os.umask(0)
    os.umask(mask)  # (mkdtemp and safetensors create private files; a run dir is shared as usual)
    os.chmod(tmp, 0o777 & ~mask)
    for name in ("state.safetensors", "state.json"):
        os.chmod(tmp / name, 0o666 & ~mask)
        _fsync(tmp / name)
    os.rename(tmp, final)
    _fsync(root)
    _prune(root, keep)
    return final


def load_checkpoint(run_dir: str | Path, state: RunState) -> int:
    """Restore the latest checkpoint of RUN_DIR into `state`; return its step (0: none yet).

    Also trims RUN_DIR/metrics.jsonl to the rows of steps up to the checkpoint, so the
    continued run appends the rows a kill lost, each exactly once.
    """
    run_dir = Path(run_dir)
    ckpt = latest_checkpoint(run_dir)
    step = 0
    if ckpt is not None:
        try:
            doc = json.loads((ckpt / "state.json").read_text())
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, this tether reads {FORMAT}")
            tree = _decode(doc["state"], load_file(ckpt / "state.safetensors"))
            step = int(doc["step"])
        except (OSError, ValueError, KeyError, TypeError, IndexError, SafetensorError) as e:
            # damaged on disk: name it and the way out
            raise InputError(
                f"checkpoint {ckpt} cannot be read ({type(e).__name__}: {e}); remove that "
                f"directory to resume from the one before it"
            ) from None
        _restore(tree, state, ckpt)
    trim_metrics(run_dir / "metrics.jsonl", step if ckpt is not None else -1)  # none: start over
    return step


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def checkpoint_due(step: int, every: int, last_step: int) -> bool:
    """After `step` steps: every `every` steps (0: never) and after the last one."""
    return step == last_step or (every > 0 and step % every == 0)


def trim_metrics(path: Path, step: int) -> None:
    """Keep the rows of steps <= `step` (atomically); a missing file stays missing."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if ln.strip() and _row_step(ln) <= step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _row_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except ValueError:  # a line cut short by a kill
        return 1 << 62


# --- resume: config and run directory ----------------------------------------------------


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> Config:
    """The config of the run in RUN_DIR with `overrides` that do not change its trajectory.

    Raises ConfigError when RUN_DIR is not a run, an override changes the trajectory,
    or there is nothing left to run.
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there, so it is not a tether run directory")
    for key in _leaf_keys(parse_overrides(overrides or [])):
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_OVERRIDABLE):
            raise ConfigError(
                f"--resume: {key} cannot change when resuming: it changes the run's trajectory "
                f"(the continued run would not be the run in {run_dir}). Allowed: "
                f"{', '.join(k + '*' if k.endswith('.') else k for k in RESUME_OVERRIDABLE)}. "
                f"To change {key}, start a new run"
            )
    cfg = load_config(cfg_path, overrides)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"dir": str(run_dir)})})
    done = list_checkpoints(run_dir)
    if done and done[-1][0] > cfg.train.steps:
        raise ConfigError(
            f"--resume {run_dir}: its last checkpoint is at step {done[-1][0]}, past "
            f"train.steps={cfg.train.steps}; give train.steps >= {done[-1][0]}"
        )
    if done and done[-1][0] == cfg.train.steps:
        raise ConfigError(
            f"--resume {run_dir}: the run is complete ({cfg.train.steps} steps); to train "
            f"longer, give more: train.steps={2 * cfg.train.steps}"
        )
    return cfg


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run must not write into another run's directory (its rows and checkpoints)."""
    metrics = run_dir / "metrics.jsonl"
    if list_checkpoints(run_dir) or (metrics.is_file() and metrics.stat().st_size > 0):
        raise ConfigError(
            f"run.dir={run_dir} already holds a run; continue it with "
            f"`tether train --resume {run_dir}`, or choose another run.dir"
        )


def _leaf_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in tree.items():
        keys += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return keys


# --- what is captured, and how it is put back --------------------------------------------

_TRAINER_WEIGHTS = "$trainer_weights"  # a snapshot equal to the trainer's weights, stored once


def _capture(step: int, state: RunState) -> dict[str, Any]:
    snapshots = {}
    if state.shards is not None:  # weights, moments and kept versions are in the shards
        trainer = state.trainer.counters()
    else:
        trainer = state.trainer.state_dict()
        store, current = state.sync.snapshots, state.trainer.version
        for v in store.versions:
            weights = store.state(v)
            same = v == current and _equal(weights, trainer["model"])
            snapshots[v] = _TRAINER_WEIGHTS if same else weights
    return {
        "step": step,
        "trainer": trainer,
        "sync": state.sync.state_dict(),
        "snapshots": snapshots,  # version -> fp32 state dict
        "extra": {name: part.state_dict() for name, part in state.extra.items()},
        "rng": rng_state(),
    }


def _restore(tree: dict[str, Any], state: RunState, ckpt: Path) -> None:
    if state.shards is not None:
        if not (ckpt / SHARDS).is_dir():
            raise InputError(f"checkpoint {ckpt} holds no {SHARDS}/: it was written by a "
                             "trainer that was not sharded, so this run cannot resume from it")
        state.shards.load(ckpt / SHARDS, [int(v) for v in tree["sync"]["snapshot_versions"]],
                          tree["trainer"])  # every rank's trainer: its version and counters too
        snapshots = {}
    else:
        state.trainer.load_state_dict(tree["trainer"])
        weights = state.trainer.model.state_dict()
        snapshots = {int(v): weights if w == _TRAINER_WEIGHTS else w
                     for v, w in tree["snapshots"].items()}
    state.sync.load_state_dict(tree["sync"], snapshots)  # copies them; reloads the generator
    for name, part in state.extra.items():
        part.load_state_dict(tree["extra"][name])
    set_rng_state(tree["rng"])


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def rng_state() -> dict[str, Any]:
    """Every process-global generator: torch CPU (and CUDA), Python `random`, NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- a pickle-free codec: nested containers -> JSON plus a flat dict of tensors ------------

_TENSOR, _NDARRAY, _TUPLE, _ITEMS = "$tensor", "$ndarray", "$tuple", "$items"


class _Encoder:
    """JSON-able tree with tensors replaced by {"$tensor": key}; tensors collected by key.

    Tuples, dicts with non-string keys (optimizer state is keyed by int) and NumPy arrays
    are tagged so they decode to the same types. A tensor seen twice (tied embeddings)
    is stored once and referenced twice.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._views: dict[tuple, str] = {}
        self._storages: set[int] = set()

    def encode(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return {_TENSOR: self._put(obj, path)}
        if isinstance(obj, np.ndarray):
            return {_NDARRAY: self._put(torch.from_numpy(obj.copy()), path)}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in obj):
                return {k: self.encode(v, f"{path}/{k}") for k, v in obj.items()}
            for k in obj:
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise TypeError(f"checkpoint: key {k!r} at {path or '/'} is not a JSON scalar")
            return {_ITEMS: [[k, self.encode(v, f"{path}/{k}")] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {_TUPLE: [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(
            f"checkpoint: cannot store a {type(obj).__name__} at {path or '/'}; a state_dict "
            f"may hold tensors, arrays, numbers, strings, lists, tuples and dicts"
        )

    def _put(self, t: torch.Tensor, path: str) -> str:
        t = t.detach()
        storage = t.untyped_storage().data_ptr()
        view = (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if view in self._views:
            return self._views[view]
        # safetensors refuses tensors sharing memory: a second view of one storage is copied.
        t = t.to("cpu").contiguous()
        if storage in self._storages and t.numel():
            t = t.clone()
        self._storages.add(storage)
        self._views[view] = path
        self.tensors[path] = t
        return path


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == _TENSOR:
            return tensors[value]
        if tag == _NDARRAY:
            return tensors[value].numpy()
        if tag == _TUPLE:
            return tuple(_decode(v, tensors) for v in value)
        if tag == _ITEMS:
            return {k: _decode(v, tensors) for k, v in value}
    return {k: _decode(v, tensors) for k, v in obj.items()}


# --- files ---------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints, and leftovers of killed writes.

    A directory is renamed out of the `step-N` namespace before it is deleted, so a kill
    during deletion never leaves a partial checkpoint that looks complete.
    """
    for _, old in list_checkpoints(root.parent)[:-keep]:
        trash = root / f".trash-{old.name}"
        os.rename(old, trash)
        shutil.rmtree(trash, ignore_errors=True)
    for leftover in root.glob(".t*-step-*"):  # .tmp-step-* of a killed save, old .trash-*
        shutil.rmtree(leftover, ignore_errors=True)
