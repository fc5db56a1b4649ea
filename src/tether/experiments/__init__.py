"""The papers' experiments on the embedded testbed (DESIGN.md section 7): one command each.

    tether experiment dlc|cis|vespo|auto [--quick] [--out DIR] [--seeds N] [--workers N]
                                         [--record DIR] [--set K=V ...]
    tether report DIR

`run(name, ...)` builds the matrix (`<name>.build`), runs the cells not yet done
(`runner.run_experiment`), then writes the tables (`analysis.summarize`: OUT/summary.csv,
OUT/cells.csv, OUT/summary.json). docs/experiments.md defines every number.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from tether.errors import InputError
from tether.experiments import analysis, auto, cis, dlc, record, vespo
from tether.experiments.runner import Cell, Experiment, run_experiment

EXPERIMENTS = {"dlc": dlc, "cis": cis, "vespo": vespo, "auto": auto}


def get(name: str):
    if name not in EXPERIMENTS:
        raise InputError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def select(exp: Experiment, only: list[str]) -> list[Cell]:
    """The cells of the groups `only` names ("scenario:method"), and the reference's, from the
    default matrix and the groups cut from it (`exp.extra`); InputError names an unknown one."""
    keep = {tuple(g.split(":", 1)) for g in only} | {tuple(exp.reference)}
    pool = exp.cells + exp.extra
    valid = list(dict.fromkeys((c.scenario, c.method) for c in pool))
    unknown = keep - set(valid)
    if unknown:
        raise InputError(f"--only: unknown group(s) {sorted(':'.join(g) for g in unknown)}; "
                         f"valid: {', '.join(':'.join(g) for g in valid)}")
    return [c for c in pool if (c.scenario, c.method) in keep]


def own_tables(module, summary: dict) -> list[tuple[str, list[dict], list[tuple[str, str]]]]:
    """The experiment's tables beside the groups' (claims, controls): (title, rows, columns)."""
    return module.tables(summary) if hasattr(module, "tables") else []


def tables_markdown(module, summary: dict, own: list[tuple[str, list[dict], list[tuple[str, str]]]]) -> str:
    """The groups' table and the experiment's `own` (`own_tables`), as `tether report` and a
    record's `tables.md` print them."""
    md = [analysis.markdown_table(summary["groups"], module.COLUMNS), ""]
    for title, rows, columns in own:
        md += [title, "", analysis.markdown_table(rows, columns), ""]
    return "\n".join(md)


def summary_tables(out: str | Path) -> tuple[dict, str]:
    """An experiment directory's summary (`analysis.summarize`, its module's `extend` applied)
    and its tables (`tables_markdown`)."""
    module = get(analysis.load_meta(Path(out))["name"])
    summary = analysis.summarize(Path(out), extend=getattr(module, "extend", None))
    return summary, tables_markdown(module, summary, own_tables(module, summary))


def record_tables(dest: str | Path, out: str | Path) -> dict:
    """Summarise `out` (the record `dest` restored, with any cells added) and write its tables
    to `dest`/tables.md, which tests/test_records.py regenerates from the record alone."""
    summary, md = summary_tables(out)
    Path(dest).mkdir(parents=True, exist_ok=True)  # a first --record: the cells are saved after
    (Path(dest) / record.TABLES).write_text(md)
    record.keep_cached(out, dest)  # what the summary measured on the starting model, once
    return summary


def run(name: str, out: str | Path | None = None, quick: bool = False, seeds: int | None = None,
        workers: int = 2, model_path: str | None = None, only: list[str] | None = None,
        overrides: list[str] | None = None, keep: str | Path | None = None, log=print) -> dict:
    """Run (or resume) experiment `name` into `out` and summarise it; returns the summary.

    `only`: keep just these groups, each "scenario:method" (e.g. a reduced slice, or groups
    cut from the default matrix: `exp.extra`); the reference group is always kept, since every
    deviation is measured against it.
    `overrides`: `key=value` settings appended to the shared base (checked here, so a bad
    key fails before any cell runs); each cell's own keys still apply after them.
    `keep`: a committed record (`record.kept`): restored into `out` first, so only the cells
    it lacks run, from its starting model; `out`'s finished cells recorded in it after.
    """
    from tether.config import load_config

    module = get(name)
    exp = module.build(quick=quick, seeds=seeds)
    if overrides:
        exp.base = exp.base + list(overrides)
        load_config(None, exp.base)  # ConfigError names the bad key
    if only:
        exp.cells = select(exp, only)
    out = Path(out or f"runs/experiments/{name}{'-quick' if quick else ''}")
    with record.kept(keep, out, log) if keep else nullcontext(None) as recorded:
        if recorded and model_path and Path(model_path).resolve() != Path(recorded):
            raise InputError(f"--model {model_path}: the record {keep} starts from its own model "
                             f"({recorded}); leave --model out")
        timing = run_experiment(exp, out, workers=workers, model_path=recorded or model_path, log=log)
        # Inside the record's span: the summary caches the probe log-probs the record keeps.
        summary = (record_tables(keep, out) if keep
                   else analysis.summarize(out, extend=getattr(module, "extend", None)))
    summary["timing"] = timing
    log(f"{name}: {timing['cells_run']} cell(s) run in {timing['wall_seconds']:.0f} s, "
        f"{timing['cells_failed']} failed; tables in {out}/summary.csv; "
        f"`tether report {out}` builds the page")
    return summary


__all__ = ["EXPERIMENTS", "Cell", "Experiment", "get", "own_tables", "record_tables", "run", "run_experiment", "select",
           "summary_tables", "tables_markdown"]
