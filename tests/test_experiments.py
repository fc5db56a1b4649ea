"""The experiments (`tether experiment NAME --quick`) and `tether report`, end to end.

Each quick variant runs its reduced matrix into a tmp dir, must write its tables, must skip
every cell when run again, and its report must reference only figures that exist.
"""

from __future__ import annotations

import base64
import csv
import itertools
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tether.cli import main
from tether.config import load_config
from tether.errors import InputError
from tether.experiments import analysis, get, record, select, verdicts
from tether.testbed import ensure_default_model

from .conftest import TEST_CACHE

MOE_WARMSTART_STEPS = 20  # enough for a smoke run; the full experiment warm-starts 200


@pytest.fixture(scope="session")
def moe_model_dir():
    return ensure_default_model(TEST_CACHE, moe=True, seed=0, warmstart_steps=MOE_WARMSTART_STEPS,
                                task_kwargs={"use_all": True}, verbose=False)


@pytest.mark.parametrize("name", ["dlc", "cis", "vespo", "auto"])
def test_quick_experiment_tables_resume_and_report(name, tmp_path, warm_model_dir, moe_model_dir, monkeypatch):
    out = tmp_path / name
    model = moe_model_dir if name == "cis" else warm_model_dir
    args = ["experiment", name, "--quick", "--out", str(out), "--model", str(model)]
    assert main(args) == 0
    exp = get(name).build(quick=True)
    with open(out / "summary.csv") as f:
        groups = list(csv.DictReader(f))
    assert {(g["scenario"], g["method"]) for g in groups} == set(exp.groups())
    for cell in exp.cells:
        d = out / "cells" / cell.name
        assert (d / "done.json").is_file() and (d / "final" / "config.json").is_file()
        assert not (d / "checkpoints").exists()  # a done cell is never resumed: no dead weight
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        settings = dict(o.split("=", 1) for o in exp.base + list(cell.overrides))  # cell's last
        assert rows[-1]["step"] == int(settings["train.steps"])
    assert json.loads((out / "failed.json").read_text()) == {}

    # Resumable: a second run finds every cell done, runs none and rewrites no cell's files.
    stamps = {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("*") if p.is_file()}
    assert main(args) == 0
    timing = json.loads((out / "timing.json").read_text())
    assert timing[-1]["cells_run"] == 0 and len(timing) == 2
    assert {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("*") if p.is_file()} == stamps

    # The report: every figure the HTML links exists, every embedded image is a PNG.
    assert main(["report", str(out)]) == 0
    page = (out / "report" / "index.html").read_text()
    linked = re.findall(r'href="([^"]+\.png)"', page)
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(linked) == len(embedded) >= 2
    for fname in linked:
        assert (out / "report" / fname).is_file()
    for data in embedded:
        assert base64.b64decode(data)[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report" / "summary.md").read_text()
    for fname in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / "report" / fname).is_file()
    assert "| " + exp.reference[0] + " |" in md  # the table, with the reference group's row
    # The reference line's number is the mean over the reference seeds of each run's own
    # headline, read back from the raw metrics files.
    ref_rows = [[json.loads(line) for line in (out / "cells" / c.name / "metrics.jsonl")
                 .read_text().splitlines()] for c in exp.cells
                if (c.scenario, c.method) == tuple(exp.reference)]
    stats = [analysis.cell_stats(rows) for rows in ref_rows]
    headline = sum(s["final_trainer"] for s in stats) / len(stats)
    assert (f"final trainer-side {stats[0]['trainer_metric']} {analysis.fmt(headline)} "
            in md)
    # The headline is the trainer's; the batch reward is labelled as the generator's.
    assert re.search(r"final trainer-side eval/accuracy(_sampled)? \d", md)
    assert "final generator-side batch reward" in md

    # The claims' and the controls' tables print beside the groups' (their numbers: tests below).
    for title, _, _ in getattr(get(name), "tables", lambda s: [])(summary_of(out)):
        assert title in md
    if name == "cis":  # plain IS's exact per-prefix second moment, beside the sampled one
        tb = json.loads((out / "truncation_bias.json").read_text())
        for g in (tb, tb["inj_tail"]):
            for b in [g] + [{"rho_second_moment": x["sampled"], "rho_second_moment_exact": x["exact"]}
                            for x in g["rho_second_moment_per_batch"]]:
                # sum_v pi^2/mu >= (sum_v pi)^2 / sum_v mu = 1 on every prefix (Cauchy-Schwarz).
                assert b["rho_second_moment_exact"] >= 1 - 1e-5
                if g is tb:  # light tail: the sampled mean of rho^2 estimates the same expectation
                    assert b["rho_second_moment"] == pytest.approx(b["rho_second_moment_exact"], abs=0.15)
        # The outliers' tail: a few prefixes where mu nearly excludes a token pi_old gives
        # weight hold almost all of E[rho^2], which a sample of tokens rarely sees.
        assert tb["inj_tail"]["rho_second_moment_exact"] > 10 * tb["inj_tail"]["rho_second_moment"]
        assert "exact on the same prefixes" in md
        # Every bin, both directions, per batch; the verdict needs the pooled ratio and each batch's.
        test = tb["test"]
        for row in tb["bins"]:
            assert len(row["cis_over_tis_per_batch"]) == len(tb["rho_second_moment_per_batch"]) == 4
        assert test["cis_over_tis_per_batch"] == tb["bins"][0]["cis_over_tis_per_batch"]
        assert test["passes"] == all(x <= 0.5 for x in [test["cis_over_tis"], *test["cis_over_tis_per_batch"]])
        assert "pooled and in every batch" in md and "| … per batch |" in md
        # TIS's frontier: a higher cap truncates less, so less bias and a larger second moment.
        for g in (tb, tb["inj_tail"]):
            tis = g["frontier"]["tis"]
            assert [p["cap"] for p in tis] == sorted(p["cap"] for p in tis) and len(tis) >= 5
            assert all(a["abs_bias"] >= b["abs_bias"] and a["second_moment"] <= b["second_moment"]
                       for a, b in itertools.pairwise(tis))
        assert (out / "report" / "frontier.png").is_file()

    for g in json.loads((out / "summary.json").read_text())["groups"]:  # one entry per seed
        assert len(g["ess_below_0.5_per_seed"]) == len(g["leaves_band_per_seed"]) == g["seeds"]

    # The committed record: restored on a fresh directory, it gives the same per-cell and
    # per-group numbers without a final model, and the runner reruns none of its cells.
    before = analysis.summarize(out)
    assert sorted(record.save(out, tmp_path / "record")) == sorted(c.name for c in exp.cells)
    assert not list((tmp_path / "record").rglob("final"))
    def packed() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in (tmp_path / "record").rglob("*") if p.suffix in (".gz", ".json")}
    first = packed()
    plan = out / "experiment.json"
    meta = json.loads(plan.read_text())
    plan.write_text(json.dumps({**meta, "cells": meta["cells"][::-1]}))  # a later run lists them otherwise
    record.save(out, tmp_path / "record")  # unchanged cells rewrite the same bytes, the record its order
    assert packed() == first
    plan.write_text(json.dumps(meta))
    recorded = Path(record.start_model(tmp_path / "record")) / "model.safetensors"
    assert recorded.read_bytes() == (Path(model) / "model.safetensors").read_bytes()
    fresh = tmp_path / "fresh"
    (fresh / "cells" / exp.cells[0].name).mkdir(parents=True)  # a cell begun here, replaced
    assert len(record.restore(tmp_path / "record", fresh)) == len(exp.cells)
    assert json.loads((tmp_path / "record" / "experiment.json").read_text())["model_path"] == "model"
    assert json.loads((fresh / "experiment.json").read_text())["model_path"] == record.start_model(tmp_path / "record")
    assert (fresh / "probe.pt").read_bytes() == (out / "probe.pt").read_bytes()  # not re-sampled
    after = analysis.summarize(fresh)
    for key in ("cells", "groups"):
        assert json.dumps(after[key], sort_keys=True) == json.dumps(before[key], sort_keys=True)
    # A slice rerun into the directory keeps the earlier plan's notes beside its own.
    meta = json.loads((fresh / "experiment.json").read_text())
    head = meta["notes"][0].split(": ", 1)[0]
    earlier = meta["notes"] + [f"{head}: an earlier wording", "X: an earlier slice's group"]
    (fresh / "experiment.json").write_text(json.dumps({**meta, "notes": earlier}))
    assert main(args[:4] + [str(fresh)] + args[5:]) == 0
    assert json.loads((fresh / "timing.json").read_text())[-1]["cells_run"] == 0
    assert json.loads((fresh / "experiment.json").read_text())["notes"] == meta["notes"] + ["X: an earlier slice's group"]
    assert record.restore(tmp_path / "record", fresh) == []  # nothing it lacks
    # A first --record into a directory not there yet: the run's cells and its tables go in.
    assert main(args + ["--record", str(tmp_path / "new-record")]) == 0
    assert record.is_record(tmp_path / "new-record")
    assert (tmp_path / "new-record" / record.TABLES).is_file()
    if name == "dlc":  # the command's --record and `tether report RECORD`: the same tables
        rec, again = tmp_path / "record", tmp_path / "again"
        assert main(args[:4] + [str(again), "--record", str(rec)]) == 0  # restores, runs none
        assert json.loads((again / "timing.json").read_text())[-1]["cells_run"] == 0
        tables = (rec / record.TABLES).read_text()
        assert "seeds to decide" in tables and tables.strip() in (out / "report" / "summary.md").read_text()
        (rec / record.TABLES).unlink()
        monkeypatch.chdir(tmp_path)  # the report unpacks a record into ./runs/records/<name>
        assert main(["report", str(rec)]) == 0
        assert (rec / record.TABLES).read_text() == tables
        assert (tmp_path / "runs" / "records" / "record" / "report" / "index.html").is_file()

    # A cell stopped mid-run (no done.json) is left out of the tables, and named.
    last = exp.cells[-1]
    (out / "cells" / last.name / "done.json").unlink()
    summary = analysis.summarize(out)
    assert summary["unfinished"] == [last.name] and last.name not in summary["cells"]
    # A slice (--only) runs its own cells alone: the earlier plan's unfinished one waits.
    first = exp.cells[0]
    if (first.scenario, first.method) != (last.scenario, last.method):
        assert main(args + ["--only", f"{first.scenario}:{first.method}"]) == 0
        assert json.loads((out / "timing.json").read_text())[-1]["cells_run"] == 0
        assert not (out / "cells" / last.name / "done.json").exists()


def test_cell_stats_by_hand():
    # Reward rises to 0.5 then falls to 0.1: the 5-step running mean peaks at step 5 (0.42)
    # and ends at (0.5+0.3+0.2+0.1+0.1)/5 = 0.24 >= 0.42 / 2: not collapsed. With 3 more
    # steps at 0 it ends at (0.1+0.1+0+0+0)/5 = 0.04: collapsed, first below 0.21 at step 10.
    reward = [0.3, 0.4, 0.4, 0.5, 0.5, 0.3, 0.2, 0.1, 0.1]
    ess = [1.0, 0.9, 0.6, 0.4, 0.7, 0.3, 0.9, 0.9, 0.9]
    rows = [{"step": 0, "eval/accuracy": 0.5}]
    rows += [{"step": i + 1, "reward/mean": r, "staleness/ess/token": e}
             for i, (r, e) in enumerate(zip(reward, ess))]
    rows[-1]["eval/accuracy"] = 0.25
    for i, row in enumerate(rows[1:]):  # the drift on old prefixes, and on own samples every 3rd step
        row["total/k3_kl/mean"] = 0.01 * i
        if i % 3 == 2:
            row["monitor/k3_kl/mean"] = 0.1 * i
    s = analysis.cell_stats(rows)
    assert s["ess_below_0.5_step"] == 4 and s["min_ess"] == pytest.approx(0.3)
    assert s["total_k3"] == pytest.approx(0.04) and s["monitor_k3"] == pytest.approx(0.5)  # 0.1 (2+5+8)/3
    assert s["final_reward"] == pytest.approx(0.1)  # mean of the last W = 9 // 4 = 2 steps
    assert s["best_reward_smoothed"] == pytest.approx(0.42)
    assert not s["collapsed"] and s["final_accuracy"] == 0.25 and s["accuracy_start"] == 0.5
    rows += [{"step": 10 + i, "reward/mean": 0.0} for i in range(3)]
    s = analysis.cell_stats(rows)
    assert s["collapsed"] and s["collapse_step"] == 10  # mean of (0.3,0.2,0.1,0.1,0) = 0.14


def summary_of(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _summary(groups: dict[tuple[str, str], list[float]], ref=("exact", "naive")) -> dict:
    """A summary holding only what the contrasts read: per-cell last-3 headlines and re-syncs."""
    cells = {f"{s}__{m}__s{i}": {"scenario": s, "method": m, "seed": i, "last3_trainer": v, "resyncs": i,
                                 "is_adv_second_moment": 6.0 + i, "corr_adv_second_moment": 1.0}
             for (s, m), vals in groups.items() for i, v in enumerate(vals)}
    sigma = float(np.std(groups[ref], ddof=1))
    return {"cells": cells, "reference": list(ref), "reference_last3_sigma": sigma}


def test_contrasts_and_verdicts_read_the_interval():
    assert verdicts.interval_verdict(11, 12, lambda v: v >= 10) == "met"
    assert verdicts.interval_verdict(3, 5, lambda v: v >= 10) == "not met"
    assert verdicts.interval_verdict(9, 11, lambda v: v >= 10) == "unresolved"
    assert verdicts.interval_verdict(float("nan"), 1, lambda v: v >= 10) == "n/a"
    s = _summary({("exact", "naive"): [0.20, 0.21, 0.19, 0.20, 0.20],
                  ("lag32", "dlc"): [0.30, 0.31, 0.29], ("lag32", "dlc_schedule"): [0.10, 0.11, 0.09],
                  ("lag32", "stale_is_ess"): [0.28, 0.33, 0.29]})
    c = verdicts.contrast(s, "lag32", "dlc", "dlc_schedule")
    # Paired by seed, every difference is exactly 0.2: so is every resample's mean.
    assert c["difference"] == pytest.approx(0.2)
    assert c["difference_lo"] == pytest.approx(0.2) and c["difference_hi"] == pytest.approx(0.2)
    assert c["difference_sigma"] == pytest.approx(0.2 / np.std([0.2, 0.21, 0.19, 0.2, 0.2], ddof=1))
    assert c["verdict"] == "dlc higher" and c["seeds_run"] == 3 and c["sd_paired"] == pytest.approx(0)
    # dlc - stale_is_ess per seed: 0.02, -0.02, 0: mean 0, sd 0.02. To be +-0.01 wide the
    # interval needs ceil((1.96 * 0.02 / 0.01)^2) = 16 seeds; at a mean of 0, none decide.
    c = verdicts.contrast(s, "lag32", "dlc", "stale_is_ess")
    assert c["sd_paired"] == pytest.approx(0.02) and c["needs_half"] == 16 and c["needs_zero"] is None
    assert c["verdict"] == "not resolved at 3 seeds"
    assert verdicts.contrast(s, "lag32", "dlc", "reweight") is None
    rows = get("dlc").contrasts(s)  # only the pairs whose both groups ran
    assert [(r["a"], r["b"]) for r in rows] == [("dlc", "dlc_schedule"), ("dlc", "stale_is_ess")]
    assert rows[0]["resyncs"] == "1.0 vs 1.0"


def test_paired_bootstrap_cancels_the_seed_and_sizes_the_seeds():
    # Seed effects of +-0.05 shared by both groups: unpaired, the interval of a - b straddles
    # 0; paired it is the constant 0.01 the method adds, and a seed only one group finished is
    # left out of the pairs.
    seed_effect = [0.05, -0.05, 0.03, -0.03, 0.0]
    s = _summary({("exact", "naive"): [0.2 + e for e in seed_effect],
                  ("lag32", "dlc"): [0.21 + e for e in seed_effect],
                  ("lag32", "dlc_schedule"): [0.2 + e for e in seed_effect[:4]]})
    x, y = verdicts.paired(s, ("lag32", "dlc"), ("lag32", "dlc_schedule"))
    assert len(x) == 4 and np.allclose(x - y, 0.01)
    lo, hi = analysis.bootstrap_ci(list(x), list(y), lambda a, b: a.mean(-1) - b.mean(-1))
    assert lo < 0 < hi
    assert verdicts.contrast(s, "lag32", "dlc", "dlc_schedule")["verdict"] == "dlc higher"
    assert verdicts.seeds_needed(0.02, 0.01) == 16 and verdicts.seeds_needed(0.02, 0.04) == 2
    assert verdicts.seeds_needed(float("nan"), 0.01) is None and verdicts.seeds_needed(0.02, 0.0) is None


def _drift_summary(ref: list[float], groups: dict[str, list[float]]) -> dict:
    """A lag32 summary for the claims: the reference's and each method's last-3 per seed."""
    s = _summary({("exact", "naive"): ref, **{("lag32", m): v for m, v in groups.items()}})
    s["reference_last3"] = float(np.mean(ref))
    s["groups"] = [{"scenario": "lag32", "method": m, "collapsed_trainer": 0,
                    "ess_below_0.5_per_seed": [5] * len(v), "leaves_band_per_seed": [None] * len(v)}
                   for m, v in groups.items()]
    return s


def test_dlc_claims_verdicts_from_their_bars():
    ref = [0.20, 0.21, 0.19, 0.20, 0.20]  # sigma 0.0071: zero accuracy is 28 sigma off
    rows = get("dlc").claims(_drift_summary(ref, {
        "reweight_uncapped": [0.10, 0.11, 0.09, 0.10, 0.10],  # 14 sigma off, 0.5x
        "reweight": [0.18, 0.20, 0.17, 0.18, 0.19],  # 2.5 sigma off, 0.92x
        "dlc": [0.20, 0.21, 0.19, 0.20, 0.20]}))  # the reference itself
    got = {(r["claim"], r["group"]): r["verdict"] for r in rows}
    assert got == {("plain reweighting drifts far", "lag32 x reweight_uncapped"): "met",
                   ("plain reweighting leaves the path dlc must hold", "lag32 x reweight_uncapped"): "met",
                   ("plain reweighting drifts far", "lag32 x reweight"): "not met",
                   ("plain reweighting leaves the path dlc must hold", "lag32 x reweight"): "not met",
                   ("dlc stays near on-policy", "lag32 x dlc"): "met"}
    # A testbed whose reference is 2 sigma above zero: no drift can reach 10 sigma, a bound.
    wide = [0.1, 0.3, 0.05, 0.25, 0.3]
    rows = get("dlc").claims(_drift_summary(wide, {"reweight": [0.0, 0.1, 0.0, 0.1, 0.1],
                                                   "dlc": [0.09, 0.31, 0.03, 0.2, 0.2]}))
    got = {r["claim"]: r for r in rows}
    ceiling = np.mean(wide) / np.std(wide, ddof=1)
    assert got["plain reweighting drifts far"]["verdict"] == (
        f"bound: unreachable on this testbed (zero accuracy is {ceiling:.1f} σ)")
    assert got["plain reweighting leaves the path dlc must hold"]["verdict"] == "met"
    # dlc - 0.85 x reference per seed spreads wide around its mean: unresolved, with the seeds it needs.
    d = np.array([0.09, 0.31, 0.03, 0.2, 0.2]) - 0.85 * np.array(wide)
    needs = verdicts.seeds_needed(float(np.std(d, ddof=1)), abs(float(d.mean())))
    assert got["dlc stays near on-policy"]["verdict"] == f"not resolved at 5 seeds (needs ~{needs})"


def test_cis_accuracy_and_second_moment_verdicts():
    s = _summary(ref=("exact", "none"), groups={("exact", "none"): [0.20, 0.21, 0.19, 0.20, 0.20],
                  ("inj", "tis"): [0.20, 0.21, 0.19], ("inj", "cis"): [0.10, 0.11, 0.09],
                  ("inj", "none"): [0.20, 0.20, 0.21],
                  ("inj_tail", "tis"): [0.20, 0.21, 0.19], ("inj_tail", "cis"): [0.20, 0.19, 0.19]})
    s["groups"] = [{"scenario": sc, "method": m, "is_adv_second_moment": 7.0, "corr_adv_second_moment": 1.0}
                   for sc, m in (("exact", "none"), ("inj", "tis"), ("inj", "cis"), ("inj", "none"))]
    # TIS's curve: (E[w^2], |bias|) = (1.0, 0.02), (1.1, 0.01), (1.3, 0.0); at E[w^2] = 1.05 it
    # is at 0.015, so CIS at 0.01 lies below it, and at 0.02 above it.
    tis = [{"cap": c, "second_moment": m, "abs_bias": b} for c, m, b in ((1.5, 1.0, 0.02), (2, 1.1, 0.01), (5, 1.3, 0.0))]
    s["truncation_bias"] = {"scenario": "inj", "frontier": {"tis": tis, "cis": {"second_moment": 1.05, "abs_bias": 0.01}},
                            "inj_tail": {"scenario": "inj_tail", "bins": [], "frontier": {
                                "tis": tis, "cis": {"second_moment": 1.05, "abs_bias": 0.02}}}}
    accuracy, moments, fronts = (rows for _, rows, _ in get("cis").tables(s))
    assert [(f["scenario"], f["tis_bias"], f["verdict"]) for f in fronts] == [
        ("inj", pytest.approx(0.015), "below TIS's frontier"), ("inj_tail", pytest.approx(0.015), "on or above it")]
    acc = {(r["a"], r["b"]): r for r in accuracy if r["scenario"] == "inj"}
    assert acc[("cis", "tis")]["verdict"] == "not met"  # 0.1 below tis: about 14 sigma
    # On inj_tail cis - tis is 0, -0.02, 0 per seed: the interval [-0.02, 0] holds the bar's
    # -sigma (-0.0071), which a mean of -0.0067 clears by 0.0004: thousands of seeds to decide.
    (tail,) = [r for r in accuracy if r["scenario"] == "inj_tail"]
    sigma = np.std([0.20, 0.21, 0.19, 0.20, 0.20], ddof=1)
    needs = verdicts.seeds_needed(np.std([0, -0.02, 0], ddof=1), abs(-0.02 / 3 + sigma))
    assert needs > 1000 and tail["verdict"] == f"not resolved at 3 seeds (needs ~{needs})"
    assert acc[("cis", "none")]["bar"].startswith("none") and ("tis", "none") in acc
    # every run's raw >= 5 (6, 7, 8) and the applied 1.0 <= 1.5; the uncorrected row has no bar
    assert [(m["group"], m["reach"], m["verdict"]) for m in moments] == [
        ("inj x tis", "3 of 3", "met"), ("inj x cis", "3 of 3", "met"), ("inj x none", "3 of 3", "n/a (uncorrected)")]


def test_trainer_headline_prefers_sampled_accuracy():
    # Greedy accuracy every eval; the sampled accuracy and reward only where eval.samples > 0.
    greedy = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "reward/mean": 0.9},
              {"step": 2, "reward/mean": 0.8, "eval/accuracy": 0.25}]
    assert analysis.trainer_headline(greedy) == "eval/accuracy"
    s = analysis.cell_stats(greedy)
    assert (s["trainer_metric"], s["final_trainer"]) == ("eval/accuracy", 0.25)
    assert s["best_trainer"] == 0.5 and not s["collapsed_trainer"]  # 0.25 is not below 0.5 / 2
    assert s["lowest_trainer"] == 0.25
    assert math.isnan(s["final_reward_sampled"])
    sampled = [{**r, "eval/accuracy_sampled": 0.3 - 0.1 * i, "eval/reward_sampled": 0.4 - 0.1 * i}
               if "eval/accuracy" in r else r for i, r in enumerate(greedy)]
    assert analysis.trainer_headline(sampled) == "eval/accuracy_sampled"
    s = analysis.cell_stats(sampled)
    # The last eval row (step 2, i = 2): 0.3 - 0.2 and 0.4 - 0.2; the batch reward stays 0.8-0.9.
    assert s["final_trainer"] == pytest.approx(0.1) and s["final_reward_sampled"] == pytest.approx(0.2)
    assert s["best_trainer"] == pytest.approx(0.3) and s["collapsed_trainer"]  # 0.1 < 0.3 / 2
    assert s["lowest_trainer"] == pytest.approx(0.1)
    assert s["final_reward"] == 0.8  # generator-side: the last W = max(1, 2 // 4) = 1 step


def test_series_against_optimizer_steps():
    # N = 4: rollout step k ends at version 4k; the step-0 row (no version) sits at 0.
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "version": 4, "reward/mean": 0.2},
            {"step": 2, "version": 8, "reward/mean": 0.3, "eval/accuracy": 0.25}]
    assert analysis.series(rows, "eval/accuracy", "version")[0].tolist() == [0, 8]
    assert analysis.series(rows, "eval/accuracy")[0].tolist() == [0, 2]


def test_probe_kl_is_zero_on_itself_and_positive_otherwise():
    import torch

    a = torch.log_softmax(torch.tensor([[[0.0, 1.0, 2.0]]]), -1)
    b = torch.log_softmax(torch.tensor([[[2.0, 1.0, 0.0]]]), -1)
    mask = torch.ones(1, 1)
    assert analysis.probe_kl(a, a, mask) == pytest.approx(0.0, abs=1e-7)
    p = a.exp()[0, 0]
    expected = float((p * (a[0, 0] - b[0, 0])).sum())  # KL(p_a || p_b) by its definition
    assert analysis.probe_kl(a, b, mask) == pytest.approx(expected)


def test_only_rejects_unknown_groups(tmp_path, capsys):
    assert main(["experiment", "dlc", "--quick", "--out", str(tmp_path), "--only", "fp8:nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown group" in err and "exact:naive" in err


def test_auto_verdicts_from_their_bars():
    ref = [0.20, 0.21, 0.19, 0.20, 0.20]
    groups = {("exact", "naive"): ref, ("exact", "dlc"): [0.19, 0.20, 0.18],
              ("exact", "auto"): [0.20, 0.21, 0.19],
              ("lag", "naive"): [0.10, 0.11, 0.09], ("lag", "tis"): [0.14, 0.15, 0.13],
              ("lag", "cis"): [0.14, 0.15, 0.16], ("lag", "dlc"): [0.18, 0.19, 0.17],
              ("lag", "auto"): [0.17, 0.18, 0.19],
              ("lag_from30", "naive"): [0.12, 0.13, 0.11], ("lag_from30", "tis"): [0.15, 0.16, 0.14],
              ("lag_from30", "cis"): [0.17, 0.18, 0.19], ("lag_from30", "dlc"): [0.18, 0.19, 0.18],
              ("lag_from30", "auto"): [0.17, 0.19, 0.18]}
    s = _summary(groups)
    s["reference_last3"] = float(np.mean(ref))
    s["groups"] = [{"scenario": "exact", "method": "auto", "corrected_steps": 0.0,
                    "dlc_steps": 0.0, "topk_steps": 0.0, "resyncs": 0.0}]
    got = {r["bar"]: r["verdict"] for r in get("auto").verdicts(s)}
    # exact: tis and cis are naive's rows (ALIASES); auto level with the best.
    assert got["exact: auto within the best preset's 95% interval"] == "met"
    assert got["lag: auto within the best preset's 95% interval"] == "met"  # 0.18 in dlc's [0.17, 0.19]
    # Worst case: naive 0.5x at lag; auto's lowest (0.9x at lag) is above every preset's.
    assert got["worst case: auto's lowest ratio to the reference >= every preset's"] == "met"
    assert got["lag_from30: auto above naive (cheap at its start)"].startswith("met (interval: met")
    assert got["lag_from30: auto above cis (cheap at its start)"].startswith("not met")  # level
    assert got["exact: auto applies no correction, no re-sync, no top-K"] == "met"
    s["groups"][0]["dlc_steps"] = 2.0
    assert {r["bar"]: r["verdict"] for r in get("auto").verdicts(s)}[
        "exact: auto applies no correction, no re-sync, no top-K"] == "not met"
    # auto below the best preset's interval, and the lowest of all somewhere: both not met.
    s = _summary({**groups, ("lag", "auto"): [0.08, 0.09, 0.07]})
    s["reference_last3"], s["groups"] = float(np.mean(ref)), []
    got = {r["bar"]: r["verdict"] for r in get("auto").verdicts(s)}
    assert got["lag: auto within the best preset's 95% interval"] == "not met"
    assert got["worst case: auto's lowest ratio to the reference >= every preset's"].startswith(
        "not met (naive, tis, cis, dlc higher; auto's lowest is lag")


def test_full_matrices_are_the_documented_ones():
    dlc = get("dlc").build()
    assert len(dlc.groups()) == 21 and len(dlc.cells) == 65  # duplicates skipped, 3 seeds (ref 5)
    # Cut to fit the hour, still runnable by name.
    assert {(c.scenario, c.method) for c in dlc.extra} == {("fp8", "dlc"), ("lag32", "dlc_clip"),
                                                            ("fp8_async32", "dlc_window")}
    assert len(select(dlc, ["lag32:dlc_clip"])) == 5 + 3
    with pytest.raises(InputError, match="fp8_async32:dlc_window"):  # the cut groups are listed too
        select(dlc, ["lag32:nope"])
    controls = {m for s, m in dlc.groups() if s == "lag32"} - {m for s, m in dlc.groups() if s == "fp8_lag32"}
    assert {"reweight_cap5", "reweight_uncapped", "dlc_schedule", "stale_is_ess"} <= controls
    assert sum(c.scenario == "exact" and c.method == "naive" for c in dlc.cells) == 5
    auto = get("auto").build()  # 5 scenarios x {naive, tis, cis, dlc, auto}, exact's tis/cis aliased
    assert len(auto.groups()) == 5 * 5 - 2 and len(auto.cells) == 71
    assert ("exact", "tis") not in auto.groups() and sum(c.method == "naive" and c.scenario == "exact"
                                                         for c in auto.cells) == 5
    switch = next(c for c in auto.cells if c.scenario == "fp8_lag32_from30" and c.method == "auto")
    assert {"sync.lag=32", "sync.lag_from=30", "train.correction=auto", "train.estimator=grpo",
            "sync.policy=every:1"} <= set(switch.overrides)
    race = next(c for c in auto.cells if c.scenario == "fp8_async32" and c.method == "dlc")
    assert {"loop.window=ess", "loop.after_trip=regenerate", "sync.policy=ess:0.5"} <= set(race.overrides)
    vespo = get("vespo").build()
    # N = 1: grpo (the reference, 5 seeds) and sapo, the two distinct on-policy gradients;
    # N = 64: all six objectives, 3 seeds. Beside it: the (k, lambda) ablation and the race.
    assert vespo.groups()[:3] == [("N1", "grpo"), ("N1", "sapo"), ("N64", "grpo")]
    assert len(vespo.groups()) == 2 + 6 and len(vespo.cells) == 5 + 3 + 6 * 3
    assert {(c.scenario, c.method) for c in vespo.extra} == {
        ("N64", "vespo_flat"), ("N64", "vespo_narrow"), ("N4_race", "grpo"), ("N4_race", "sapo"),
        ("N4_race", "vespo"), ("N4_race", "vespo_rho")}
    race = next(c for c in vespo.extra if c.method == "vespo_rho")
    assert {"loop.mode=async", "rollout.precision=fp8", "loop.max_staleness=4", "train.minibatches=4",
            "train.estimator_params={include_rho: true}"} <= set(race.overrides)
    sweep = get("vespo").build(protocol=get("vespo").SWEEP)
    # N in {1, 4, 8, 16, 64}: 512 optimizer steps each, evaluation every 16 (every 64 at N = 64).
    assert [s for s, m in sweep.groups() if m == "grpo"] == ["N1", "N4", "N8", "N16", "N64", "N4_race"]
    assert len(sweep.cells) == 5 + 3 + 4 * 6 * 3 + 2 * 3 + 4 * 3 and not sweep.extra
    keys = {c.scenario: c.overrides[:4] for c in sweep.cells if c.method == "grpo"}
    assert keys["N4"] == ("rollout.prompts_per_step=128", "train.minibatches=4", "train.steps=128", "eval.every=4")
    assert keys["N64"] == ("rollout.prompts_per_step=2048", "train.minibatches=64", "train.steps=8", "eval.every=1")
    assert "diagnostics.seq_weights=true" in sweep.base
    # A harder race is its own group: N = 16, eta = 32 never resumes into N4_race's cells.
    hard = get("vespo").build(protocol=replace(get("vespo").SWEEP, race_n=16, race_eta=32))
    (hard_race,) = {c.scenario for c in hard.cells if "_race" in c.scenario}
    assert hard_race == "N16_race_eta32" and len(hard.cells) == len(sweep.cells)
    assert {"loop.max_staleness=32", "train.minibatches=16"} <= set(next(
        c for c in hard.cells if c.scenario == hard_race).overrides)
    # eta under N admits one batch at a time: no lag at all, so the protocol refuses it.
    with pytest.raises(InputError, match="race_eta=8 is under the race's N=16"):
        get("vespo").build(protocol=replace(get("vespo").SWEEP, race_n=16, race_eta=8))
    assert set(get("vespo").SWEEPS) == set(get("vespo").TASKS)  # every testbed has its sweep (--task)
    chain = get("vespo").build(protocol=get("vespo").SWEEPS["chain"])
    assert "task.name=chain" in chain.base and "rollout.max_new_tokens=120" in chain.base
    assert "stable to N = 16 " in chain.question and "stable to N = 64 " in sweep.question
    # Chains: the reference and N = 16 x {grpo, vespo, /T, /sqrt T}, 3 seeds each; the race beside.
    assert chain.groups() == [("N1", "grpo"), ("N16", "grpo"), ("N16", "vespo"), ("N16", "vespo_T"),
                              ("N16", "vespo_sqrtT")]
    assert len(chain.cells) == 5 * 3 and {c.scenario for c in chain.extra} == {"N4_race"}
    assert next(c for c in chain.cells if c.scenario == "N16").overrides[:3] == (
        "rollout.prompts_per_step=512", "train.minibatches=16", "train.steps=16")
    assert load_config(None, chain.base + list(chain.cells[0].overrides)).task.name == "chain"
    keys = {c.scenario: c.overrides[:5] for c in vespo.cells if c.method == "grpo"}
    # Mini-batch 16 prompts x 8; 128 optimizer steps = 128 / N batches; eval every 64 of them.
    assert keys["N1"] == ("rollout.prompts_per_step=16", "train.minibatches=1", "train.steps=128",
                          "eval.every=64", "run.checkpoint_every=64")
    assert keys["N64"] == ("rollout.prompts_per_step=1024", "train.minibatches=64",
                           "train.steps=2", "eval.every=1", "run.checkpoint_every=1")
    assert "rollout.group_size=8" in vespo.base and "task.answer=steps" in vespo.base
    cis = get("cis").build()
    assert cis.groups() == [("exact", "none"), ("inj", "none"), ("inj", "tis"), ("inj", "cis"),
                            ("inj_tail", "tis"), ("inj_tail", "cis"), ("inj_lag2", "decoupled"),
                            ("inj_lag2", "decoupled_cis")]
    assert len(cis.cells) == 5 + 7 * 3  # 5 reference seeds, 3 seeds for the rest
    tail = [c for c in cis.cells if c.scenario == "inj_tail"]
    assert all("rollout.logit_noise_outliers=0.02" in c.overrides for c in tail)
    lagged = [c for c in cis.cells if c.scenario == "inj_lag2"]
    assert all("sync.lag=2" in c.overrides and "rollout.logit_noise=0.12" in c.overrides
               for c in lagged)


def _vespo_summary(last3: dict[tuple[str, str], list[float]]) -> dict:
    cells = {f"{n}__{m}__s{s}": {"scenario": n, "method": m, "seed": s, "last3_trainer": v}
             for (n, m), vs in last3.items() for s, v in enumerate(vs)}
    groups = [{"scenario": n, "method": m, "collapsed_trainer": 0} for n, m in last3]
    return {"cells": cells, "groups": groups, "reference_last3_sigma": 0.01}


def test_vespo_retention_reads_each_method_against_its_n1_twin():
    summary = _vespo_summary({("N1", "grpo"): [0.20, 0.22], ("N1", "sapo"): [0.10, 0.10],
                              ("N64", "vespo"): [0.17, 0.15, 0.21], ("N64", "gspo"): [0.09, 0.07, 0.01]})
    get("vespo").extend(None, summary)
    by = {(g["scenario"], g["method"]): g for g in summary["groups"]}
    # vespo's twin is N1 grpo (mean 0.21; 0.8x = 0.168): 0.17 and 0.21 keep it, 0.15 does not.
    assert by["N64", "vespo"]["n1_twin"] == "N1 grpo" and by["N64", "vespo"]["kept_80"] == 2
    assert by["N64", "vespo"]["vs_n1"] == pytest.approx(0.53 / 3 / 0.21)
    assert by["N64", "vespo"]["vs_n1_lo"] < by["N64", "vespo"]["vs_n1"] < by["N64", "vespo"]["vs_n1_hi"]
    # gspo's is N1 sapo (0.10): 0.09 keeps it, 0.07 and 0.01 do not.
    assert by["N64", "gspo"]["n1_twin"] == "N1 sapo" and by["N64", "gspo"]["kept_80"] == 1
    assert by["N1", "grpo"]["vs_n1"] == pytest.approx(1.0)


def test_vespo_claims_are_computed_from_intervals():
    ref = [0.20, 0.21, 0.22, 0.20, 0.22]
    holds = {("N1", "grpo"): ref, ("N1", "sapo"): ref,
             ("N8", "vespo"): [0.21, 0.20, 0.22], ("N8", "grpo"): [0.05, 0.06, 0.04],
             ("N8", "gspo"): [0.20, 0.21, 0.20], ("N8", "sapo"): [0.02, 0.01, 0.03],
             ("N8", "vespo_T"): [0.10, 0.12, 0.11], ("N8", "vespo_sqrtT"): [0.15, 0.14, 0.16],
             ("N4_race", "vespo"): [0.20, 0.21, 0.19], ("N4_race", "vespo_rho"): [0.05, 0.21, 0.20],
             ("N4_race", "grpo"): [0.01, 0.02, 0.01], ("N4_race", "sapo"): [0.01, 0.02, 0.02]}
    summary = _vespo_summary(holds)
    get("vespo").extend(None, summary)
    verdicts = {(c["claim"].split()[0] + " " + c["claim"].split()[-1], c["scenario"]): c["verdict"]
                for c in summary["claims"]}
    # grpo and sapo fall but gspo keeps its twin: the N-sweep shape holds in part.
    assert verdicts == {("vespo grows", "N8"): "in part", ("÷T destabilise", "N8"): "met",
                        ("vespo async", "N4_race"): "unresolved"}  # vespo_rho's seeds straddle 0.8x
    # gspo falls too: every baseline below 0.8x, vespo above it: met.
    summary = _vespo_summary({**holds, ("N8", "gspo"): [0.03, 0.05, 0.04]})
    get("vespo").extend(None, summary)
    assert [c["verdict"] for c in summary["claims"] if c["scenario"] == "N8"] == ["met", "met"]
    # In the race one baseline below 0.8x is enough: vespo_rho's seeds now keep it.
    summary = _vespo_summary({**holds, ("N4_race", "vespo_rho"): [0.20, 0.21, 0.20],
                              ("N4_race", "sapo"): [0.20, 0.21, 0.22]})
    get("vespo").extend(None, summary)
    assert [c["verdict"] for c in summary["claims"] if c["scenario"] == "N4_race"] == ["met"]
    harder = _vespo_summary({k if k[0] != "N4_race" else ("N16_race_eta32", k[1]): v for k, v in holds.items()})
    get("vespo").extend(None, harder)  # a harder race is read as a race: one row, its own bar
    assert [c["claim"] for c in harder["claims"] if c["scenario"] == "N16_race_eta32"] == [
        "vespo holds under mismatch and async"]
    # vespo falls with the baselines: the first claim is not met; ÷T above vespo: not met either.
    summary = _vespo_summary({**holds, ("N8", "vespo"): [0.05, 0.06, 0.05]})
    get("vespo").extend(None, summary)
    assert [c["verdict"] for c in summary["claims"] if c["scenario"] == "N8"] == ["not met", "not met"]
    # One seed of gspo and of ÷T: no interval, said in words, and neither verdict can be met.
    summary = _vespo_summary({**holds, ("N8", "gspo"): [0.20], ("N8", "vespo_T"): [0.10]})
    get("vespo").extend(None, summary)
    first, second = (c for c in summary["claims"] if c["scenario"] == "N8")
    none = "(no interval: under 2 seeds a side)"
    assert f"gspo 0.95× {none} (0 collapsed)" in first["value"] and first["verdict"] == "in part"
    assert f"vespo − vespo_T +0.110 {none}" in second["value"] and second["verdict"] == "unresolved"
    assert "nan" not in first["value"] + second["value"]


def test_vespo_ablation_row_reads_each_variant_against_vespo():
    """The (k, lambda) ablation: the shape matters when each variant's difference from vespo
    excludes 0, in part for one, and does not when each lies within the reference's sigma."""
    def verdict(flat: list[float], narrow: list[float]) -> dict:
        summary = _vespo_summary({("N1", "grpo"): [0.20, 0.21, 0.22], ("N64", "vespo"): [0.20, 0.21, 0.20],
                                  ("N64", "vespo_flat"): flat, ("N64", "vespo_narrow"): narrow})
        get("vespo").extend(None, summary)
        (row,) = [c for c in summary["claims"] if c["claim"] == "the (k, λ) shape matters"]
        return row

    apart = verdict([0.05, 0.06, 0.04], [0.25, 0.26, 0.25])  # below vespo, and above it
    assert apart["verdict"] == "met" and apart["scenario"] == "N64"
    # Paired by seed: vespo - flat is 0.15, 0.15, 0.16 per seed, vespo - narrow -0.05 in each.
    assert apart["value"].startswith("vespo − vespo_flat +0.153 [+0.150, +0.160]")
    assert "; vespo − vespo_narrow -0.050 [-0.050, -0.050]" in apart["value"]
    assert verdict([0.05, 0.06, 0.04], [0.20, 0.21, 0.20])["verdict"] == "in part"
    assert verdict([0.201, 0.205, 0.203], [0.20, 0.21, 0.20])["verdict"] == "not met"  # within +-0.01
    assert verdict([0.10, 0.30, 0.20], [0.20, 0.21, 0.20])["verdict"] == "unresolved"
    assert verdict([0.05], [0.20, 0.21, 0.20])["verdict"] == "unresolved"  # one seed: no interval


def test_vespo_curve_table_averages_seeds_at_steps_every_group_evaluated(tmp_path):
    """N = 1 evaluates every 16 optimizer steps, N = 64 every 64: the table keeps 0, 64, 128,
    each a seed mean of the trainer-side metric; a longer run is thinned to CURVE_POINTS."""
    vespo = get("vespo")

    def write(name: str, every: int, values: list[float]) -> None:
        (tmp_path / "cells" / name).mkdir(parents=True)
        rows = [{"step": i, "version": every * i, "eval/accuracy_sampled": v} for i, v in enumerate(values)]
        rows.insert(1, {"step": 1, "version": 1, "reward/mean": 0.5})  # a row without the metric
        (tmp_path / "cells" / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("N1__grpo__s0", 16, [0.2, 0.1, 0.3, 0.9, 0.4, 0.1, 0.1, 0.1, 0.6])
    write("N1__grpo__s1", 16, [0.2, 0.3, 0.5, 0.9, 0.2, 0.1, 0.1, 0.1, 0.8])
    write("N64__sapo__s0", 64, [0.2, 0.05, 0.01])
    summary = {"trainer_metric": "eval/accuracy_sampled",
               "cells": {n: {"scenario": n.split("__")[0], "method": n.split("__")[1]}
                         for n in ("N1__grpo__s0", "N1__grpo__s1", "N64__sapo__s0")},
               "groups": [{"scenario": "N1", "method": "grpo"}, {"scenario": "N64", "method": "sapo"}]}
    rows = vespo.curve_table(tmp_path, summary)
    assert rows[0] == {"scenario": "N1", "method": "grpo", "seeds": 2,
                       "at/0": pytest.approx(0.2), "at/64": pytest.approx(0.3), "at/128": pytest.approx(0.7)}
    assert rows[1] == {"scenario": "N64", "method": "sapo", "seeds": 1, "at/0": 0.2, "at/64": 0.05, "at/128": 0.01}
    title, table, columns = vespo.tables({**summary, "claims": [], "curve": rows})[1]
    assert "seed mean" in title and table is rows and columns[-1] == ("at/128", "step 128")
    # N = 1 alone: its 9 evaluations at 0, 16, ..., 128 are kept (CURVE_POINTS = 9); 17 are thinned.
    del summary["cells"]["N64__sapo__s0"], summary["groups"][1]
    assert [k for k in vespo.curve_table(tmp_path, summary)[0] if k.startswith("at/")] == \
        [f"at/{16 * i}" for i in range(9)]
    write("N1__grpo__s2", 8, [0.5] * 17)  # alone, every 8 up to 128: thinned to 0, 16, ..., 128
    summary["cells"] = {"N1__grpo__s2": {"scenario": "N1", "method": "grpo"}}
    assert [k for k in vespo.curve_table(tmp_path, summary)[0] if k.startswith("at/")] == \
        [f"at/{16 * i}" for i in range(9)]


def test_an_out_dir_is_not_reused_under_other_settings(tmp_path, capsys):
    (tmp_path / "experiment.json").write_text(json.dumps({"name": "vespo", "base": ["x=1"]}))
    assert main(["experiment", "vespo", "--quick", "--out", str(tmp_path)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_set_changes_every_cell_and_a_bad_key_fails_first(tmp_path, capsys, warm_model_dir):
    assert main(["experiment", "vespo", "--quick", "--out", str(tmp_path / "bad"),
                 "--set", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err and not (tmp_path / "bad" / "cells").exists()
    out = tmp_path / "lr"
    assert main(["experiment", "vespo", "--quick", "--out", str(out), "--model", str(warm_model_dir),
                 "--only", "N1:grpo", "--set", "train.lr=3e-5", "task.format_weight=0.2"]) == 0
    base = json.loads((out / "experiment.json").read_text())["base"]
    assert base[-2:] == ["train.lr=3e-5", "task.format_weight=0.2"]
    config = (out / "cells" / "N1__grpo__s0" / "config.yaml").read_text()
    assert "lr: 3.0e-05" in config and "format_weight: 0.2" in config
    # The same directory under the plain settings is refused, not mixed.
    assert main(["experiment", "vespo", "--quick", "--out", str(out)]) == 2
    assert "other settings" in capsys.readouterr().err


def test_a_group_leaves_the_band_where_its_mean_is_two_sigma_off():
    from tether.experiments.analysis import leaves_band

    def run(values: list[float]) -> list[dict]:
        return [{"step": 5 * i, "eval/accuracy_sampled": v} for i, v in enumerate(values)]

    reference = [run([0.30, 0.31, 0.33, 0.35]), run([0.30, 0.33, 0.35, 0.37])]
    drifting = [run([0.30, 0.30, 0.27, 0.20]), run([0.30, 0.32, 0.29, 0.22])]
    assert leaves_band(drifting, reference, sigma=0.02) == 10  # 0.28 vs 0.34 at step 10
    assert leaves_band(reference, reference, sigma=0.02) is None
    assert leaves_band(drifting, reference, sigma=float("nan")) is None


def test_bootstrap_interval_of_a_ratio_by_hand():
    # Group seeds {1, 3}: a resampled mean is 1, 2 or 3 with probability 1/4, 1/2, 1/4;
    # the reference's {2, 2} always has mean 2. So the ratio is 0.5, 1 or 1.5, and its 95%
    # interval runs from the smallest to the largest.
    lo, hi = analysis.bootstrap_ci([1.0, 3.0], [2.0, 2.0], analysis.ratio)
    assert (lo, hi) == (0.5, 1.5)
    # A reference without spread gives no sigma, so no deviation; one seed gives no interval.
    assert all(math.isnan(x) for x in analysis.bootstrap_ci([1.0, 3.0], [2.0, 2.0], analysis.deviation))
    assert all(math.isnan(x) for x in analysis.bootstrap_ci([1.0], [2.0, 3.0], analysis.ratio))
    # Seeds that agree give a narrow interval around the point value, that disagree a wide one.
    tight = analysis.bootstrap_ci([0.30, 0.31, 0.29], [0.40, 0.41, 0.39], analysis.ratio)
    loose = analysis.bootstrap_ci([0.10, 0.50, 0.30], [0.40, 0.41, 0.39], analysis.ratio)
    assert tight[0] < 0.75 < tight[1] and tight[1] - tight[0] < 0.06
    assert loose[1] - loose[0] > 0.5


def test_a_table_cell_carries_its_spread_and_interval():
    row = {"r": 0.9, "r_std": 0.05, "r_lo": 0.81, "r_hi": 1.02, "n": 3, "x": float("nan"),
           "x_lo": float("nan"), "x_hi": float("nan")}
    assert analysis.cell_text(row, "r") == "0.900 ± 0.050 [0.810, 1.020]"
    assert analysis.cell_text(row, "n") == "3"
    assert analysis.cell_text(row, "x") == "n/a"
