"""Shared analysis of an experiment directory: per-cell numbers, per-group tables, probe KL.

Definitions (also in docs/experiments.md):
- final reward: mean `reward/mean` over the last W = max(1, steps // 4) steps (one step is
  noisy): the generator-side batch reward, sampled at weights that may be versions old;
  final accuracy: the last `eval/accuracy` (greedy, held-out).
- final trainer-side: the last value of the run's trainer-side headline
  (`trainer_headline`: `eval/accuracy_sampled`, else `eval/accuracy` when a run sampled no
  held-out responses); final sampled reward: the last `eval/reward_sampled` (docs/metrics.md).
- on-policy sigma: the sample standard deviation (ddof 1) of the reference group's per-seed
  final value; needs >= 2 reference seeds, otherwise the deviations are NaN.
- deviation in sigma (reward or accuracy): |mean over the group's seeds - reference mean|
  / on-policy sigma.
- 95% interval of a ratio or deviation: a percentile bootstrap over seeds, the group's and
  the reference's seeds resampled with replacement, independently (`bootstrap_ci`); `_lo`
  and `_hi` beside the value. With 3 seeds it is coarse, but it shows which differences
  the seeds can tell apart. NaN with fewer than 2 seeds on either side.
- probe distance: every final model scores a fixed probe set (held-out prompts with one
  response each, sampled once from the starting model, `OUT/probe.pt`); D(a, b) = mean over
  response tokens of KL(p_a || p_b) over the whole vocabulary. A cell's probe deviation is
  sqrt(mean_j D(ref_j, cell) / mean_{j != k} D(ref_j, ref_k)): KL grows like a squared
  distance, so the square root reads as "on-policy seed-to-seed spreads". NaN with < 2
  reference seeds.
- ESS < 0.5 step: first step whose `staleness/ess/token` < 0.5 (None: never); the group's
  is its seeds' earliest. Per seed, beside the step that seed's run leaves the ±2σ band
  (`leaves_band` on its own rows): `ess_below_0.5_per_seed`, `leaves_band_per_seed`.
- rare-token share: the largest `monitor/kl_share/rare` seen (the current-model monitor).
- collapse: the smoothed reward (running mean over 5 steps) ends below half its best.
- trainer-side collapse: the last trainer-side headline value below half the run's best
  (step 0, the starting model, included); best trainer-side: that best; lowest
  trainer-side: the run's lowest evaluation, so a fall that recovers before the end shows.
- staleness (versions): the run's mean over steps of how many versions the trainer was
  ahead of the weights that sampled the batch (`staleness/versions/mean` in the async
  loop, token-averaged within a step; `staleness/versions/batch` in the synchronous one);
  max staleness: the largest over the run (`staleness/versions/max`, or the batch value).
- staleness k3: the run's mean over steps of `staleness/k3_kl/mean` (token k3 of the
  trained policy against the weights that sampled its batch): how far it drifted in a batch.
- k3 on old prefixes / on own samples: the run's means of `total/k3_kl/mean` (the trained
  policy against the generator, on the generator's samples) and of `monitor/k3_kl/mean`
  (the same pair on the trained policy's own samples, every `diagnostics.monitor_every`
  steps). DLC says a drift can be invisible on old prefixes and plain on the model's own.
- samples/s and trained per generated (the async loop only):
  `async/samples_per_s` (responses trained per second) and `async/trained_per_generated`,
  each its last value, which covers the whole run (docs/metrics.md).
- wall seconds: the cell's `done.json` seconds (the whole `train` call, evaluations included).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tether.logger import read_jsonl

PROBE_PROMPTS = 64

TRAINER_HEADLINES = ("eval/accuracy_sampled", "eval/accuracy")
"""Trainer-side headline metrics, preferred first: sampled like the rollouts, else greedy."""


def load_meta(out: Path) -> dict:
    return json.loads((Path(out) / "experiment.json").read_text())


def cell_rows(out: Path, name: str) -> list[dict]:
    path = Path(out) / "cells" / name / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def series(rows: list[dict], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """(x, values) of the rows that hold a finite `key`; x: the rows' `step` (rollout steps)
    or `version` (optimizer steps; 0 on the step-0 row, which predates any)."""
    pts = [(r.get(x, 0), float(r[key])) for r in rows
           if key in r and isinstance(r[key], (int, float)) and math.isfinite(float(r[key]))]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v)


def smooth(v: np.ndarray, w: int = 5) -> np.ndarray:
    """Trailing running mean over up to `w` values."""
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(idx - w, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _first_below(rows: list[dict], key: str, tau: float) -> int | None:
    s, v = series(rows, key)
    hit = np.nonzero(v < tau)[0]
    return int(s[hit[0]]) if len(hit) else None


def _mean(rows: list[dict], key: str) -> float:
    _, v = series(rows, key)
    return float(v.mean()) if len(v) else float("nan")


def trainer_headline(rows: list[dict]) -> str:
    """The trainer-side metric a run's headline uses: the first of TRAINER_HEADLINES it logged
    (the last, greedy accuracy, when it logged none: a run's rows always hold it)."""
    return next((k for k in TRAINER_HEADLINES if len(series(rows, k)[1])), TRAINER_HEADLINES[-1])


def _last(rows: list[dict], key: str) -> float:
    _, v = series(rows, key)
    return float(v[-1]) if len(v) else float("nan")


def cell_stats(rows: list[dict]) -> dict[str, float | int | str | None]:
    """The per-cell numbers every experiment reports (definitions: module docstring)."""
    reward_steps, reward = series(rows, "reward/mean")
    _, acc = series(rows, "eval/accuracy")
    headline = trainer_headline(rows)
    _, trainer = series(rows, headline)
    _, rare = series(rows, "monitor/kl_share/rare")
    _, ess = series(rows, "staleness/ess/token")
    async_loop = any("staleness/versions/mean" in r for r in rows)
    _, stale = series(rows, "staleness/versions/mean" if async_loop else "staleness/versions/batch")
    _, stale_max = series(rows, "staleness/versions/max" if async_loop else "staleness/versions/batch")
    w = max(1, len(reward) // 4)
    sm = smooth(reward) if len(reward) else reward
    best = float(sm.max()) if len(sm) else float("nan")
    collapse_at = None
    if len(sm):
        peak = int(sm.argmax())
        below = np.nonzero(sm[peak:] < 0.5 * best)[0]
        collapse_at = int(reward_steps[peak + below[0]]) if len(below) else None
    best_trainer = float(trainer.max()) if len(trainer) else float("nan")
    return {
        "steps": len(reward),
        "final_reward": float(reward[-w:].mean()) if len(reward) else float("nan"),
        "best_reward_smoothed": best,
        "collapsed": bool(len(sm) and sm[-1] < 0.5 * best),
        "collapse_step": collapse_at,
        "accuracy_start": float(acc[0]) if len(acc) else float("nan"),
        "final_accuracy": float(acc[-1]) if len(acc) else float("nan"),
        "trainer_metric": headline,
        "final_trainer": _last(rows, headline),
        # The mean of the last 3 evaluations: one evaluation's draws add their own noise.
        "last3_trainer": float(trainer[-3:].mean()) if len(trainer) else float("nan"),
        "best_trainer": best_trainer,
        "lowest_trainer": float(trainer.min()) if len(trainer) else float("nan"),
        "collapsed_trainer": bool(len(trainer) and trainer[-1] < 0.5 * best_trainer),
        "final_reward_sampled": _last(rows, "eval/reward_sampled"),
        "ess_below_0.5_step": _first_below(rows, "staleness/ess/token", 0.5),
        "min_ess": float(ess.min()) if len(ess) else float("nan"),
        "rare_kl_share_max": float(rare.max()) if len(rare) else float("nan"),
        "resyncs": int(sum(r.get("sync/tripped", 0) + r.get("sync/forced", 0) for r in rows)),
        "is_second_moment": _mean(rows, "numerical/is_weight/second_moment"),
        "is_adv_second_moment": _mean(rows, "numerical/is_weight/adv_second_moment"),
        "corr_second_moment": _mean(rows, "correction/weight/second_moment"),
        "corr_adv_second_moment": _mean(rows, "correction/weight/adv_second_moment"),
        "numerical_k3": _mean(rows, "numerical/k3_kl/mean"),
        "staleness_k3": _mean(rows, "staleness/k3_kl/mean"),
        # The same divergence seen two ways: on the generator's (old) prefixes, KL(mu || pi_theta),
        # and on the current model's own samples (the monitor), KL(pi_theta || mu).
        "total_k3": _mean(rows, "total/k3_kl/mean"),
        "monitor_k3": _mean(rows, "monitor/k3_kl/mean"),
        "step_seconds": _mean(rows, "time/step"),
        "mean_staleness": float(stale.mean()) if len(stale) else float("nan"),
        "max_staleness": float(stale_max.max()) if len(stale_max) else float("nan"),
        "samples_per_s": _last(rows, "async/samples_per_s"),  # cumulative: the whole run's
        "trained_per_generated": _last(rows, "async/trained_per_generated"),
    }


# -- the probe set: output-distribution distance between final models ---------------------

@torch.no_grad()
def make_probe(out: Path, model_path: str, max_new_tokens: int, seed: int = 1234) -> dict:
    """Held-out prompts with one response each, sampled from the starting model; cached."""
    path = Path(out) / "probe.pt"
    if path.is_file():
        return torch.load(path)
    from tether.config import load_config
    from tether.models import load_model
    from tether.models.tokenizer import encode_exact
    from tether.rollout.hf import HFGenerator
    from tether.rollout.types import SamplingParams
    from tether.scoring import collate
    from tether.tasks import task_from_config

    meta = load_meta(out)
    cfg = load_config(None, meta["base"])
    task = task_from_config(cfg.task)
    model, tok = load_model(model_path)
    problems = task.eval_problems()[:PROBE_PROMPTS]
    gen = HFGenerator(model, tok.eos_token_id, tok.pad_token_id, "fp32")
    ro = gen.generate([encode_exact(tok, p.prompt) for p in problems], [p.id for p in problems],
                      SamplingParams(n=1, max_new_tokens=max_new_tokens), seed=seed)
    b = collate(ro, tok.pad_token_id)
    probe = {"input_ids": b.input_ids, "attention_mask": b.attention_mask,
             "response_mask": b.response_mask, "prompt_len": b.prompt_len}
    torch.save(probe, path)
    return probe


@torch.no_grad()
def probe_logp(model_dir: Path, probe: dict) -> torch.Tensor:
    """(B, T, V) log-probs of a final model at every probe response position."""
    from tether.models import load_model
    from tether.scoring import forward

    model, _ = load_model(model_dir)
    model.eval()
    P, T = probe["prompt_len"], probe["response_mask"].shape[1]
    logits, _ = forward(model, probe["input_ids"], probe["attention_mask"])
    return torch.log_softmax(logits[:, P - 1:P + T - 1].float(), -1)


def probe_kl(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """D(a, b): mean over response tokens of KL(p_a || p_b), full vocabulary."""
    kl = (a.exp() * (a - b)).sum(-1)  # (B, T)
    return float((kl * mask).sum() / mask.sum())


def cached_probe_logp(out: Path, name: str, probe: dict) -> torch.Tensor | None:
    d = Path(out) / "cells" / name
    cache = d / "probe_logp.pt"
    if cache.is_file():
        return torch.load(cache)
    if not (d / "final" / "config.json").is_file():
        return None
    lp = probe_logp(d / "final", probe)
    torch.save(lp, cache)
    return lp


# -- the summary: per cell and per (scenario, method) group --------------------------------

def leaves_band(group: list[list[dict]], reference: list[list[dict]], sigma: float) -> int | None:
    """The first evaluation step at which the group's seed-mean trainer-side headline is
    more than 2 sigma (the reference's final seed-to-seed sigma) from the reference's
    seed-mean at the same step; None if it never is (or either side logged nothing)."""
    if not (sigma > 0) or not group or not reference:
        return None

    def mean_by_step(runs: list[list[dict]]) -> dict[int, float]:
        by_step: dict[int, list[float]] = {}
        for rows in runs:
            steps, values = series(rows, trainer_headline(rows))
            for st, v in zip(steps, values, strict=True):
                by_step.setdefault(int(st), []).append(float(v))
        return {st: float(np.mean(v)) for st, v in by_step.items()}

    ref, own = mean_by_step(reference), mean_by_step(group)
    return next((st for st in sorted(own) if st in ref and abs(own[st] - ref[st]) > 2 * sigma), None)


def _mean_std(values: list[float]) -> tuple[float, float]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return float("nan"), float("nan")
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else float("nan")


CI_LEVEL, CI_DRAWS = 0.95, 4000


def ratio(g: np.ndarray, r: np.ndarray) -> np.ndarray:
    """mean(group) / mean(reference), row-wise over resampled seeds."""
    return g.mean(-1) / r.mean(-1)


def deviation(g: np.ndarray, r: np.ndarray) -> np.ndarray:
    """|mean(group) - mean(reference)| in the reference's seed-to-seed sigma, row-wise."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.abs(g.mean(-1) - r.mean(-1)) / r.std(-1, ddof=1)


def bootstrap_ci(group: list[float], reference: list[float],
                 stat: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 draws: int = CI_DRAWS, seed: int = 0, paired: bool = False) -> tuple[float, float]:
    """The CI_LEVEL percentile interval of `stat(group, reference)` with each side's seeds
    resampled with replacement, independently; `paired`: the two sides aligned by seed and
    resampled jointly, pair i staying a pair (a pair with a missing side left out). Draws
    where the stat is undefined (a reference resample of one repeated seed has no sigma) are
    left out."""
    g, r = (np.array([np.nan if x is None else x for x in side], dtype=float) for side in (group, reference))
    if paired:
        both = np.isfinite(g) & np.isfinite(r)
        g, r = g[both], r[both]
    g, r = g[np.isfinite(g)], r[np.isfinite(r)]
    if len(g) < 2 or len(r) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(g), (draws, len(g)))
    vals = stat(g[idx], r[idx] if paired else r[rng.integers(0, len(r), (draws, len(r)))])
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        return float("nan"), float("nan")
    lo, hi = np.quantile(vals, [(1 - CI_LEVEL) / 2, (1 + CI_LEVEL) / 2])
    return float(lo), float(hi)


def summarize(out: Path, probe_tokens: int = 16,
              extend: Callable[[Path, dict], None] | None = None) -> dict:
    """Per-cell and per-group numbers with deviations from the on-policy reference.

    `extend(out, summary)`, an experiment module's own numbers (cis: truncation bias;
    vespo: retention against N = 1), runs before the files are written. Writes
    OUT/cells.csv, OUT/summary.csv and OUT/summary.json; returns the summary.
    """
    out = Path(out)
    meta = load_meta(out)
    ref = tuple(meta["reference"])
    cells, unfinished = {}, []
    for c in meta["cells"]:
        rows = cell_rows(out, c["name"])
        done = out / "cells" / c["name"] / "done.json"
        if not done.is_file():  # a stopped cell's last row is mid-run, not its final value
            if rows:
                unfinished.append(c["name"])
            continue
        cells[c["name"]] = {"scenario": c["scenario"], "method": c["method"], "seed": c["seed"],
                            **cell_stats(rows), "wall_seconds": json.loads(done.read_text())["seconds"]}
    # Probe distances to the reference's final models.
    probe = make_probe(out, meta["model_path"], probe_tokens)
    mask = probe["response_mask"]
    lps = {n: cached_probe_logp(out, n, probe) for n in cells}
    ref_names = [n for n, c in cells.items() if (c["scenario"], c["method"]) == ref and lps[n] is not None]
    pair = [probe_kl(lps[a], lps[b], mask) for a in ref_names for b in ref_names if a != b]
    ref_spread = float(np.mean(pair)) if pair else float("nan")
    for n, c in cells.items():
        others = [r for r in ref_names if r != n]
        d = [probe_kl(lps[r], lps[n], mask) for r in others] if lps[n] is not None else []
        c["probe_kl_to_ref"] = float(np.mean(d)) if d else float("nan")
    # Group by (scenario, method): mean and std over seeds; deviations in on-policy sigma.
    ref_cells = [c for c in cells.values() if (c["scenario"], c["method"]) == ref]
    ref_r, sig_r = _mean_std([c["final_reward"] for c in ref_cells])
    ref_a, sig_a = _mean_std([c["final_accuracy"] for c in ref_cells])
    ref_t, sig_t = _mean_std([c["final_trainer"] for c in ref_cells])
    ref_l3, sig_l3 = _mean_std([c["last3_trainer"] for c in ref_cells])
    groups = []
    for scen, meth in dict.fromkeys((c["scenario"], c["method"]) for c in cells.values()):
        members = [c for c in cells.values() if c["scenario"] == scen and c["method"] == meth]
        g = {"scenario": scen, "method": meth, "seeds": len(members)}
        for key in ("final_reward", "final_accuracy", "final_trainer", "final_reward_sampled", "min_ess", "rare_kl_share_max",
                    "resyncs", "is_second_moment", "is_adv_second_moment",
                    "corr_second_moment", "corr_adv_second_moment", "numerical_k3",
                    "staleness_k3", "total_k3", "monitor_k3", "step_seconds", "probe_kl_to_ref", "best_reward_smoothed",
                    "mean_staleness", "max_staleness", "samples_per_s", "trained_per_generated",
                    "wall_seconds", "best_trainer",
                    "lowest_trainer", "last3_trainer"):
            g[key], g[key + "_std"] = _mean_std([m[key] for m in members])
        steps = [m["ess_below_0.5_step"] for m in members]
        g["ess_below_0.5_step"] = min((s for s in steps if s is not None), default=None)
        g["collapsed"] = sum(m["collapsed"] for m in members)
        g["collapsed_trainer"] = sum(m["collapsed_trainer"] for m in members)
        g["reward_dev_sigma"] = abs(g["final_reward"] - ref_r) / sig_r if sig_r > 0 else float("nan")
        g["accuracy_dev_sigma"] = abs(g["final_accuracy"] - ref_a) / sig_a if sig_a > 0 else float("nan")
        g["trainer_dev_sigma"] = abs(g["final_trainer"] - ref_t) / sig_t if sig_t > 0 else float("nan")
        g["trainer_ratio"] = g["final_trainer"] / ref_t if ref_t > 0 else float("nan")
        g["last3_dev_sigma"] = (abs(g["last3_trainer"] - ref_l3) / sig_l3 if sig_l3 > 0
                                else float("nan"))
        g["last3_ratio"] = g["last3_trainer"] / ref_l3 if ref_l3 > 0 else float("nan")
        own_rows = {n: cell_rows(out, n) for n, c in cells.items() if (c["scenario"], c["method"]) == (scen, meth)}
        ref_rows = [cell_rows(out, n) for n, c in cells.items() if (c["scenario"], c["method"]) == ref]
        g["leaves_band_step"] = leaves_band(list(own_rows.values()), ref_rows, sig_t)
        # Per seed, in seed order: does the ESS fall below 0.5 before the run leaves the band?
        by_seed = sorted(own_rows, key=lambda n: cells[n]["seed"])
        g["ess_below_0.5_per_seed"] = [cells[n]["ess_below_0.5_step"] for n in by_seed]
        g["leaves_band_per_seed"] = [leaves_band([own_rows[n]], ref_rows, sig_t) for n in by_seed]
        for key, value in (("trainer", "final_trainer"), ("last3", "last3_trainer")):
            own, base = [m[value] for m in members], [c[value] for c in ref_cells]
            g[f"{key}_ratio_lo"], g[f"{key}_ratio_hi"] = bootstrap_ci(own, base, ratio)
            g[f"{key}_dev_sigma_lo"], g[f"{key}_dev_sigma_hi"] = bootstrap_ci(own, base, deviation)
        g["probe_dev_sigma"] = (math.sqrt(g["probe_kl_to_ref"] / ref_spread)
                                if ref_spread > 0 and math.isfinite(g["probe_kl_to_ref"]) else float("nan"))
        groups.append(g)
    summary = {"experiment": meta["name"], "reference": list(ref), "reference_reward": ref_r,
               "reference_reward_sigma": sig_r, "reference_accuracy": ref_a,
               "reference_accuracy_sigma": sig_a, "reference_trainer": ref_t,
               "reference_trainer_sigma": sig_t, "reference_last3": ref_l3,
               "reference_last3_sigma": sig_l3,
               "trainer_metric": ref_cells[0]["trainer_metric"] if ref_cells else None,
               "reference_probe_kl_spread": ref_spread,
               "cells": cells, "groups": groups, "unfinished": unfinished}
    if extend is not None:
        extend(out, summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=_json))
    write_csv(out / "cells.csv", [{"cell": n, **c} for n, c in cells.items()])
    write_csv(out / "summary.csv", groups)
    return summary


def _json(v):
    return None if v is None else float(v)


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        path.write_text("")
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


def fmt(v, digits: int = 3) -> str:
    """A table cell: NaN/None as 'n/a', a list as its values joined."""
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x, digits) for x in v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        if v != 0 and abs(v) < 0.01:
            return f"{v:.2e}"
        return f"{v:.{digits}g}" if abs(v) >= 100 else f"{v:.{digits}f}"
    return str(v)


def cell_text(row: dict, key: str) -> str:
    """A table cell: the value, `± std` where the row holds `key_std`, and its 95% interval
    `[lo, hi]` where it holds `key_lo` and `key_hi`."""
    text = fmt(row.get(key))
    std, lo, hi = row.get(key + "_std"), row.get(key + "_lo"), row.get(key + "_hi")
    if isinstance(std, float) and math.isfinite(std):
        text += f" ± {fmt(std)}"
    if isinstance(lo, float) and isinstance(hi, float) and math.isfinite(lo) and math.isfinite(hi):
        text += f" [{fmt(lo)}, {fmt(hi)}]"
    return text


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """`columns`: (key, header); each cell as `cell_text` writes it."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell_text(r, k) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
