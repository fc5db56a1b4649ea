"""What train.correction=auto costs where nothing is material, side by side in one run.

    python benchmarks/auto.py                       # the demo model, 3 rounds of 20 steps
    python benchmarks/auto.py --rounds 5 --steps 30 --json out.json

E-AUTO's scenario 1: an fp32 generator, lag 0 (the synchronous loop, configs/countdown.yaml's
model and work). Three runs of the same work, one after another in each round so a drift
of the machine hits each alike:
- `grpo`: the fixed preset, sync.policy every:1;
- `auto`: grpo's objective with train.correction=auto (it must choose nothing: no correction,
  no re-sync, no top-K from the engine);
- `dlc`: the fixed preset with its ess:0.5 re-sync (it centers over the engine's top-K every
  step; at lag 0 the re-sync never trips): what the full correction costs here.

samples/s = samples per step / the median `time/step` over every round's steps 2..N (step 1
warms up). The ratios are each run's samples/s over grpo's; the per-round ratios show their
spread. One torch thread, as the experiments' cells run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from harness import COUNTDOWN, device_name, train_run, use_threads

RUNS = {"grpo": ["train.estimator=grpo", "sync.policy=every:1"],
        "auto": ["train.estimator=grpo", "train.correction=auto", "sync.policy=every:1"],
        "dlc": ["train.estimator=dlc", "sync.policy=ess:0.5"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="Rounds, each running every case once.")
    ap.add_argument("--steps", type=int, default=20, help="Training steps per run.")
    ap.add_argument("--json", metavar="PATH", help="Also write the figures as JSON here.")
    args = ap.parse_args()
    threads = use_threads(1)
    base = [threads, f"train.steps={args.steps}", "rollout.precision=fp32", "sync.lag=0",
            "eval.every=0", "run.progress=false", "run.checkpoint_every=0",
            "diagnostics.monitor_every=0"]
    steps: dict[str, list[float]] = {name: [] for name in RUNS}
    rounds: list[dict[str, float]] = []
    checks: dict[str, dict[str, float]] = {}
    batch = 0
    for r in range(args.rounds):
        medians = {}
        for name, keys in RUNS.items():
            run = train_run([*base, *keys, f"run.seed={r}"], config=COUNTDOWN)
            batch = run.cfg.rollout.prompts_per_step * run.cfg.rollout.group_size
            times = [row["time/step"] for row in run.rows[2:]]  # row 0: step 0's eval; step 1 warms up
            steps[name] += times
            medians[name] = statistics.median(times)
            train_rows = run.rows[1:]
            checks[name] = {  # what each run did besides training
                "corrected_steps": sum(row.get("auto/numerical", 0) > 0 for row in train_rows),
                "resync_steps": sum(row.get("auto/staleness", 0) > 0 for row in train_rows),
                "topk_steps": sum(row.get("auto/topk", 0) > 0 for row in train_rows),
                "resyncs": sum(row.get("sync/tripped", 0) for row in train_rows)}
        rounds.append({name: medians["grpo"] / m for name, m in medians.items()})
        print(f"round {r + 1}: " + ", ".join(f"{n} {batch / m:.1f} samples/s" for n, m in
                                              medians.items()), file=sys.stderr, flush=True)
    rate = {name: batch / statistics.median(t) for name, t in steps.items()}
    out = {"device": device_name(), "rounds": args.rounds, "steps": args.steps, "batch": batch,
           "samples_per_s": rate, "ratio_to_grpo": {n: rate[n] / rate["grpo"] for n in rate},
           "round_ratios": rounds, "checks": checks}
    print(f"train.correction=auto where nothing is material ({device_name()}, 1 thread; "
          f"{args.rounds} rounds x {args.steps} steps, {batch} samples a step)")
    print(f"{'run':<6} {'samples/s':>10} {'x grpo':>8}  per round        corrected/re-sync/top-K steps")
    for name in RUNS:
        per_round = ", ".join(f"{r[name]:.3f}" for r in rounds)
        c = checks[name]
        print(f"{name:<6} {rate[name]:>10.1f} {out['ratio_to_grpo'][name]:>8.3f}  {per_round:<16} "
              f"{c['corrected_steps']}/{c['resync_steps']}/{c['topk_steps']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
