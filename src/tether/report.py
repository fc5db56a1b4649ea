"""`tether report DIR`: one experiment directory -> PNG figures, an HTML page, a markdown summary.

Reads what `tether experiment` wrote (OUT/experiment.json, OUT/cells/*/metrics.jsonl,
summarising again if needed) and writes OUT/report/: one PNG per figure, `index.html`
(self-contained: every figure embedded as base64 PNG, with a link to its file) and
`summary.md` (the tables, figures linked). Every figure's title is the one question it
answers; curves are means over seeds with a band of +- one standard deviation.
"""

from __future__ import annotations

import base64
import html
import json
import math
import textwrap
from pathlib import Path

import numpy as np

from tether.errors import InputError
from tether.experiments import analysis, get, own_tables, tables_markdown
from tether.experiments.cis import measured_generators
from tether.models import quiet_transformers

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Lay out, write and close a figure; its path."""
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _plt().close(fig)
    return path


def method_colors(name: str, methods: list[str]) -> dict[str, str]:
    """One colour per method, fixed by the experiment's method list, so a method keeps its
    colour in every figure and in every slice of the matrix."""
    order = list(dict.fromkeys([*get(name).METHODS, *methods]))
    return {m: COLORS[order.index(m) % len(COLORS)] for m in methods}


def _wrap(title: str, width: int) -> str:
    return "\n".join(textwrap.wrap(title, width))


def _group_curves(out: Path, meta: dict, key: str, smooth_w: int = 0, log: bool = False,
                  x: str = "step") -> dict:
    """(scenario, method) -> (steps, mean, std) over seeds of `key`, on the steps all share.

    `log`: mean and std of log10 of the values (a geometric band for a log axis). `x`: the
    rows' counter on the x axis (`analysis.series`).
    """
    runs: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for c in meta["cells"]:
        s, v = analysis.series(analysis.cell_rows(out, c["name"]), key, x)
        if log:
            v = np.log10(np.maximum(v, 1e-12))
        if len(v):
            runs.setdefault((c["scenario"], c["method"]), []).append(
                (s, analysis.smooth(v, smooth_w) if smooth_w else v))
    curves = {}
    for g, rs in runs.items():
        n = min(len(s) for s, _ in rs)
        vals = np.stack([v[:n] for _, v in rs])
        curves[g] = (rs[0][0][:n], vals.mean(0), vals.std(0, ddof=1) if len(rs) > 1 else 0 * vals[0])
    return curves


def _panels(plt, n: int):
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False,
                             sharey=True)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def curves_figure(out: Path, meta: dict, key: str, ylabel: str, title: str, path: Path,
                  smooth_w: int = 0, log_y: bool = False, hline: float | None = None,
                  x: str = "step") -> Path | None:
    """One panel per scenario, one line per method, the on-policy reference dashed in each;
    `x`: "step" (rollout steps) or "version" (optimizer steps)."""
    plt = _plt()
    curves = _group_curves(out, meta, key, smooth_w, log=log_y, x=x)
    if not curves:
        return None
    if log_y:  # back from log10: geometric mean over seeds, band x/÷ the geometric std
        curves = {g: (s, 10 ** m, 10 ** m, 10 ** (m - sd), 10 ** (m + sd))
                  for g, (s, m, sd) in curves.items()}
    else:
        curves = {g: (s, m, sd, m - sd, m + sd) for g, (s, m, sd) in curves.items()}
    ref = tuple(meta["reference"])
    scenarios = list(dict.fromkeys(g[0] for g in curves))
    methods = list(dict.fromkeys(g[1] for g in curves))
    colors = method_colors(meta["name"], methods)
    fig, axes = _panels(plt, len(scenarios))
    for ax, scen in zip(axes, scenarios):
        if ref in curves and scen != ref[0]:
            s, m, _, lo, hi = curves[ref]
            ax.plot(s, m, "k--", lw=1.2, label=f"on-policy ({ref[0]}, {ref[1]})")
            ax.fill_between(s, lo, hi, color="k", alpha=0.08)
        for meth in methods:
            if (scen, meth) not in curves:
                continue
            s, m, _, lo, hi = curves[(scen, meth)]
            color = colors[meth]
            ax.plot(s, m, color=color, lw=1.6, marker="." if len(s) < 8 else None, label=meth)
            ax.fill_between(s, lo, hi, color=color, alpha=0.18)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls=":")
        if log_y:
            ax.set_yscale("log")
        ax.set_title(f"generator / setting: {scen}", fontsize=9)
        ax.set_xlabel("optimizer step (version)" if x == "version" else "RL step")
        ax.set_ylabel(ylabel + (" (geometric mean)" if log_y else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_wrap(title, 40 * min(len(scenarios), 3)), fontsize=10)
    return _save(fig, path)


def bars_figure(groups: list[dict], keys: list[tuple[str, str]], xlabel: str, title: str,
                path: Path, log_x: bool = False, vline: float | None = None) -> Path | None:
    """Grouped horizontal bars: one row per (scenario, method), one bar per key, error bar =
    std; the first group on top, so a long matrix stays readable."""
    plt = _plt()
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(8, 1.4 + 0.16 * len(groups) * (len(keys) + 1)))
    y = np.arange(len(groups))
    height = 0.8 / len(keys)
    for i, (k, label) in enumerate(keys):
        vals = [g.get(k, float("nan")) for g in groups]
        errs = [g.get(k + "_std", float("nan")) for g in groups]
        errs = [e if isinstance(e, float) and math.isfinite(e) else 0.0 for e in errs]
        ax.barh(y + (i - (len(keys) - 1) / 2) * height, vals, height, xerr=errs, capsize=2,
                color=COLORS[i % len(COLORS)], label=label)
    if vline is not None:
        ax.axvline(vline, color="k", ls="--", lw=1)
    ax.set_yticks(y, [f"{g['scenario']} · {g['method']}" for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if log_x:
        ax.set_xscale("log")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(_wrap(title, 80), fontsize=10)
    return _save(fig, path)


def vespo_figure(groups: list[dict], path: Path, metric: str, twins: dict[str, str]) -> Path | None:
    """Trainer-side value (`metric`, the mean of the last 3 evaluations) against N per method,
    starting from its N = 1 twin (`twins`: the method whose on-policy run has its gradient)
    where it has no N = 1 run of its own; groups with a seed whose trainer-side value
    collapsed marked with a red x. The race's groups (`N4_race`) are not on this axis."""
    plt = _plt()
    groups = [g for g in groups if g["scenario"][1:].isdigit()]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    methods = list(dict.fromkeys(g["method"] for g in groups))
    colors = method_colors("vespo", methods)
    for meth in methods:
        own = [g for g in groups if g["method"] == meth]
        if not any(g["scenario"] == "N1" for g in own):
            own += [g for g in groups if g["scenario"] == "N1" and g["method"] == twins.get(meth)]
        gs = sorted(own, key=lambda g: int(g["scenario"][1:]))
        n = [int(g["scenario"][1:]) for g in gs]
        r = [g["last3_trainer"] for g in gs]
        sd = [g["last3_trainer_std"] if math.isfinite(g["last3_trainer_std"]) else 0 for g in gs]
        ax.errorbar(n, r, yerr=sd, color=colors[meth], marker="o", capsize=2, label=meth)
        bad = [(a, b) for a, b, g in zip(n, r, gs) if g["collapsed_trainer"]]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=90, color="red", zorder=5)
    ax.scatter([], [], marker="x", color="red", label="collapsed (final < half its best)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({int(g["scenario"][1:]) for g in groups}))
    ax.get_xaxis().set_major_formatter(plt.ScalarFormatter())
    ax.set_xlabel("staleness N (optimizer steps per rollout batch)")
    ax.set_ylabel(f"trainer-side {metric}, last 3 evaluations")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Which objective keeps the trained policy's reward as N grows?", fontsize=10)
    return _save(fig, path)


def bias_figure(tb: dict, path: Path) -> Path | None:
    plt = _plt()
    bins = [b for b in tb["bins"] if b["tokens"]]
    if not bins:
        return None
    names = [k.split("/")[0] for k in bins[0] if k.endswith("/bias")]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = np.arange(len(bins))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar(x + (i - (len(names) - 1) / 2) * width, [b[f"{name}/bias"] for b in bins], width,
               color=COLORS[i % len(COLORS)], label=name)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, [f"π_old in {b['bin']}\n{b['tokens']} tokens" for b in bins], fontsize=7)
    ax.set_ylabel("mean (w − ρ) per token")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(_wrap("How far does each correction's weight fall from the exact IS weight, "
                       "by token confidence?", 75), fontsize=9)
    return _save(fig, path)


def frontier_figure(tb: dict, path: Path) -> Path | None:
    """E-CIS: |bias| in the test bin against E[w^2], TIS along its caps, CIS as a point."""
    gens = [g for g in measured_generators(tb) if g.get("frontier")]
    if not gens:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, g in enumerate(gens):
        tis, cis, color = g["frontier"]["tis"], g["frontier"]["cis"], COLORS[i % len(COLORS)]
        name = g.get("scenario", "inj")
        ax.plot([p["second_moment"] for p in tis], [p["abs_bias"] for p in tis], "o-", color=color,
                label=f"{name}: tis, cap {tis[0]['cap']:g} ... {tis[-1]['cap']:g}")
        for p in (tis[0], tis[-1]):
            ax.annotate(f"{p['cap']:g}", (p["second_moment"], p["abs_bias"]), fontsize=7)
        ax.plot([cis["second_moment"]], [cis["abs_bias"]], "*", ms=14, color=color, label=f"{name}: cis")
    ax.set_xlabel("E[w²] over all tokens")
    ax.set_ylabel("|mean (w − ρ)|, π_old < 0.5")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1e-4)  # 0 (no truncation) stays on the axis
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(_wrap("Is CIS's point below the bias / second-moment frontier TIS draws "
                       "as its cap moves?", 70), fontsize=9)
    return _save(fig, path)


def make_figures(out: Path, meta: dict, summary: dict, figdir: Path) -> list[tuple[Path, str]]:
    """All figures of the experiment: (path, the question its title states)."""
    figs = []
    x = getattr(get(meta["name"]), "CURVE_X", "step")  # vespo: optimizer steps, comparable across N

    def add(path, title):
        if path is not None:
            figs.append((path, title))

    q = "Does the generator-side batch reward under each method follow the on-policy run (dashed)?"
    add(curves_figure(out, meta, "reward/mean", "generator-side batch reward (running mean of 5)",
                      q, figdir / "reward.png", smooth_w=5, x=x), q)
    # Trainer-side: held-out, sampled at the trainer's weights (absent when eval.samples=0).
    for key, label, fname in (("eval/accuracy_sampled", "held-out accuracy (sampled)", "accuracy_sampled.png"),
                              ("eval/reward_sampled", "held-out reward (sampled)", "reward_sampled.png")):
        q = f"Does the trained policy's {label}, at the trainer's weights, follow the on-policy run (dashed)?"
        add(curves_figure(out, meta, key, label, q, figdir / fname, x=x), q)
    q = "Does held-out greedy accuracy under each method follow the on-policy run (dashed)?"
    add(curves_figure(out, meta, "eval/accuracy", "held-out accuracy (greedy)", q,
                      figdir / "accuracy.png", x=x), q)
    groups = summary["groups"]
    name = meta["name"]
    if name == "dlc":
        q = "How far from the on-policy path does each method end, in on-policy seed-to-seed sigma?"
        add(bars_figure(groups, [("reward_dev_sigma", "final reward"),
                                 ("accuracy_dev_sigma", "final accuracy"),
                                 ("probe_dev_sigma", "probe distribution")],
                        "deviation (on-policy σ)", q, figdir / "deviation.png", vline=3.0), q)
        q = "When does the staleness ESS fall below 0.5 (dotted), and does re-sync lift it?"
        add(curves_figure(out, meta, "staleness/ess/token", "token ESS of π_θ/π_old", q,
                          figdir / "ess.png", log_y=True, hline=0.5), q)
        q = "What share of the current model's divergence from the generator sits on rare tokens?"
        add(curves_figure(out, meta, "monitor/kl_share/rare", "KL share on tokens with μ < 0.05",
                          q, figdir / "rare_share.png"), q)
    if name == "cis":
        q = "How much does each correction shrink the weights' (advantage-weighted) second moment?"
        add(bars_figure([g for g in groups if g["scenario"] != "exact"],
                        [("is_adv_second_moment", "raw ρ: E[ρ²A²]/E[A²]"),
                         ("corr_adv_second_moment", "applied w: E[w²A²]/E[A²]"),
                         ("is_second_moment", "raw ρ: E[ρ²]"),
                         ("corr_second_moment", "applied w: E[w²]")],
                        "second moment (1 = uncorrected)", q, figdir / "second_moment.png",
                        vline=1.0), q)
        if summary.get("truncation_bias"):
            q = "How far does each correction's weight fall from the exact IS weight, by confidence?"
            add(bias_figure(summary["truncation_bias"], figdir / "truncation_bias.png"), q)
            q = "Is CIS's point below the bias / second-moment frontier TIS draws as its cap moves?"
            add(frontier_figure(summary["truncation_bias"], figdir / "frontier.png"), q)
    if name == "vespo":
        q = "Which objective keeps the trained policy's reward as N grows?"
        add(vespo_figure(groups, figdir / "reward_vs_N.png", summary["trainer_metric"] or "headline",
                         get("vespo").N1_TWIN), q)
        for key, label, fname in (("objective/coef_seq/q50", "φ(W): median response", "phi_q50.png"),
                                  ("objective/coef_seq/top_share", "φ's share on the top 5%", "phi_top.png"),
                                  ("staleness/seq_log_ratio/q95", "log W: 95th percentile", "log_w_q95.png")):
            q = f"Where does each objective's sequence weight sit over training ({label})?"
            add(curves_figure(out, meta, key, label, q, figdir / fname, x=x), q)  # seq_weights runs
    return figs


def _html_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in columns)
    body = []
    for r in rows:
        tds = "".join(f"<td>{html.escape(analysis.cell_text(r, k))}</td>" for k, _ in columns)
        body.append(f"<tr>{tds}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


BIAS_COLUMNS = [("bin", "π_old bin"), ("tokens", "tokens"), ("rho_mean", "mean ρ"),
                ("rho_second_moment", "E[ρ²]")]


def _bias_columns(tb: dict) -> list[tuple[str, str]]:
    names = [k.split("/")[0] for k in tb["bins"][0] if k.endswith("/bias")]
    ratio = [("cis_over_tis", "bias ratio cis / tis (abs.)"), ("cis_over_tis_per_batch", "… per batch"),
             ("rho_second_moment_per_batch", "E[ρ²] per batch")] if "cis_over_tis" in tb["bins"][0] else []
    return BIAS_COLUMNS + [(f"{n}/bias", f"{n}: mean(w−ρ)") for n in names] + \
        [(f"{n}/second_moment", f"{n}: E[w²]") for n in names] + ratio


EPSILON_COLUMNS = [("lo", "μ from"), ("hi", "μ to"), ("tokens", "tokens"), ("mad", "MAD"),
                   ("q05", "q05"), ("q95", "q95")]


def _bias_test_line(test: dict) -> str:
    per = ", ".join(analysis.fmt(x) for x in test.get("cis_over_tis_per_batch", []))
    return (f"Test bin π_old {test['bin']}: |bias_cis| / |bias_tis| = {analysis.fmt(test['cis_over_tis'])} "
            f"pooled, per batch: {per} (bar ≤ 0.5 pooled and in every batch: "
            f"{'met' if test['passes'] else 'not met'}). The other bins' ratios, where CIS may "
            "truncate harder than TIS, are in the table.")


def _second_moment_line(g: dict) -> str:
    """Plain IS's second moment sampled (mean rho^2 over the sampled tokens) beside its exact
    value on the same prefixes (E_mu[rho^2] = sum_v pi_old(v)^2 / mu(v), whole vocabulary)."""
    per = "; ".join(f"{analysis.fmt(b['sampled'])} / {analysis.fmt(b['exact'])}"
                    for b in g["rho_second_moment_per_batch"])
    return (f"Plain IS second moment E[ρ²]: sampled {analysis.fmt(g['rho_second_moment'])}, exact on "
            f"the same prefixes {analysis.fmt(g['rho_second_moment_exact'])} (Σ_v π_old(v)²/μ(v) per "
            f"prefix; largest prefix {analysis.fmt(g['rho_second_moment_exact_max'])}); per batch, "
            f"sampled / exact: {per}.")


def _epsilon_caption(g: dict) -> str:
    a = g.get("appendix_a", {})
    return (f"ε = logit π_old − logit μ by generator confidence μ ({g['tokens']} tokens; pooled "
            f"raw E[ρ²] {analysis.fmt(g.get('rho_second_moment'))}, max ρ {analysis.fmt(g.get('rho_max'))}), "
            f"beside CIS Appendix A: MAD {a.get('mad')}, q95 {a.get('q95')}, flat across bins; "
            f"pooled raw E[ρ²A²]/E[A²] {a.get('adv_second_moment')}:")


def build_report(out: str | Path, command: str | None = None,
                 summary: dict | None = None) -> tuple[Path, Path, list[Path]]:
    """Write OUT/report/{index.html, summary.md, *.png}; return (html, md, figure paths).
    `summary`: OUT's, already computed (`tether report RECORD` has it from the record's tables)."""
    import torch

    torch.set_num_threads(1)  # tiny models: a second thread only contends
    quiet_transformers()
    out = Path(out)
    if not (out / "experiment.json").is_file():
        raise InputError(f"{out} is not an experiment directory (no experiment.json); "
                         "run `tether experiment NAME --out DIR` first")
    meta = analysis.load_meta(out)
    module = get(meta["name"])
    if summary is None:
        summary = analysis.summarize(out, extend=getattr(module, "extend", None))
    figdir = out / "report"
    figdir.mkdir(exist_ok=True)
    figs = make_figures(out, meta, summary, figdir)
    timing = json.loads((out / "timing.json").read_text()) if (out / "timing.json").is_file() else []
    failed = json.loads((out / "failed.json").read_text()) if (out / "failed.json").is_file() else {}
    groups = summary["groups"]
    ref_line = (f"On-policy reference {meta['reference'][0]} x {meta['reference'][1]}: final "
                f"trainer-side {summary['trainer_metric']} {analysis.fmt(summary['reference_trainer'])} "
                f"(σ {analysis.fmt(summary['reference_trainer_sigma'])}), final greedy accuracy "
                f"{analysis.fmt(summary['reference_accuracy'])} (σ {analysis.fmt(summary['reference_accuracy_sigma'])}), "
                f"final generator-side batch reward {analysis.fmt(summary['reference_reward'])} "
                f"(σ {analysis.fmt(summary['reference_reward_sigma'])}).")
    run_line = "; ".join(f"{t['cells_run']} cells in {t['wall_seconds']:.0f} s on {t['workers']} "
                         f"worker(s)" for t in timing)
    if summary.get("unfinished"):  # started, not done: left out of every table
        run_line += f"; {len(summary['unfinished'])} unfinished cell(s) left out"
    extra = own_tables(module, summary)  # claims, controls
    # Markdown.
    md = [f"# Experiment {meta['name']}", "", f"**Question.** {meta['question']}", ""]
    if command:
        md += [f"Command: `{command}`", ""]
    md += [f"Settings (every cell): `{' '.join(meta['base'])}`", "",
           *[f"- {n}" for n in meta["notes"]], "", ref_line, "",
           f"Runs: {run_line or 'none recorded'}. Failed cells: {len(failed)}.", "",
           tables_markdown(module, summary, extra)]
    tb = summary.get("truncation_bias")
    for g in measured_generators(tb):
        caption = (f"Truncation bias by confidence bin (starting model, generator "
                   f"{g.get('generator', 'bf16')}; {g['definition']}):")
        md += [caption, "", analysis.markdown_table(g["bins"], _bias_columns(g)), ""]
        if g.get("test"):
            md += [_bias_test_line(g["test"]), ""]
        if "rho_second_moment_exact" in g:
            md += [_second_moment_line(g), ""]
        if g.get("epsilon"):
            md += [_epsilon_caption(g), "", analysis.markdown_table(g["epsilon"], EPSILON_COLUMNS), ""]
    md += [f"![{title}]({p.name})" for p, title in figs]
    md_path = figdir / "summary.md"
    md_path.write_text("\n".join(md) + "\n")
    # HTML, self-contained.
    parts = [f"<h1>Experiment {html.escape(meta['name'])}</h1>",
             f"<p><b>Question.</b> {html.escape(meta['question'])}</p>"]
    if command:
        parts.append(f"<p>Command: <code>{html.escape(command)}</code></p>")
    parts += [f"<p>Settings (every cell): <code>{html.escape(' '.join(meta['base']))}</code></p>",
              "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in meta["notes"]) + "</ul>",
              f"<p>{html.escape(ref_line)}</p>",
              f"<p>Runs: {html.escape(run_line or 'none recorded')}. Failed cells: {len(failed)}.</p>",
              _html_table(groups, module.COLUMNS)]
    for title, rows, columns in extra:
        parts += [f"<p>{html.escape(title)}</p>", _html_table(rows, columns)]
    for g in measured_generators(tb):
        caption = (f"Truncation bias by confidence bin (generator {html.escape(g.get('generator', ''))}; "
                   f"{html.escape(g['definition'])}):")
        parts += [f"<p>{caption}</p>", _html_table(g["bins"], _bias_columns(g))]
        if g.get("test"):
            parts.append(f"<p>{html.escape(_bias_test_line(g['test']))}</p>")
        if "rho_second_moment_exact" in g:
            parts.append(f"<p>{html.escape(_second_moment_line(g))}</p>")
        if g.get("epsilon"):
            parts += [f"<p>{html.escape(_epsilon_caption(g))}</p>",
                      _html_table(g["epsilon"], EPSILON_COLUMNS)]
    for p, title in figs:
        data = base64.b64encode(p.read_bytes()).decode()
        parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(title)}">'
                     f'<figcaption>{html.escape(title)} (<a href="{p.name}">{p.name}</a>)'
                     f"</figcaption></figure>")
    parts.append("<p>Definitions of every column: docs/experiments.md.</p>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
             "table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;"
             "padding:2px 6px}img{max-width:100%}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>tether experiment "
            f"{html.escape(meta['name'])}</title><style>{style}</style></head><body>"
            + "\n".join(parts) + "</body></html>")
    html_path = figdir / "index.html"
    html_path.write_text(page)
    return html_path, md_path, [p for p, _ in figs]
