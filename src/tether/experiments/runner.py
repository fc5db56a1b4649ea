"""Run an experiment's matrix of cells (scenario x method x seed), in parallel, resumably.

Each cell is one `tether.loops.train(cfg)` run in its own directory `OUT/cells/<name>`,
in its own spawned (non-daemonic: an async cell starts rollout worker processes) process
with one torch thread, at most `workers` at once. A cell is done when its directory holds
`done.json` (written after `train` returns, next to `final/`); a rerun skips done cells,
resumes a cell that has a checkpoint and restarts one that has neither. A done cell's
checkpoints are removed (it is never resumed; `final/` keeps its weights): kept, they were
18 GB of E-AUTO's 71 cells and 27 GB of E-DLC's 108, and filled the disk. The parent
resolves (builds or finds) the starting model once, so workers never race to build it.

What it simplifies: cells run to completion or fail on their own (a failed cell is
recorded in `OUT/failed.json` with its error and does not stop the others).

Nothing outlives the command: each cell runs in a process group of its own, which the
parent ends when the cell is done and on every way out (an error, SIGINT, SIGTERM); a cell
whose parent was killed outright (SIGKILL) ends its own group within a second.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_lib
import shutil
import signal
import threading
import time
import traceback
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tether.errors import InputError
from tether.models import quiet_transformers

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
# Every cell of a full matrix samples its held-out answers with the same draws (common random
# numbers, `eval.seed`): equal weights score equally, so the seed-to-seed spread is the
# policies'. With each cell's own draws, E-VESPO's 5 reference seeds' step-0 scores of one
# model spread 0.156-0.203 (sd 0.017), more than E-DLC's reference sigma.
EVAL_SEED = 7919


@dataclass(frozen=True)
class Cell:
    """One run of the matrix: a scenario (the generator), a method (the estimator), a seed."""

    scenario: str
    method: str
    seed: int
    overrides: tuple[str, ...]  # dotted key=value, applied after the experiment's base

    @property
    def name(self) -> str:
        return f"{self.scenario}__{self.method}__s{self.seed}"


@dataclass
class Experiment:
    """A named matrix with its shared settings and the group that is the on-policy reference."""

    name: str
    question: str  # the one question the experiment answers
    base: list[str]  # overrides shared by every cell
    cells: list[Cell]
    reference: tuple[str, str]  # (scenario, method) of the on-policy runs
    notes: list[str] = field(default_factory=list)  # departures from the paper, stated
    # Groups cut from the default matrix to fit the hour, kept runnable: `--only` may name them.
    extra: list[Cell] = field(default_factory=list)

    def groups(self) -> list[tuple[str, str]]:
        seen: dict[tuple[str, str], None] = {}
        for c in self.cells:
            seen[(c.scenario, c.method)] = None
        return list(seen)


def cell_dir(out: Path, cell: Cell) -> Path:
    return Path(out) / "cells" / cell.name


def is_done(out: Path, cell: Cell) -> bool:
    return (cell_dir(out, cell) / "done.json").is_file()


def _run_cell(job: tuple[list[str], str]) -> tuple[str, float, str | None]:
    """Worker: train one cell (resume if it has a checkpoint). Returns (dir, seconds, error)."""
    overrides, run_dir = job
    t0 = time.perf_counter()
    try:
        import torch

        torch.set_num_threads(1)
        quiet_transformers()
        from tether.checkpoint import CHECKPOINTS, list_checkpoints
        from tether.config import load_config
        from tether.loops import train

        d = Path(run_dir)
        resume = d.is_dir() and bool(list_checkpoints(d))
        if d.is_dir() and not resume:
            shutil.rmtree(d)  # a start that never reached a checkpoint: begin again
        cfg = load_config(None, overrides + [f"run.dir={run_dir}", "run.progress=false",
                                              "run.threads=1"])
        result = train(cfg, resume=resume)
        seconds = time.perf_counter() - t0
        (d / "done.json").write_text(json.dumps({
            "seconds": seconds, "accuracy_before": result.accuracy_before,
            "accuracy_after": result.accuracy_after, "resumed": resume}))
        shutil.rmtree(d / CHECKPOINTS, ignore_errors=True)  # done: never resumed (docstring)
        return run_dir, seconds, None
    except Exception:  # noqa: BLE001 - one failed cell must not stop the matrix; see failed.json
        return run_dir, time.perf_counter() - t0, traceback.format_exc(limit=4)


def _cell_process(job: tuple[list[str], str], results, parent_pid: int) -> None:
    """A cell in a process group of its own (it and every process it starts: the parent
    ends them together), ending that group within a second of losing its parent (a parent
    killed with SIGKILL cannot end it)."""
    os.setpgid(0, 0)
    threading.Thread(target=_end_with_parent, args=(parent_pid,), daemon=True,
                     name="tether-cell-watch").start()
    results.put(_run_cell(job))


def _end_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.killpg(os.getpgid(0), signal.SIGKILL)  # this cell's group only (setpgid above)


def _end_cell(proc: mp.process.BaseProcess) -> None:
    """End a cell's process group: the cell and whatever it started (rollout workers, ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not yet its own group, or already gone
        if proc.is_alive():
            proc.kill()
    proc.join()


def _run_parallel(jobs: list[tuple[list[str], str]], workers: int):
    """Yield `_run_cell`'s result for every job, at most `workers` at once, as they finish.

    Each cell is its own spawned, non-daemonic process (a fresh interpreter: no torch thread
    pools inherited), not a multiprocessing.Pool worker: Pool workers are daemonic, and a
    daemonic process may not have children, which an async cell (loop.mode=async) starts
    for its rollout workers. A cell process that dies without reporting (killed, out of
    memory) is reported as failed with its exit code.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    pending, running = list(jobs), {}  # run_dir -> (process, start time)
    dead: dict[str, int] = {}  # run_dir -> polls since its process was seen exited
    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                job = pending.pop(0)
                proc = ctx.Process(target=_cell_process, args=(job, results, os.getpid()),
                                   daemon=False,
                                   name=f"tether-cell-{Path(job[1]).name}")
                # A stop signal waits until the cell is started and known, so it is ended too.
                held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                try:
                    proc.start()
                    running[job[1]] = (proc, time.perf_counter())
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, held)
            try:
                run_dir, seconds, error = results.get(timeout=1.0)
            except queue_lib.Empty:
                for run_dir, (proc, t0) in list(running.items()):
                    if proc.is_alive():
                        continue
                    dead[run_dir] = dead.get(run_dir, 0) + 1
                    if dead[run_dir] >= 5:  # exited and nothing came in 5 s: it never reported
                        del running[run_dir]
                        yield run_dir, time.perf_counter() - t0, (
                            f"cell process exited with code {proc.exitcode} without a result")
                continue
            if run_dir in running:
                proc = running.pop(run_dir)[0]
                proc.join(timeout=60)  # its result is in: a process that hangs at exit
                _end_cell(proc)  # must not hold the matrix (seen with an async cell)
                yield run_dir, seconds, error
    finally:  # stopped early (an error, SIGINT, SIGTERM): no cell outlives the command
        for proc, _ in running.values():
            _end_cell(proc)


def resolve_start_model(base: list[str], model_path: str | None) -> str:
    """The starting model every cell loads: `model_path`, or the default one built once here."""
    if model_path:
        return str(Path(model_path).expanduser())
    from tether.config import load_config
    from tether.setup import resolve_model_path

    return str(resolve_model_path(load_config(None, base)))


def run_experiment(exp: Experiment, out: str | Path, workers: int = 2,
                   model_path: str | None = None, log=print) -> dict:
    """Run every cell of `exp` not yet done into `out`; write experiment.json; return timing."""
    import torch

    torch.set_num_threads(1)  # the parent builds the model and the probe: one thread, as the cells
    quiet_transformers()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    previous = out / "experiment.json"
    planned = list(exp.cells)  # what this invocation runs; an earlier slice's cells are only reported
    if previous.is_file():  # finished cells are only reusable under the same settings
        old = json.loads(previous.read_text())
        if (old["name"], old["base"]) != (exp.name, exp.base):
            raise InputError(f"{out} holds experiment {old['name']!r} with other settings "
                             f"({' '.join(old['base'])}); choose another --out")
        # A slice (--only, --seeds) run into the same directory adds to the cells reported.
        known = {c.name for c in planned}
        earlier = [Cell(c["scenario"], c["method"], c["seed"], tuple(c["overrides"]))
                   for c in old["cells"] if c["name"] not in known]
        exp.cells = earlier + exp.cells
        # Their notes too, keyed by a note's head ("N4_race: ..."): an earlier slice's line
        # (another race's settings) still describes cells the report reads; this plan's
        # line replaces an earlier one with the same head (another reference seed count).
        heads = {n.split(": ", 1)[0] for n in exp.notes}
        exp.notes = exp.notes + [n for n in old.get("notes", []) if n.split(": ", 1)[0] not in heads]
    start_model = resolve_start_model(exp.base, model_path)
    meta = {"name": exp.name, "question": exp.question, "base": exp.base,
            "reference": list(exp.reference), "notes": exp.notes, "model_path": start_model,
            "cells": [asdict(c) | {"name": c.name} for c in exp.cells]}
    (out / "experiment.json").write_text(json.dumps(meta, indent=1))
    todo = [c for c in planned if not is_done(out, c)]
    log(f"{exp.name}: {len(planned)} cells, {len(planned) - len(todo)} done, "
        f"{len(todo)} to run on {min(workers, max(len(todo), 1))} worker(s)")
    # A cell with its own model.* keys (vespo's MoE rows: model.moe=true) starts from
    # tether's default model for them, built once here, not from `model_path`.
    starts = {(): start_model}

    def start_of(cell: Cell) -> str:
        key = tuple(o for o in cell.overrides if o.startswith("model."))
        if key not in starts:
            starts[key] = resolve_start_model(exp.base + list(key), None)
        return starts[key]

    jobs = [(exp.base + list(c.overrides) + [f"model.path={start_of(c)}", f"run.seed={c.seed}"],
             str(cell_dir(out, c))) for c in todo]
    t0 = time.perf_counter()
    failed, ran, stopped = {}, 0, True
    try:
        with closing(_run_parallel(jobs, workers)) as finished:  # any exit ends the running cells
            for ran, (run_dir, seconds, error) in enumerate(finished, 1):
                name = Path(run_dir).name
                status = "FAILED" if error else "done"
                log(f"  [{ran}/{len(jobs)}] {name}: {status} in {seconds:.0f} s")
                if error:
                    failed[name] = error
        stopped = False
    finally:  # a stopped run's line too: the time a record accrued is every run's
        timing = {"wall_seconds": time.perf_counter() - t0, "cells_run": ran,
                  "cells_failed": len(failed), "workers": workers} | ({"stopped": True} if stopped else {})
        (out / "failed.json").write_text(json.dumps(failed, indent=1))
        history = json.loads((out / "timing.json").read_text()) if (out / "timing.json").is_file() else []
        (out / "timing.json").write_text(json.dumps(history + [timing], indent=1))
    return timing
