"""The papers' experiments on the embedded testbed (DESIGN.md section 7): one command each.

    tether experiment dlc|cis|vespo [--quick] [--out DIR] [--seeds N] [--workers N] [--set K=V ...]
    tether report DIR

`run(name, ...)` builds the matrix (`<name>.build`), runs the cells not yet done
(`runner.run_experiment`), then writes the tables (`analysis.summarize`: OUT/summary.csv,
OUT/cells.csv, OUT/summary.json). docs/experiments.md defines every number.
"""

from __future__ import annotations

from pathlib import Path

from tether.errors import InputError
from tether.experiments import analysis, cis, dlc, vespo
from tether.experiments.runner import Cell, Experiment, run_experiment

EXPERIMENTS = {"dlc": dlc, "cis": cis, "vespo": vespo}


def get(name: str):
    if name not in EXPERIMENTS:
        raise InputError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def run(name: str, out: str | Path | None = None, quick: bool = False, seeds: int | None = None,
        workers: int = 2, model_path: str | None = None, only: list[str] | None = None,
        overrides: list[str] | None = None, log=print) -> dict:
    """Run (or resume) experiment `name` into `out` and summarise it; returns the summary.

    `only`: keep just these groups, each "scenario:method" (e.g. a reduced slice); the
    reference group is always kept, since every deviation is measured against it.
    `overrides`: `key=value` settings appended to the shared base (checked here, so a bad
    key fails before any cell runs); each cell's own keys still apply after them.
    """
    from tether.config import load_config

    module = get(name)
    exp = module.build(quick=quick, seeds=seeds)
    if overrides:
        exp.base = exp.base + list(overrides)
        load_config(None, exp.base)  # ConfigError names the bad key
    if only:
        keep = {tuple(g.split(":", 1)) for g in only} | {tuple(exp.reference)}
        unknown = keep - set(exp.groups())
        if unknown:
            raise InputError(f"--only: unknown group(s) {sorted(':'.join(g) for g in unknown)}; "
                             f"valid: {', '.join(':'.join(g) for g in exp.groups())}")
        exp.cells = [c for c in exp.cells if (c.scenario, c.method) in keep]
    out = Path(out or f"runs/experiments/{name}{'-quick' if quick else ''}")
    timing = run_experiment(exp, out, workers=workers, model_path=model_path, log=log)
    summary = analysis.summarize(out, extend=getattr(module, "extend", None))
    summary["timing"] = timing
    log(f"{name}: {timing['cells_run']} cell(s) run in {timing['wall_seconds']:.0f} s, "
        f"{timing['cells_failed']} failed; tables in {out}/summary.csv; "
        f"`tether report {out}` builds the page")
    return summary


__all__ = ["EXPERIMENTS", "Cell", "Experiment", "get", "run", "run_experiment"]
