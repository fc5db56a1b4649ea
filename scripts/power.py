"""How many paired seeds a contrast needs, from the cells an experiment directory already holds.

    .venv/bin/python scripts/power.py runs/experiments/auto
    .venv/bin/python scripts/power.py results/dlc-power --pairs lag32:dlc:stale_is_ess lag32:dlc:exact/naive

For each pair of groups (every two methods of a scenario, or the `--pairs` named, where a
side written `scenario/method` may come from another scenario, e.g. the reference), on the
seeds both finished: the per-seed difference of the last-3 trainer-side means, its sd (the
paired sigma), the mean (the effect observed), and the seeds a 95% interval needs to exclude
0 at that effect and to be +-0.01 wide (tether.experiments.verdicts: ceil((1.96 sd / h)^2),
a normal approximation). A record (results/...) is unpacked into runs/records/ first. Issue
73 sized its runs with this before running them (RESULTS.md, "The power table").
"""

import argparse
import itertools

import numpy as np

from tether.experiments import analysis, record
from tether.experiments.verdicts import paired, power


def side(scenario: str, name: str) -> tuple[str, str]:
    return tuple(name.split("/", 1)) if "/" in name else (scenario, name)


def main(args: argparse.Namespace) -> None:
    out = record.unpacked(args.dir) if record.is_record(args.dir) else args.dir
    summary = analysis.summarize(out)
    groups = list(dict.fromkeys((c["scenario"], c["method"]) for c in summary["cells"].values()))
    if args.pairs:
        pairs = [(side(s, a), side(s, b)) for s, a, b in (p.split(":") for p in args.pairs)]
    else:
        pairs = [(a, b) for a, b in itertools.combinations(groups, 2) if a[0] == b[0]]
    print(f"reference {'/'.join(summary['reference'])}: last-3 sigma {summary['reference_last3_sigma']:.4f}")
    print("| a | b | seeds | paired σ | a − b | seeds to decide | seeds to ±0.01 |")
    print("|---|---|---|---|---|---|---|")
    for a, b in pairs:
        x, y = paired(summary, a, b)
        pw = power(x - y)
        effect = float(np.mean(x - y)) if len(x) else float("nan")
        print(f"| {'/'.join(a)} | {'/'.join(b)} | {pw['seeds_run']} | {pw['sd_paired']:.4f} | {effect:+.4f} "
              f"| {pw['needs_zero'] or '-'} | {pw['needs_half'] or '-'} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="an experiment directory, or a committed record of one")
    ap.add_argument("--pairs", nargs="+", metavar="S:A:B",
                    help="only these contrasts, each scenario:a:b; a side may be scenario/method")
    main(ap.parse_args())
