"""The committed records (results/*, issue 73): each restores into a fresh directory and
regenerates, from its cells alone, the tables it carries (`tables.md`, which `tether report
RECORD` writes). A change to the analysis that moves a committed figure fails here until the
record's tables are regenerated, and RESULTS.md with them."""

import gzip
import json
from pathlib import Path

import pytest

from tests.auto_replay import logged, replayed
from tether.config import load_config
from tether.experiments import record, summary_tables
from tether.loops.autocorrect import rule_of

RESULTS = Path(__file__).resolve().parents[1] / "results"
RECORDS = sorted(d for d in RESULTS.iterdir() if record.is_record(d)) if RESULTS.is_dir() else []


def test_every_record_carries_its_tables():
    assert RECORDS, "no committed record under results/"
    missing = [d.name for d in RECORDS if not (d / record.TABLES).is_file()]
    assert missing == [], f"`tether report results/<name>` writes each one's tables.md: {missing}"


@pytest.mark.parametrize("rec", RECORDS, ids=[d.name for d in RECORDS])
def test_a_record_restores_and_regenerates_its_tables(rec, tmp_path):
    out = record.unpacked(rec, tmp_path)
    assert record.restore(rec, out) == []  # every recorded cell is there: none left to restore
    _, tables = summary_tables(out)
    assert tables == (rec / record.TABLES).read_text(), (
        f"{rec.name}: its tables.md is not what its cells give; `tether report results/{rec.name}` "
        "rewrites it (a run stopped before its summary records cells but not their tables)")
    assert not list(rec.rglob("final"))  # no final models: the record keeps what the tables read
    # What the summary measures on the starting model is in the record, not re-measured.
    cached = {record.PROBE} | ({record.BIAS} if _name(rec) == "cis" else set())
    assert all((rec / name).is_file() for name in cached), f"{rec.name}: lacks {cached}"


def _name(rec: Path) -> str:
    return json.loads((rec / "experiment.json").read_text())["name"]


@pytest.mark.parametrize("rec", [d for d in RECORDS if _name(d) == "auto"],
                         ids=lambda d: d.name)
def test_a_records_auto_choices_replay_under_todays_rule(rec):
    """Every recorded auto cell logged, at each step, the choice today's controller makes from
    the step's logged figures. A change to the rule that moves a recorded choice fails here
    until the record's auto cells are run again: seeds run under two rules would be pooled
    into one sample (as three of `results/auto-power`'s were, before this test)."""
    meta = json.loads((rec / "experiment.json").read_text())
    cells = [c for c in meta["cells"] if c["method"] == "auto"]
    assert cells
    for c in cells:
        t = load_config(None, meta["base"] + c["overrides"])
        with gzip.open(rec / "cells" / c["name"] / "metrics.jsonl.gz", "rt") as f:
            rows = [r for r in map(json.loads, f) if "auto/numerical" in r]
        assert logged(rows) == replayed(rows, rule_of(t).controller), c["name"]
