"""E-VESPO's long N sweep (issue 30): every N, many optimizer steps, a fine evaluation cadence.

    .venv/bin/python scripts/vespo_sweep.py --plan                 (the cells, nothing run)
    .venv/bin/python scripts/vespo_sweep.py --out runs/experiments/vespo-sweep
    .venv/bin/python scripts/vespo_sweep.py --task chain --out runs/experiments/vespo-sweep-chain

Its defaults are the protocol of the chosen testbed (`--task`, experiments/vespo.py's SWEEPS;
`--help` lists each one's Ns, optimizer steps and methods): mini-batches of 32 x 8, trainer-side
evaluation every 16 optimizer steps, several seeds per group and more for the N1 x grpo
reference, and the sequence-weight quantiles logged every step. Each flag
replaces one of the protocol's numbers; `--only` keeps some groups (and the reference).
Resumable like every experiment: rerun the same command. With `--record DIR` the finished
cells also accrue in a small committed record (metrics, done.json, probe log-probs, and the
starting model once), which a later run on a fresh machine restores, and trains from, before
it runs the rest. `tether report DIR` draws it,
with the claims' verdicts. Hours of CPU on 2 cores: a command, never a test.
"""

import argparse
from contextlib import nullcontext
from dataclasses import replace

from tether.errors import InputError
from tether.experiments import analysis, record, run_experiment, select, vespo


def task_help() -> str:
    """One line per testbed of vespo.SWEEPS, from its protocol, so the help cannot go stale."""
    lines = []
    for name, p in vespo.SWEEPS.items():
        ns = ", ".join(map(str, p.ns))
        methods = ", ".join(p.methods + p.extra_methods)
        lines.append(f"{name}: N in {{{ns}}}, {p.opt_steps} optimizer steps, {methods}"
                     + ("" if p.race else ", no race"))
    return "testbed, each with its protocol: " + "; ".join(lines)


def main(args: argparse.Namespace) -> None:
    p = vespo.SWEEPS[args.task]
    changes = {"ns": args.ns, "opt_steps": args.opt_steps,
               "eval_every": args.eval_every, "prompts": args.prompts, "lr": args.lr,
               "seeds": args.seeds, "reference_seeds": args.reference_seeds,
               "race_n": args.race_n, "race_eta": args.race_eta}
    p = replace(p, **{k: v for k, v in changes.items() if v is not None})
    if args.no_race:
        p = replace(p, race=False)
    exp = vespo.build(protocol=p)
    if args.only:
        exp.cells = select(exp, args.only)
    if args.plan:
        for c in exp.cells:
            print(c.name, " ".join(c.overrides))
        print(f"{len(exp.cells)} cells; base: {' '.join(exp.base)}")
        return
    # The record's own start, on every machine; a stopped run still records the cells it
    # finished (without their probe log-probs, which the summary caches).
    with record.kept(args.record, args.out) if args.record else nullcontext(None) as model:
        print(run_experiment(exp, args.out, model_path=model))
        analysis.summarize(args.out, extend=vespo.extend)


if __name__ == "__main__":  # the runner spawns a process per cell, which imports this file
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/experiments/vespo-sweep", help="output directory (resumable)")
    ap.add_argument("--task", choices=sorted(vespo.SWEEPS), default="steps", help=task_help())
    ap.add_argument("--ns", type=lambda s: tuple(int(x) for x in s.split(",")),
                    help="comma-separated Ns, e.g. 1,4,64 (1 is the reference's)")
    ap.add_argument("--opt-steps", type=int, help="optimizer steps per cell, for every N")
    ap.add_argument("--eval-every", type=int, help="trainer-side evaluation every this many optimizer steps")
    ap.add_argument("--prompts", type=int, help="prompts per optimizer mini-batch (x 8 samples)")
    ap.add_argument("--lr", type=float, help="learning rate")
    ap.add_argument("--seeds", type=int, help="seeds per group")
    ap.add_argument("--reference-seeds", type=int, help="seeds of the N1 x grpo reference")
    ap.add_argument("--no-race", action="store_true", help="leave out the fp8 asynchronous race")
    ap.add_argument("--race-n", type=int, help=f"the race's N (default {vespo.RACE_N}; at most the largest N)")
    ap.add_argument("--race-eta", type=int,
                    help=f"the race's admission bound eta (default {vespo.RACE_ETA}), in optimizer "
                         "steps: at least the race's N, or only one batch is in flight and nothing "
                         "lags; another names its group apart, e.g. N16_race_eta32")
    ap.add_argument("--only", nargs="+", metavar="GROUP", help="keep these scenario:method groups, e.g. N64:sapo")
    ap.add_argument("--record", metavar="DIR",
                    help="a committed record of finished cells (experiments/record.py): restored "
                         "into --out first, updated after; e.g. results/vespo-sweep")
    ap.add_argument("--plan", action="store_true", help="print the cells and exit")
    try:
        main(ap.parse_args())
    except InputError as e:  # a bad protocol or --out: the message, not a traceback
        ap.error(str(e))
