"""Calibrate `make demo` (or any config): does its run learn above its own noise?

    .venv/bin/python scripts/demo_calibrate.py [--config configs/demo.yaml] [--seeds 5] [--jobs 2] [key=value ...]

Trains the config (configs/demo.yaml unless --config) once per seed (run.seed = 0..seeds-1; the warm start and the
evaluation draws are shared, so step 0 is the same for all), into runs/demo-calibration/,
and prints each seed's sampled held-out accuracy by evaluation step, the mean gain from
step 0 to the last step, the seed-to-seed sigma of the final accuracy, and the verdict on
the bar of issue 34: gain > 2 sigma. Two jobs fill a 2-core machine (about 2 min for 5
seeds here once the model is cached); the overrides go to every run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tether.logger import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
BAR = 2.0  # the gain must exceed this many seed-to-seed sigmas


def run(seed: int, out: Path, config: Path, overrides: list[str]) -> list[tuple[int, float]]:
    """One run of `config`; its (step, eval/accuracy_sampled) pairs."""
    run_dir = out / f"s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a calibration is always run afresh
    cmd = [str(ROOT / ".venv/bin/tether"), "train", "--config", str(config),
           f"run.seed={seed}", f"run.dir={run_dir}", "run.progress=false", *overrides]
    log = out / f"s{seed}.log"
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode:
            sys.exit(f"seed {seed} failed; see {log}")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return [(r["step"], r["eval/accuracy_sampled"]) for r in rows if "eval/accuracy_sampled" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs/demo.yaml",
                   help="the config every run trains (default configs/demo.yaml)")
    p.add_argument("--seeds", type=int, default=5, help="runs, seeds 0..N-1 (default 5; at least 2, for sigma)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: one per core)")
    p.add_argument("--out", type=Path, default=ROOT / "runs/demo-calibration",
                   help="where the runs go (default runs/demo-calibration; replaced)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="passed to every run")
    args = p.parse_args()
    if args.seeds < 2:
        p.error("--seeds must be at least 2: the bar needs the seed-to-seed sigma")
    args.out.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(ROOT / ".venv/bin/tether"), "init-model", "--config",
                    str(args.config), *args.overrides], check=True,
                   stdout=subprocess.DEVNULL)  # build the warm start once, before the runs
    with ThreadPoolExecutor(args.jobs) as pool:
        curves = list(pool.map(lambda s: run(s, args.out, args.config, args.overrides), range(args.seeds)))
    steps = [s for s, _ in curves[0]]
    print("sampled held-out accuracy by step: " + "  ".join(f"{s:>5}" for s in steps))
    for seed, curve in enumerate(curves):
        print(f"  seed {seed}:{' ' * 26}" + "  ".join(f"{a:.3f}" for _, a in curve))
    start, final = curves[0][0][1], [c[-1][1] for c in curves]
    gain, sigma = statistics.mean(final) - start, statistics.stdev(final)
    verdict = "met" if gain > BAR * sigma else "missed"
    print(f"gain {start:.3f} -> {statistics.mean(final):.3f} = {gain:+.3f}; seed-to-seed sigma "
          f"of the final accuracy {sigma:.3f} ({args.seeds} seeds); gain / sigma {gain / sigma:.1f}:"
          f" the bar (gain > {BAR:g} sigma) is {verdict}")


if __name__ == "__main__":
    main()
