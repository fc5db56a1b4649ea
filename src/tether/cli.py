"""The `tether` command: train, config, init-model, estimators, probe, inspect, experiment, report.

Errors a user can fix (bad config, bad data, wrong model directory: tether.errors.InputError)
print one message and exit with status 2, without a Python traceback (TETHER_DEBUG=1 shows
it). Any other exception is a bug in tether: its traceback is printed, with a request to
report it, and the status is 1. A run stopped by its guard after `train.max_bad_steps`
bad steps in a row exits with 3; one stopped by SIGINT/SIGTERM finishes its step,
checkpoints and exits with 128 + signal.
A run whose data-parallel trainer rank died exits with 4, after a checkpoint
(docs/distributed.md). A fault of the machine or the cluster (a run directory that cannot
be written, a full disk, a Ray address that does not answer, a rank or actor that never
starts: tether.errors.EnvironmentFault) prints one line and exits with 5. The statuses:
docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from tether import __version__
from tether.config import ConfigError, dump_config, format_fields, load_config
from tether.errors import (
    EnvironmentFault,
    InputError,
    RankFailed,
    StopRequested,
    TooManyBadSteps,
    environment_fault,
)

TRAIN_HELP = """\
Train with RL: generate, score old log-probs, compute the loss, step, sync.

Settings come from a YAML file (--config) and/or dotted key=value overrides, e.g.
  tether train --config configs/countdown.yaml train.lr=5e-4 rollout.precision=fp8

Sections: model (which model; default is tether's own tiny Qwen3), task (countdown,
numeric, or your own class as task.name=pkg.module:Class; docs/tasks.md), reward (your
own reward function, optional), rollout (engine, generator precision, sampling), train
(steps, optimizer, estimator; MoE routing replay train.routing_replay=none|r2|r3,
docs/mismatch.md; data-parallel ranks train.world_size, sharded with train.sharding=fsdp,
on several machines under torchrun, docs/distributed.md; bf16 autocast
train.precision=bf16, docs/performance.md), sync (when the generator gets new weights),
loop (loop.mode=async: rollout workers generate while the trainer trains, loop.workers,
loop.max_staleness, loop.window=ess (the ESS governs the staleness window),
loop.partial, docs/async.md; loop.backend=ray), eval, run (directory,
seed, run.device=auto|cpu|cuda[:N]). `~key` drops a key the file set.
Before a run, `tether probe` (same config) measures the generator/trainer mismatch and
recommends an estimator and sync policy.
`tether config --fields` lists every key with its default and meaning;
`tether config --config FILE [key=value ...]` prints the resolved config.
Writes RUN_DIR/config.yaml, RUN_DIR/metrics.jsonl (one row per step), checkpoints in
RUN_DIR/checkpoints (run.checkpoint_every) and RUN_DIR/final (the trained model in
Hugging Face safetensors format). Prints held-out accuracy before and after, then the
disagreement split by cause and whether either needs a correction (`tether inspect` says why).

  tether train --resume RUN_DIR [train.steps=N ...]
continues a stopped run from its last checkpoint with the config in RUN_DIR/config.yaml;
only keys that do not change the trajectory may be overridden (e.g. train.steps to
extend it). SIGINT/SIGTERM stop a run after the current step, with a checkpoint.
Exit status: 0 done, 2 bad input, 3 bad steps, 4 a trainer rank died, 5 a fault of the
machine or cluster (unwritable or full run.dir, a Ray address or actor or trainer rank that
does not answer within run.start_timeout), 128+signal stopped; docs/reliability.md."""


def _request_stop(signum: int, frame: object) -> None:
    from tether.guards import STOP

    STOP.request(signum)
    signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once
    print(f"\ntether: {signal.Signals(signum).name}: stopping after this step with a "
          f"checkpoint (send it again to stop now)", file=sys.stderr)


def _cmd_train(args: argparse.Namespace) -> int:
    from tether.checkpoint import resume_config
    from tether.distributed import follow, launched
    from tether.guards import STOP
    from tether.inspection import run_advice
    from tether.loops import train

    if args.resume:
        if args.config:
            raise ConfigError("--resume takes the config from RUN_DIR/config.yaml; drop --config")
        cfg = resume_config(args.resume, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    if (where := launched()) is not None:  # torchrun started this process: one trainer rank
        if where[1] != cfg.train.world_size:
            raise ConfigError(f"train.world_size={cfg.train.world_size}, and torchrun started "
                              f"{where[1]} processes (--nnodes x --nproc-per-node): make them equal")
        if where[0] > 0:  # rank 0 runs the loop; the others serve it (docs/distributed.md)
            follow(cfg)
            return 0
    previous = {s: signal.signal(s, _request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = train(cfg, resume=bool(args.resume))
    finally:  # main() may run in-process (tests): leave the handlers as they were
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        STOP.clear()
    print(f"run directory: {result.run_dir}")
    print(f"held-out accuracy, greedy:  before {result.accuracy_before:.3f} -> "
          f"after {result.accuracy_after:.3f}")
    if result.sampled_before is not None:
        print(f"held-out accuracy, sampled: before {result.sampled_before:.3f} -> "
              f"after {result.sampled_after:.3f}  (rollout temperature, eval.samples per problem)")
    advice = run_advice(result.run_dir)
    if advice:
        print(f"generator/trainer disagreement by cause (tether inspect {result.run_dir}):")
        print(advice)
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.fields:
        print(format_fields(), end="")
        return 0
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from tether.setup import resolve_model_path

    print(resolve_model_path(load_config(args.config, args.overrides)))
    return 0


INSPECT_HELP = """\
Summarise a run: which cause of the generator/trainer disagreement dominates over time
(numerical: pi_old vs mu; staleness: pi_theta vs pi_old; k3 KL by window), when the
staleness ESS fell below the re-sync threshold, when the generator received weights,
snapshot memory, MoE routing disagreement and the current-model monitor when logged; ends
with each cause's verdict over the run (float rounding, negligible or material:
docs/probe.md) and the advice `tether probe` would give: "nothing to correct" unless a cause
is material.
Writes RUN_DIR/plots/decomposition.png, ess_sync.png and learning.png (or into --out).
RUN_DIR may also be a log-prob dump from another trainer (JSONL: per token mu, pi_old,
pi_theta; the TRL plug-in and log.dump_logprobs=true write one; docs/integrations.md):
the same summary, from the split of each step's batch, plots in DUMP-plots/.
Metric names and formulas: docs/metrics.md."""


def _cmd_inspect(args: argparse.Namespace) -> int:
    from tether.inspection import inspect_run

    text, paths = inspect_run(args.run_dir, args.out, plots=not args.no_plots, tau=args.tau,
                              windows=args.windows)
    print(text)
    for path in paths:
        print(f"plot: {path}")
    return 0


PROBE_HELP = """\
Measure, with the run's model, engine, generator precision and sampling, how the generator
and the trainer disagree, before spending a run on it:
  numerical   same weights, different numerics: k1/k3 KL of pi_old vs mu, max |log rho|,
              share of tokens with rho outside [1/2, 2] and outside the trainer's top-k/top-p
              support; eps = logit pi_old - logit mu per confidence bin (MAD, q05, q95) beside
              CIS's Appendix A; MoE routing disagreement (hf engine)
  staleness   when the config makes any (sync.lag + train.minibatches - 1, or async
              loop.max_staleness): that many optimizer steps at train.lr on fresh batches
              while the engine keeps its weights, then the token ESS and k3 of pi_theta/pi_old
Ends with each cause's verdict (float rounding, negligible or material, against the
thresholds of docs/probe.md) and the advice: "nothing to correct" (keep your estimator and
sync policy) unless a cause is material, else the correction DLC's guidance gives for it (a
preset and a sync policy, as key=value overrides) and why. Nothing is written; about 5-35 s
on the tiny model. docs/probe.md explains every figure and rule."""


def _cmd_probe(args: argparse.Namespace) -> int:
    import json

    from tether.probe import probe

    result = probe(load_config(args.config, args.overrides), batches=args.batches)
    print(json.dumps(result.to_json(), indent=2) if args.json else result.format())
    return 0


EXPERIMENT_HELP = """\
Run one of the papers' experiments on the embedded testbed (DESIGN.md section 7):
  dlc    dense model, lr 2e-4: generator {exact, fp8, lag 32, fp8 + lag 32} x {naive,
         reweight, tis, tis + ESS re-sync, dlc without re-sync, dlc}, the controls under
         lag 32 (reweight capped at 5 and uncapped, dlc re-synced on a matched schedule,
         staleness IS + ESS re-sync without centering) and fp8 in the async loop (eta 32) x
         {naive, dlc, dlc with the ESS window}, x 3 seeds (identical cells skipped; the
         reference exact x naive: 5 seeds)
  cis    MoE model: generator {inj (bf16 + router noise + INJECTED heavy-tailed logit noise,
         sized to CIS's Appendix A) x {none, tis, cis}, inj + outlier positions x {tis,
         cis}}; CIS's recipe (inj, 2 versions stale) x {decoupled, decoupled_cis}; 3 seeds;
         fp32 reference x 5 seeds
  vespo  staleness N = 64 (a rollout batch of 64 optimizer mini-batches of 16 x 8; 128
         optimizer steps) x {grpo, gspo, sapo, vespo, vespo /T, vespo /sqrtT} x 3 seeds,
         against N = 1 (grpo x 5 seeds, sapo x 3: on-policy the six are two gradients);
         Countdown answers written as steps (4 numbers), dense model
  auto   dense model, lr 2e-4: train.correction=auto against the fixed presets {naive, tis,
         cis, dlc} in 5 scenarios: exact (nothing material), fp8 + lag 32 (staleness), fp32
         + heavy-tailed logit noise (numerical), fp8 + lag 32 from step 30 (a cause that
         starts mid-run), fp8 in the async loop (eta 32); 3 seeds, reference exact x naive 5
Groups cut from dlc's default matrix to fit the hour still run when --only names them
(fp8:dlc, lag32:dlc_clip, fp8_async32:dlc_window). Default matrix, measured with --workers 2
on this project's 2-core machine, nothing else running (RESULTS.md): dlc 57 min for its 65
cells, cis 32 min for 26 cells, vespo 50 min for 26 cells. An empty model cache first builds
the warm start (dlc 900 steps, vespo 1200 steps of the steps task, cis the MoE's 200: about
5, 10 and 2.5 min on 2 cores).
Each cell is one training run in OUT/cells/<scenario>__<method>__s<seed>, run in parallel
worker processes (one torch thread each). Rerunning the same command skips finished cells
and resumes interrupted ones. Ctrl-C or SIGTERM ends every running cell with the processes
it started (exit 130/143); a cell whose parent was killed ends itself within a second.
Writes OUT/summary.csv (one row per scenario x method), OUT/cells.csv, OUT/summary.json;
`tether report OUT` builds the HTML page and plots. More seeds for a question: --seeds N
with --only its groups (cells run seed by seed, so contrasts stay paired), and --record
results/NAME to keep them in a committed record that later runs extend.
Definitions of every number: docs/experiments.md."""

REPORT_HELP = """\
Build the report of an experiment directory written by `tether experiment`: PNG figures,
a self-contained HTML page (figures embedded) and a markdown summary with the tables, all
in DIR/report/ (index.html, summary.md, *.png). DIR may be a committed record (`tether
experiment --record`, e.g. results/dlc-power): it is restored into runs/records/<its name>
first, and the report is written there."""


def _stop_experiment(signum: int, frame: object) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):  # ending the cells must not be interrupted
        signal.signal(s, signal.SIG_IGN)
    raise StopRequested(f"stopped by {signal.Signals(signum).name}; the running cells were "
                        "ended; rerun the same command to resume", signum)


def _cmd_experiment(args: argparse.Namespace) -> int:
    from tether.experiments import run

    only = [g for g in (args.only or "").split(",") if g]
    previous = {s: signal.signal(s, _stop_experiment) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # the runner ends its cells on the way out (tether.experiments.runner)
        run(args.name, args.out, quick=args.quick, seeds=args.seeds, workers=args.workers,
            model_path=args.model, only=only or None, overrides=args.set, keep=args.record)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from tether.experiments import record, record_tables
    from tether.report import build_report

    out, summary = args.dir, None
    if record.is_record(out):  # a committed record: its cells unpacked where a report can live
        out = record.unpacked(out)
        summary = record_tables(args.dir, out)  # the report reads this summary: one pass, not two
        print(f"record {args.dir} restored into {out}; its tables rewritten: {args.dir}/{record.TABLES}")
    html_path, md_path, figures = build_report(out, summary=summary)
    print(f"report: {html_path}")
    print(f"summary: {md_path}")
    for path in figures:
        print(f"plot: {path}")
    return 0


def _cmd_estimators(args: argparse.Namespace) -> int:
    from tether.estimators import format_presets_table

    print(format_presets_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="RL for LLMs that stays stable when the generator and the trainer disagree.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="FILE", help="YAML config file (optional).")
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help="Dotted overrides applied after the file, e.g. train.lr=3e-4.")

    p = sub.add_parser("train", help="Run RL training.", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    with_config(p)
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="Continue the run in RUN_DIR from its last checkpoint.")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("config", help="Print the resolved config (or every key with --fields).",
                       description="Validate a config and print it resolved, as YAML.")
    with_config(p)
    p.add_argument("--fields", action="store_true", help="List every key, its default and meaning.")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "init-model", help="Build and warm-start tether's tiny model (cached); print its path.",
        description="Build tether's tiny Qwen3 (model.moe=true: Qwen3-MoE) with a character "
        "tokenizer and warm-start it by supervised training on synthetic Countdown solutions. "
        "Deterministic for model.seed; cached under model.cache_dir.")
    with_config(p)
    p.set_defaults(func=_cmd_init_model)

    p = sub.add_parser("estimators", help="List the loss presets with formula and source.")
    p.set_defaults(func=_cmd_estimators)

    p = sub.add_parser(
        "inspect", help="Summarise a run's mismatch decomposition over time; write PNG plots.",
        description=INSPECT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="A run directory (holds metrics.jsonl), or a log-prob dump (.jsonl).")
    p.add_argument("--out", metavar="DIR", help="Where to write the plots (default RUN_DIR/plots).")
    p.add_argument("--no-plots", action="store_true", help="Print the summary only.")
    p.add_argument("--tau", type=float, metavar="TAU",
                   help="ESS threshold to report crossings of (default: the run's ess:TAU, else 0.5).")
    p.add_argument("--windows", type=int, default=5, metavar="N",
                   help="Split the run into N windows for the per-cause table (default 5).")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser(
        "probe", help="Measure the generator/trainer mismatch before training; recommend a correction.",
        description=PROBE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    with_config(p)
    p.add_argument("--batches", type=int, default=2, metavar="N",
                   help="Rollout batches (rollout.prompts_per_step x rollout.group_size) sampled "
                   "at equal weights for the numerical figures (default 2).")
    p.add_argument("--json", action="store_true", help="Print the result as one JSON object.")
    p.set_defaults(func=_cmd_probe)

    p = sub.add_parser(
        "experiment", help="Run an experiment matrix (dlc, cis, vespo, auto); resumable.",
        description=EXPERIMENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", choices=["dlc", "cis", "vespo", "auto"], help="Which experiment.")
    p.add_argument("--quick", action="store_true",
                   help="A reduced matrix (1 seed, 2 settings x 2 methods, a few small steps, "
                   "a lightly warm-started model): a smoke test. Measured on 2 cores: dlc 1 min "
                   "44 s with an empty model cache (its warm start is built first), 53 s once "
                   "cached; cis 49 s / 39 s; vespo 55 s / 35 s.")
    p.add_argument("--out", metavar="DIR",
                   help="Experiment directory (default runs/experiments/NAME[-quick]); rerun "
                   "with the same DIR to resume.")
    p.add_argument("--seeds", type=int, metavar="N",
                   help="Seeds per scenario x method (default: 3 for each experiment; quick 1).")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="Cells run in parallel, each in its own process with one torch "
                   "thread (default 2; at most the number of free cores).")
    p.add_argument("--model", metavar="PATH",
                   help="Start every cell from this model directory instead of the default "
                   "tiny model (built and cached on first use).")
    p.add_argument("--only", metavar="S:M,...",
                   help="Run only these scenario:method groups, e.g. lag32:naive,lag32:dlc "
                   "(the on-policy reference group is always included); it may name groups cut "
                   "from the default matrix, e.g. lag32:dlc_clip. Into an existing --out, the "
                   "slice runs its own cells and adds them to what is there (an earlier "
                   "slice's cells are reported, not run).")
    p.add_argument("--record", metavar="DIR",
                   help="A committed record of finished cells (e.g. results/dlc-power): restored "
                   "into --out first, so only the cells it lacks run, from the record's own "
                   "starting model; the cells finished here are added to it after, also when "
                   "stopped. `tether report DIR` reads it directly.")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="Change the settings every cell shares, e.g. --set train.lr=2e-4 "
                   "train.steps=60 (as `tether train` overrides; each cell's scenario and method "
                   "keys still apply on top). Use a new --out: a directory keeps one setting.")
    p.set_defaults(func=_cmd_experiment)

    p = sub.add_parser("report", help="Build figures, an HTML page and a markdown summary of an "
                       "experiment directory.", description=REPORT_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="A directory written by `tether experiment`, or a "
                   "committed record of one (results/...).")
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("train", "probe", "init-model", "experiment"):
        import transformers

        transformers.utils.logging.disable_progress_bar()  # tether's own bar; none per load
    try:
        return args.func(args)
    except InputError as e:
        if os.environ.get("TETHER_DEBUG"):
            raise
        print(f"tether {args.command}: error: {e}", file=sys.stderr)
        return 2
    except TooManyBadSteps as e:
        print(f"tether {args.command}: {e}", file=sys.stderr)
        return 3
    except StopRequested as e:
        print(f"tether {args.command}: {e}", file=sys.stderr)
        return 128 + e.signum
    except RankFailed as e:
        print(f"tether {args.command}: {e}", file=sys.stderr)
        return 4
    except EnvironmentFault as e:
        return _environment(args.command, e)
    except Exception as e:  # noqa: BLE001 -- not the user's input: a bug, shown in full
        if fault := environment_fault(e):  # a full disk, a read-only or forbidden path
            return _environment(args.command, fault)
        traceback.print_exc()
        print(f"tether {args.command}: this is a bug in tether, please report it with the "
              f"traceback above (tether {__version__}, Python {sys.version.split()[0]})",
              file=sys.stderr)
        return 1


def _environment(command: str, fault: EnvironmentFault) -> int:
    if os.environ.get("TETHER_DEBUG"):
        traceback.print_exc()
    print(f"tether {command}: environment: {fault}", file=sys.stderr)
    return 5


if __name__ == "__main__":
    sys.exit(main())
