"""E-VESPO over more rollout batches: does staleness that lasts collapse what 2 batches did not?

    .venv/bin/python scripts/vespo-longer.py OPT_STEPS GROUP [GROUP ...]
    .venv/bin/python scripts/vespo-longer.py 256 N64:sapo N64:vespo N64:vespo_T   (48 min, 10 cells)

The default matrix (experiments/vespo.py) gives every N 128 optimizer steps: at N = 64 that
is 2 rollout batches, and what falls at step 64 recovers by step 128 (RESULTS.md). This runs
the same protocol with OPT_STEPS optimizer steps (OPT_STEPS / 64 rollout batches at N = 64),
a trainer-side evaluation every 64 of them, for the groups given, 3 seeds each, plus one
seed of the N = 1 grpo reference (it anchors `vs_n1`; five would cost as much as the rest).
Output: runs/experiments/vespo-steps<OPT_STEPS>; `tether report DIR` draws it.
"""

import argparse

from tether.experiments import analysis, run_experiment, vespo


def main(opt_steps: int, groups: set[tuple[str, str]]) -> None:
    vespo.OPT_STEPS = opt_steps  # build() reads the protocol's constants when it runs
    exp = vespo.build()
    exp.cells = [c for c in exp.cells if (c.scenario, c.method) in groups
                 or ((c.scenario, c.method), c.seed) == (exp.reference, 0)]
    out = f"runs/experiments/vespo-steps{opt_steps}"
    print(run_experiment(exp, out))
    analysis.summarize(out, extend=vespo.extend)


if __name__ == "__main__":  # the runner spawns a process per cell, which imports this file
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("opt_steps", type=int, metavar="OPT_STEPS", help="optimizer steps per cell")
    p.add_argument("groups", nargs="+", metavar="GROUP",
                   help="scenario:method cells to run, e.g. N64:sapo (3 seeds each)")
    args = p.parse_args()
    main(args.opt_steps, {tuple(g.split(":", 1)) for g in args.groups})
