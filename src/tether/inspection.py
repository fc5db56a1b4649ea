"""`tether inspect RUN_DIR`: a run's mismatch decomposition over time, as text and PNG plots.

Reads RUN_DIR/metrics.jsonl (the source of truth) and RUN_DIR/config.yaml, or a log-prob
dump from any trainer (tether.dump: the TRL plug-in writes one). The summary
says, window by window, which cause dominates the disagreement (k3 KL of the numerical
part pi_old vs mu against the staleness part pi_theta vs pi_old), when the staleness
ESS fell below the re-sync threshold, when the generator received weights and how stale
the trained batches were. The plots show the same per step. Metric names: docs/metrics.md.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from tether.advice import ROUNDING_K3, advise_run
from tether.auto import NUMERICAL, STALENESS, format_timeline
from tether.dump import dump_rows, is_dump
from tether.errors import InputError
from tether.logger import read_jsonl

CAUSE_COLORS = {"numerical": "tab:blue", "staleness": "tab:orange", "total": "tab:gray"}


def _num(v: Any) -> float | None:
    """A logged value as float; JSONL writes non-finite floats as strings ("nan")."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that logged it."""
    pts = [(r["step"], x) for r in rows if (x := _num(r.get(key))) is not None]
    return [s for s, _ in pts], [x for _, x in pts]


def training_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of training steps (not step 0's evaluation-only row)."""
    return [r for r in rows if r.get("step", 0) > 0 and "version" in r]


def load_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A run's metric rows and config; a log-prob dump (tether.dump) gives the rows its
    split computes, step by step."""
    run_dir = Path(run_dir)
    if is_dump(run_dir):
        return dump_rows(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{run_dir} is neither a tether run directory (no metrics.jsonl) nor a "
                         "log-prob dump (docs/integrations.md)")
    cfg_path = run_dir / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    return read_jsonl(path), cfg or {}


def threshold(cfg: dict[str, Any], tau: float | None) -> tuple[float, bool]:
    """The ESS threshold: `tau` if given, else the run's ess:TAU policy, else 0.5 (for reference).

    Returns (tau, whether the run re-syncs on it).
    """
    spec = str(cfg.get("sync", {}).get("policy", ""))
    from_run = spec.startswith("ess:")
    if tau is not None:
        return tau, from_run
    return (float(spec.split(":")[1]) if from_run else 0.5), from_run


def _fmt(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2e}" if abs(x) < 1e-2 and x else f"{x:.3f}"


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _steps_list(steps: list[int], limit: int = 12) -> str:
    if not steps:
        return "none"
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


def summarize(rows: list[dict[str, Any]], cfg: dict[str, Any], tau: float | None = None,
              windows: int = 5) -> str:
    """The terminal summary (see the module docstring)."""
    train_rows = training_rows(rows)
    if not train_rows:
        return "no training steps logged yet"
    tau, resyncs = threshold(cfg, tau)
    gen = cfg.get("rollout", {})
    sync = cfg.get("sync", {})
    source = f"{cfg['source']} dump   " if "source" in cfg else ""
    out = [(
        f"steps {train_rows[0]['step']}-{train_rows[-1]['step']}   {source}estimator "
        f"{cfg.get('train', {}).get('estimator', '?')}   generator {gen.get('precision', '?')}"
        f" vs trainer {cfg.get('train', {}).get('precision', 'fp32')}   "
        f"sync {sync.get('policy', '?')}, lag {sync.get('lag', 0)}, on_trip {sync.get('on_trip', '-')}"
        f"   minibatches {cfg.get('train', {}).get('minibatches', 1)}"
    )]
    # Trainer-side first: the held-out set sampled at the trainer's weights (docs/metrics.md).
    acc_steps, acc = series(rows, "eval/accuracy")
    if acc:
        line = (f"trainer-side, held out: eval/accuracy {acc[0]:.3f} (step {acc_steps[0]}) -> "
                f"{acc[-1]:.3f} (step {acc_steps[-1]})")
        for key in ("eval/accuracy_sampled", "eval/reward_sampled"):
            _, v = series(rows, key)
            if v:
                line += f"   {key} {v[0]:.3f} -> {v[-1]:.3f}"
        out.append(line)
    _, rew = series(train_rows, "reward/mean")
    k = max(1, len(rew) // 5)
    if rew:  # a dump has no rewards
        out.append(f"generator-side batch reward (reward/mean, at the generator's weights): "
                   f"first {k} steps {_fmt(_mean(rew[:k]))} -> last {k} {_fmt(_mean(rew[-k:]))}")

    # Decomposition by window: which cause dominates the k3 KL.
    out += ["", "mismatch by cause, k3 KL per token (window means); dominant = larger of the two causes",
            (f"{'steps':>9}  {'numerical':>10}  {'staleness':>10}  {'total':>10}  {'dominant':>10}  "
             f"{'staleness ESS min':>17}  {'stale versions':>14}")]
    n = len(train_rows)
    size = max(1, math.ceil(n / max(1, windows)))
    for i in range(0, n, size):
        win = train_rows[i:i + size]
        k3 = {c: _mean(series(win, f"{c}/k3_kl/mean")[1]) for c in CAUSE_COLORS}
        ess_vals = series(win, "staleness/ess/token")[1]
        stale = _mean(series(win, "staleness/versions/batch")[1])
        num, st = k3["numerical"], k3["staleness"]
        dom = "-" if num is None or st is None else "staleness" if st > num else "numerical"
        out.append(f"{win[0]['step']:>4}-{win[-1]['step']:<4}  {_fmt(num):>10}  {_fmt(st):>10}  "
                   f"{_fmt(k3['total']):>10}  {dom:>10}  {_fmt(min(ess_vals) if ess_vals else None):>17}"
                   f"  {_fmt(stale):>14}")
    whole = {c: _mean(series(train_rows, f"{c}/k3_kl/mean")[1]) for c in ("numerical", "staleness")}
    if None not in whole.values():
        out.append(f"over the run: {dominance(whole)}")

    # ESS against the threshold, and the syncs.
    key = "sync/ess/token" if any("sync/ess/token" in r for r in train_rows) else "staleness/ess/token"
    steps, ess = series(train_rows, key)
    below = [s for s, e in zip(steps, ess) if e < tau]
    out += ["", f"ESS of pi_theta/pi_old ({key}) vs tau = {tau:g}"
            + ("" if resyncs else " (reference only: this run does not re-sync on ESS)")]
    if ess:
        lo = min(range(len(ess)), key=ess.__getitem__)
        out.append(f"  min {ess[lo]:.3f} at step {steps[lo]}; first below tau: "
                   f"{('step ' + str(below[0])) if below else 'never'}; below at steps: {_steps_list(below)}")
    if "source" in cfg:  # a dump: the other trainer's syncs are not in it
        out.append("syncs: not recorded in a dump (its staleness in versions is, per step)")
    else:
        synced = [r["step"] for r in train_rows if _num(r.get("sync/synced"))]
        tripped = [r["step"] for r in train_rows if _num(r.get("sync/tripped"))]
        forced = [r["step"] for r in train_rows if _num(r.get("sync/forced"))]
        regen = [r["step"] for r in train_rows if _num(r.get("sync/regenerated"))]
        out.append(f"syncs: {len(synced)} deliveries (at steps {_steps_list(synced)})")
        out.append(f"  re-syncs to current weights on ESS < tau: {_steps_list(tripped)}"
                   + (f" (batch regenerated at {_steps_list(regen)})" if regen else ""))
        if forced:
            out.append(f"  forced by the max interval: {_steps_list(forced)}")
    snaps = series(train_rows, "snapshots/count")[1]
    snap_bytes = series(train_rows, "snapshots/bytes")[1]
    if snaps:
        out.append(f"snapshots kept: max {max(snaps):.0f} versions ({max(snap_bytes) / 2**20:.1f} MiB)")

    # MoE routing and the current-model monitor, when logged.
    route = series(train_rows, "numerical/routing_disagreement/mean")[1]
    if route:
        out.append(f"MoE routing disagreement (token, layer): mean {_mean(route):.2%}, max {max(route):.2%}")
    r_steps, k3_off = series(train_rows, "numerical/replay_off/k3_kl/mean")
    if r_steps:  # routing replay r3: the numerical k3 with and without it, same batches
        on = dict(zip(*series(train_rows, "numerical/k3_kl/mean")))
        out.append(f"routing replay (r3), steps {_steps_list(r_steps)}: numerical k3 KL "
                   f"{_fmt(_mean([on[s] for s in r_steps]))} replayed, "
                   f"{_fmt(_mean(k3_off))} without replay (mean)")
    m_steps, m_k3 = series(train_rows, "monitor/k3_kl/mean")
    if m_steps:
        share = series(train_rows, "monitor/kl_share/rare")[1]
        out.append(f"monitor (pi_theta's own samples scored by the generator), steps {_steps_list(m_steps)}:")
        out.append(f"  k3 KL {_fmt(m_k3[0])} -> {_fmt(m_k3[-1])} (max {_fmt(max(m_k3))}); share on rare "
                   f"tokens {share[0]:.1%} -> {share[-1]:.1%} (max {max(share):.1%})")

    # Whether either cause is material, and the correction `tether probe` would give.
    advice = _advice(train_rows, cfg, why=True)
    if advice is not None:
        out += ["", "by cause, over the run (thresholds: docs/probe.md):", advice]
    return "\n".join(out)


def _advice(rows: list[dict[str, Any]], cfg: dict[str, Any], why: bool) -> str | None:
    """The advice for the run's causes, and under train.correction=auto what auto chose."""
    advice, chose = advise_run(rows, cfg, why), format_timeline(rows)
    if chose is None:
        return advice
    if advice is None:
        return chose
    # The run-wide advice is what one fixed choice for the whole run would be.
    advice = "\n".join(f"advice for a fixed choice over the whole run: {line[8:]}"
                       if line.startswith("advice: ") else line for line in advice.splitlines())
    return f"{advice}\n{chose}"


def dominance(k3: dict[str, float]) -> str:
    """Which cause's mean k3 is larger, by how much, and which one is float rounding."""
    top = max(k3, key=k3.get)
    low = min(k3, key=k3.get)
    if k3[top] < ROUNDING_K3:
        return f"both causes at float rounding (k3 {k3[top]:.1e} and {k3[low]:.1e})"
    if k3[low] < ROUNDING_K3:
        return f"{top} dominates; {low} is float rounding (k3 {k3[low]:.1e})"
    return f"{top} dominates ({k3[top] / k3[low]:.2g}x the other cause's mean k3)"


def plot(rows: list[dict[str, Any]], cfg: dict[str, Any], out_dir: Path,
         tau: float | None = None) -> list[Path]:
    """Write the PNG plots into `out_dir`; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tau, resyncs = threshold(cfg, tau)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_rows = training_rows(rows)
    synced = [r["step"] for r in train_rows if _num(r.get("sync/synced"))]
    tripped = [r["step"] for r in train_rows if _num(r.get("sync/tripped"))]
    auto = " (correction auto)" if cfg.get("train", {}).get("correction") == "auto" else ""
    title = (f"{cfg.get('train', {}).get('estimator', '?')}{auto}, generator "
             f"{cfg.get('rollout', {}).get('precision', '?')}, sync {cfg.get('sync', {}).get('policy', '?')}"
             f", lag {cfg.get('sync', {}).get('lag', 0)}")
    paths = []

    def mark_syncs(ax) -> None:
        for i, s in enumerate(synced):
            ax.axvline(s, color="tab:green", lw=0.8, alpha=0.35,
                       label="generator received weights" if i == 0 else None)
        for i, s in enumerate(tripped):
            ax.axvline(s, color="tab:red", lw=1.2, ls="--",
                       label="ESS re-sync (tripped)" if i == 0 else None)

    def save(fig, name: str) -> None:
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    # 1. The decomposition: k3 KL and max |log-ratio| per cause; under train.correction=auto,
    #    the choice in force per cause below them.
    chose = any("auto/numerical" in r for r in train_rows)
    fig, axes = plt.subplots(3 if chose else 2, 1, figsize=(9, 9 if chose else 7), sharex=True,
                             height_ratios=[2, 2, 1] if chose else None)
    for metric, ax, label in (("k3_kl/mean", axes[0], "k3 KL per token"),
                              ("abs_log_ratio/max", axes[1], "max |log-ratio|")):
        for cause, color in CAUSE_COLORS.items():
            s, v = series(train_rows, f"{cause}/{metric}")
            if s:
                ax.plot(s, [max(x, 1e-12) for x in v], color=color, marker=".", label=cause,
                        ls="--" if cause == "total" else "-")
        ax.set_yscale("log")
        ax.set_ylabel(label + " (log; 0 drawn at 1e-12)")
        mark_syncs(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best", framealpha=0.85)
    axes[0].set_title(f"Mismatch by cause: numerical (pi_old vs mu), staleness (pi_theta vs pi_old)\n{title}")
    if chose:
        _plot_choices(axes[2], train_rows)
    axes[-1].set_xlabel("step")
    save(fig, "decomposition.png")

    # 2. ESS against the threshold, with syncs and the trained batches' staleness.
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[2, 1])
    ax = axes[0]
    for cause, color in CAUSE_COLORS.items():
        s, v = series(train_rows, f"{cause}/ess/token")
        if s:
            ax.plot(s, v, color=color, marker=".", label=f"{cause} ESS (token)")
    s, v = series(train_rows, "sync/ess/token")
    if s:
        ax.plot(s, v, color="black", marker="x", ls="none", label="ESS measured for the sync policy")
    ax.axhline(tau, color="tab:red", lw=1, label=f"tau = {tau:g}" + ("" if resyncs else " (reference)"))
    mark_syncs(ax)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("normalised ESS")
    ax.set_title(f"Effective sample size and re-syncs\n{title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.85)
    ax = axes[1]
    s, v = series(train_rows, "staleness/versions/batch")
    if s:
        ax.step(s, v, where="mid", color="tab:orange", label="batch staleness")
    s, v = series(train_rows, "snapshots/count")
    if s:
        ax.plot(s, v, color="tab:purple", ls=":", label="snapshots kept")
    ax.set_ylabel("weight versions")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    save(fig, "ess_sync.png")

    # 3. Reward and held-out accuracy; the monitor when logged.
    m_steps, m_k3 = series(train_rows, "monitor/k3_kl/mean")
    fig, axes = plt.subplots(2 if m_steps else 1, 1, figsize=(9, 7 if m_steps else 4), sharex=True,
                             squeeze=False)
    ax = axes[0][0]
    s, v = series(train_rows, "reward/mean")
    ax.plot(s, v, color="tab:blue", marker=".", label="reward/mean (generator-side batch reward)")
    s, v = series(rows, "eval/accuracy")
    if s:
        ax.plot(s, v, color="tab:green", marker="o", label="eval/accuracy (greedy, held out)")
    s, v = series(rows, "eval/accuracy_sampled")
    if s:
        ax.plot(s, v, color="tab:olive", marker="^", ls=":", label="eval/accuracy_sampled (held out)")
    s, v = series(rows, "eval/reward_sampled")
    if s:
        ax.plot(s, v, color="tab:cyan", marker="v", ls=":",
                label="eval/reward_sampled (held out, trainer-side)")
    mark_syncs(ax)
    ax.set_ylabel("reward / accuracy")
    ax.set_title(f"Learning\n{title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.85)
    if m_steps:
        ax = axes[1][0]
        ax.plot(m_steps, m_k3, color="tab:brown", marker="o", label="k3 KL(pi_theta || generator)")
        ax.set_ylabel("KL on pi_theta's samples")
        ax2 = ax.twinx()
        s, v = series(train_rows, "monitor/kl_share/rare")
        rare = cfg.get("diagnostics", {}).get("rare_prob", 0.05)
        ax2.plot(s, v, color="tab:pink", marker="s", ls="--",
                 label=f"share of it on tokens the generator gives p < {rare:g}")
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("share of KL on rare tokens")
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    save(fig, "learning.png")
    return paths


def _plot_choices(ax: Any, rows: list[dict[str, Any]]) -> None:
    """train.correction=auto's choice per cause and step, as step lines on named levels."""
    s, num = series(rows, "auto/numerical")
    ax.step(s, num, where="mid", color=CAUSE_COLORS["numerical"], label="numerical correction")
    s, stale = series(rows, "auto/staleness")
    ax.step(s, [len(NUMERICAL) + v for v in stale], where="mid", color=CAUSE_COLORS["staleness"],
            label="staleness handling")
    ax.set_yticks(range(len(NUMERICAL) + len(STALENESS)), [*NUMERICAL, *STALENESS])
    ax.set_ylabel("auto's choice")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.85)


def run_advice(run_dir: str | Path) -> str | None:
    """The split by cause and the advice for a finished run, without the reasons (the end of
    `tether train`; `tether inspect` gives them)."""
    rows, cfg = load_run(run_dir)
    return _advice(training_rows(rows), cfg, why=False)


def inspect_run(run_dir: str | Path, out_dir: str | Path | None = None, plots: bool = True,
                tau: float | None = None, windows: int = 5) -> tuple[str, list[Path]]:
    """The summary text and the written plot paths (RUN_DIR/plots, or DUMP-plots beside a
    dump file, unless `out_dir`)."""
    rows, cfg = load_run(run_dir)
    text = summarize(rows, cfg, tau, windows)
    run_dir = Path(run_dir)
    default = run_dir / "plots" if run_dir.is_dir() else run_dir.with_name(f"{run_dir.stem}-plots")
    paths = plot(rows, cfg, Path(out_dir or default), tau) if plots else []
    return text, paths
