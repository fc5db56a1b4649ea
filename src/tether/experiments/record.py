"""A committed record of an experiment's finished cells, so a long matrix accrues across machines.

A cell is a deterministic function of its settings (`run_experiment` reruns one to the same
numbers), and the summary reads only its metrics, its `done.json` and its cached probe
log-probs. `save` copies those three (the metrics gzipped) from `OUT/cells/<name>/` into
`DEST/cells/<name>/`, with `experiment.json`; `restore` puts them back into an output
directory, so the runner skips those cells and `analysis.summarize` reports them beside new
ones. Checkpoints and final models stay out: megabytes per cell, and the probe is cached.
The probe set itself (`probe.pt`, 33 kB) goes in once: sampled afresh from the starting
model on another CPU it could differ, and the cached log-probs would then score other
responses. E-CIS's bias table on the starting model (`truncation_bias.json`) likewise.

The starting model goes in once (`DEST/model`, about 9.5 MB for the tiny model): a warm
start rebuilt on another machine is not bit-identical (its step-0 sampled accuracy on the
shared draws was 0.182 on one, 0.198 on another), and cells from two starts are two
testbeds. `start_model(DEST)` gives it to the runner, so every machine trains from the same
weights.

`kept(DEST, OUT)` wraps a run: it restores first, gives the recorded starting model, and
records what finished on every way out (a stopped run keeps its finished cells), so
resuming a half-finished record on any machine runs only the cells it lacks.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

KEPT = ("done.json", "probe_logp.pt")
MODEL = "model"
PROBE = "probe.pt"  # analysis.make_probe's cache: the responses every cell's probe log-probs score
BIAS = "truncation_bias.json"  # E-CIS's bias table on the starting model (cis.truncation_bias)
CACHED = (PROBE, BIAS)  # measured once on the starting model: kept once, reused on any machine
TABLES = "tables.md"  # the tables `tether report` prints, regenerated from the record by a test
TIMING = "timing.json"  # every run's line (cells, seconds, workers), from every machine


def start_model(dest: str | Path) -> str | None:
    """The recorded starting model's directory, or None before the first record."""
    d = Path(dest) / MODEL
    return str(d.resolve()) if (d / "config.json").is_file() else None


def save(out: str | Path, dest: str | Path) -> list[str]:
    """Record every done cell of `out` in `dest` (rewriting those it holds, byte for byte the
    same unless the cell changed); keep the cells `dest` recorded that `out` lacks; return
    the names recorded."""
    out, dest = Path(out), Path(dest)
    if not (out / "experiment.json").is_file():  # stopped before the runner wrote its plan
        return []
    names = [cell.parent.name for cell in sorted((out / "cells").glob("*/done.json"))]
    for name in names:
        _copy_cell(out / "cells" / name, dest / "cells" / name, pack=True)
    meta = json.loads((out / "experiment.json").read_text())
    if start_model(dest) is None:
        shutil.copytree(meta["model_path"], dest / MODEL)
    keep_cached(out, dest)
    recorded = dest / "experiment.json"
    earlier = json.loads(recorded.read_text())["cells"] if recorded.is_file() else []
    done = {c["name"]: c for c in meta["cells"] if c["name"] in names}
    meta["cells"] = ([done.pop(c["name"], c) for c in earlier]  # the recorded order kept, new cells after
                     + list(done.values()))
    meta["model_path"] = MODEL  # relative to the record: `restore` resolves it on each machine
    recorded.write_text(json.dumps(meta, indent=1))
    if (out / TIMING).is_file():  # the runs' lines accrue; a restored run carries the earlier ones
        runs = json.loads((dest / TIMING).read_text()) if (dest / TIMING).is_file() else []
        runs += [t for t in json.loads((out / TIMING).read_text()) if t not in runs]
        (dest / TIMING).write_text(json.dumps(runs, indent=1))
    return names


def _copy_cell(src: Path, to: Path, pack: bool) -> None:
    """Copy a cell's kept files; its metrics gzipped (`pack`, with no timestamp, so an
    unchanged cell rewrites the same bytes) or back to plain JSON lines."""
    to.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        if (src / name).is_file():
            shutil.copyfile(src / name, to / name)
    if pack:
        with open(src / "metrics.jsonl", "rb") as f, open(to / "metrics.jsonl.gz", "wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as g:
            shutil.copyfileobj(f, g)
    else:
        with gzip.open(src / "metrics.jsonl.gz", "rb") as f, open(to / "metrics.jsonl", "wb") as g:
            shutil.copyfileobj(f, g)


def restore(dest: str | Path, out: str | Path) -> list[str]:
    """Put `dest`'s recorded cells that `out` lacks into `out`, and their entries into its
    `experiment.json` (created from the record's if `out` has none); return their names.
    The runner then refuses the directory if the record's settings differ from the run's."""
    dest, out = Path(dest), Path(out)
    if not (dest / "experiment.json").is_file():
        return []
    record = json.loads((dest / "experiment.json").read_text())
    meta_path = out / "experiment.json"
    meta = (json.loads(meta_path.read_text()) if meta_path.is_file()
            else {**record, "model_path": start_model(dest), "cells": []})
    known = {c["name"] for c in meta["cells"]}
    names = []
    for c in record["cells"]:
        src, to = dest / "cells" / c["name"], out / "cells" / c["name"]
        if (to / "done.json").is_file():
            continue
        if to.exists():  # a cell begun here: the record's finished one replaces it
            shutil.rmtree(to)
        _copy_cell(src, to, pack=False)
        if c["name"] not in known:
            meta["cells"].append(c)
        names.append(c["name"])
    out.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(meta, indent=1))
    _copy_missing(dest, out, (*CACHED, TIMING))
    return names


def keep_cached(out: str | Path, dest: str | Path) -> None:
    """Copy what the summary measured once on the starting model (CACHED) from `out` into the
    record `dest` where it lacks it: a report elsewhere then scores the same responses and
    reads the same bias table, with no forward pass of its own."""
    _copy_missing(out, dest, CACHED)


def _copy_missing(src: str | Path, to: str | Path, names: tuple[str, ...]) -> None:
    """Each of `names` that `src` holds and `to` lacks, copied into `to`."""
    for name in names:
        if (Path(src) / name).is_file() and not (Path(to) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(to) / name)


@contextmanager
def kept(dest: str | Path, out: str | Path, log: Callable[[str], None] = print) -> Iterator[str | None]:
    """Restore `dest`'s cells into `out`, yield the recorded starting model (None before the
    first record: the run's own start is then recorded), and record `out`'s finished cells in
    `dest` on the way out, also when the run stops or fails."""
    log(f"restored {len(restore(dest, out))} recorded cells from {dest}")
    try:
        yield start_model(dest)
    finally:
        log(f"recorded {len(save(out, dest))} cells in {dest}")


def is_record(d: str | Path) -> bool:
    """Whether `d` is a record (packed metrics, its starting model) rather than a run's directory."""
    return start_model(d) is not None and (Path(d) / "experiment.json").is_file()


def unpacked(dest: str | Path, root: str | Path = "runs/records") -> Path:
    """The record restored into ROOT/<its name> (cells it already holds kept): a directory
    `tether report` and `analysis.summarize` read like any run's."""
    out = Path(root) / Path(dest).resolve().name
    restore(dest, out)
    return out
