"""tether's asynchronous schedule, simulated: samples/s, idle time, staleness and snapshot memory
from phase times, for W rollout workers under the admission rule, at any scale.

    python benchmarks/simulate_async.py --from-run RUN_DIR        # a measured run's own phases
    python benchmarks/simulate_async.py --peer verl-7b-128gpu     # a published peer setup
    python benchmarks/simulate_async.py --generate 10 --train 6 --workers 1,2,4 --eta 1,2,4

The simulator is a discrete-event copy of tether.loops.scheduler's rules, not of its code:
- the trainer admits slots while `V + N * outstanding - published <= window` (AReaL's rule,
  window = eta; N = train.minibatches), trains them in issue order, each advancing the
  version by N, and publishes after every step (`every:1`) or only when the next slot could
  not be admitted otherwise (`lazy`: bounded:K and ess:TAU);
- W workers take issued slots first-come first-served from one queue, each sampling with
  the newest version published when it starts (loading it first if it is new to it);
- a batch's phases: on the worker generate, reward, pi_old (loop.score_old=worker) and a
  weight load; on the trainer pi_old (score_old=trainer), train (collate, loss, step,
  diagnostics, the per-step bookkeeping) and publish (pack and hand over, which blocks it).
Each phase is drawn per batch: from a run's own per-step samples (`--from-run`, resampled)
or lognormal around a given mean with `--cv` spread. samples/s counts, as
benchmarks/async.py does, every batch's samples from the first batch's arrival to the end
of the last step. Snapshot memory is the published versions still kept (those a batch in
flight may have been sampled with) times `--version-gb`.

What it leaves out: the CPU or GPU the two sides share (pass phase times measured with
the sharing, as a run's own are), response-length tails inside a batch (a phase is one
number per batch), drops and ESS trips (the window stays at eta).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

WORKER_PHASES = ("generate", "reward", "old_logprob_worker", "load")
TRAINER_PHASES = ("old_logprob_trainer", "train", "publish")

# Published setups: sync-step phase times (s) and what the source reports for async.
PEERS = {
    "verl-7b-128gpu": {
        "source": "verl docs/advance/fully_async.md (commit b178a3c): Qwen2.5-Math-7B, DAPO, "
                  "512 prompts x 16, 28K max response; colocated sync on 128 H20 vs fully "
                  "async 64 rollout : 64 train, staleness_threshold 0.5, partial rollouts",
        "sync": {"generate": 177.85, "old_logprob": 53.92, "train": 113.81, "other": 10.72},
        "async_measured": {"train": 113.16, "trainer_wait": 33.14, "step": 150.63},
        "published_speedup": 2.35, "published_speedup_100_steps": 2.67, "batch": 512 * 16,
    },
}


@dataclass
class Phases:
    """Per-batch phase times: each a list of samples to draw from (one value: fixed)."""

    values: dict[str, list[float]] = field(default_factory=dict)
    cv: float = 0.0  # lognormal spread around a single given value

    def draw(self, name: str, rng: random.Random) -> float:
        xs = self.values.get(name, [0.0])
        if len(xs) > 1:
            return rng.choice(xs)
        if self.cv <= 0 or xs[0] <= 0:
            return xs[0]
        s = math.sqrt(math.log(1 + self.cv ** 2))
        return xs[0] * math.exp(rng.gauss(-s * s / 2, s))


def simulate(phases: Phases, workers: int, eta: int, steps: int, batch: int, policy: str = "every",
             minibatches: int = 1, seed: int = 0) -> dict[str, float]:
    """One run of `steps` batches, event by event; see the module docstring for the rules."""
    rng = random.Random(seed)
    N = minibatches
    V = published = 0
    events: list[tuple[float, int, str, tuple]] = []  # (time, order, kind, data)
    order = iter(range(10 ** 9))

    def at(time: float, kind: str, *data) -> None:
        heapq.heappush(events, (time, next(order), kind, data))

    queue: list[int] = []  # issued slots no worker took yet
    min_version: list[int] = []  # per issued slot: the version published when it was issued
    version: dict[int, int] = {}  # per started slot: the version that sampled it
    arrivals: dict[int, float] = {}
    idle = list(range(workers))
    holds = [-1] * workers  # the version each worker's engine holds
    busy_w = 0.0
    trained, waiting, stale, kept, wait_s = 0, False, [], [], 0.0
    first_arrival = waited_from = None
    published_at = [0]  # published versions still kept (see `kept`)

    def dispatch(now: float) -> None:
        nonlocal busy_w
        while queue and idle:
            w, slot = idle.pop(0), queue.pop(0)
            dur = sum(phases.draw(p, rng) for p in WORKER_PHASES if p != "load")
            if holds[w] != published:
                dur += phases.draw("load", rng)
                holds[w] = published
            version[slot] = published
            busy_w += dur
            at(now + dur, "arrival", slot, w)

    def train(now: float) -> None:
        nonlocal first_arrival
        first_arrival = arrivals[0] if first_arrival is None else first_arrival
        stale.append(V + N - 1 - version[trained])
        at(now + phases.draw("old_logprob_trainer", rng) + phases.draw("train", rng), "trained")

    def admit(now: float) -> None:
        while len(min_version) < steps and V + N * (len(min_version) - trained) - published <= eta:
            min_version.append(published)
            queue.append(len(min_version) - 1)
        dispatch(now)

    admit(0.0)
    train_next = True  # the trainer is free and wants slot `trained`
    now = 0.0
    while trained < steps:
        if train_next:
            train_next = False
            if trained in arrivals:
                train(now)
            else:
                waiting, waited_from = True, now
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrival":
            slot, w = data
            arrivals[slot] = now
            idle.append(w)
            dispatch(now)
            if waiting and slot == trained:
                waiting = False
                wait_s += now - waited_from if trained else 0.0  # start-up is not idling
                train(now)
        elif kind == "trained":
            V += N
            trained += 1
            blocked = len(min_version) < steps and V + N * (len(min_version) - trained) - published > eta
            if V > published and (policy == "every" or blocked):
                at(now + phases.draw("publish", rng), "published", V)
            else:
                at(now, "published", None)
        elif kind == "published":
            if data[0] is not None:
                published = data[0]
                published_at.append(published)
            oldest = min((min_version[s] for s in range(trained, len(min_version))), default=published)
            kept.append(sum(1 for v in published_at if v >= oldest))
            admit(now)
            train_next = True
    elapsed = now - first_arrival
    return {"samples_per_s": steps * batch / elapsed, "step_s": elapsed / steps,
            "trainer_idle": wait_s / elapsed, "worker_idle": max(0.0, 1 - busy_w / (workers * now)),
            "staleness_mean": statistics.fmean(stale), "staleness_max": float(max(stale)),
            "kept_mean": statistics.fmean(kept), "kept_max": float(max(kept)),
            "publishes_per_step": (len(published_at) - 1) / steps}


def sync_step(phases: Phases, rng: random.Random) -> float:
    """The synchronous loop's step: generate, then train, in turn."""
    return (phases.draw("generate", rng) + phases.draw("reward", rng)
            + phases.draw("old_logprob_trainer", rng) + phases.draw("train", rng)
            + phases.draw("publish", rng))


def phases_of_run(run_dir: Path) -> tuple[Phases, dict]:
    """A tether async run's per-step phase samples (step 0, the start-up, left out), and
    what it measured. The trainer's train phase is its step less waiting and publishing,
    plus the bookkeeping between steps (each step's wall time, from async/samples_per_s,
    less its time/step)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rows = [r for r in rows if "async/samples_per_s" in r]
    batch = _batch_of(run_dir)
    elapsed = [(i + 1) * batch / r["async/samples_per_s"] for i, r in enumerate(rows)]
    walls = [b - a for a, b in pairwise(elapsed)]
    rows = rows[1:]
    p = {"generate": [r["worker/generate"] for r in rows], "reward": [r["worker/reward"] for r in rows],
         "old_logprob_worker": [r["worker/old_logprob"] for r in rows],
         "load": [r["worker/load_weights"] for r in rows if r["worker/load_weights"] > 0] or [0.0],
         "old_logprob_trainer": [r["time/old_logprob"] for r in rows],
         "publish": [r["time/publish"] for r in rows],
         "train": [w - r["time/wait_data"] - r["time/publish"] - r["time/old_logprob"]
                   for w, r in zip(walls, rows)]}
    return Phases(p), {"samples_per_s": rows[-1]["async/samples_per_s"], "batch": batch,
                       "steps": len(rows) + 1}


def _batch_of(run_dir: Path) -> int:
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["group_size"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from-run", type=Path, action="append", default=[],
                   help="a tether async run directory (repeatable): simulate it with its own "
                   "per-step phase times and compare with its measured samples/s")
    p.add_argument("--peer", choices=sorted(PEERS), help="a published peer setup")
    for name, what in [("generate", "a batch's generation"), ("reward", "its reward"),
                       ("old-logprob", "its pi_old forward"), ("train", "the trainer's step"),
                       ("publish", "publishing a version (trainer side)"),
                       ("load", "loading a version (worker side)")]:
        p.add_argument(f"--{name}", type=float, default=0.0, help=f"seconds: {what}")
    p.add_argument("--score-old", choices=["worker", "trainer", "none"], default="trainer",
                   help="who runs the pi_old forward (none: the rollout's log-probs are reused)")
    p.add_argument("--cv", type=float, default=0.1, help="lognormal spread of each phase")
    p.add_argument("--workers", default="1,2", help="comma list of rollout worker counts")
    p.add_argument("--eta", default="1,2", help="comma list of max staleness (window)")
    p.add_argument("--policy", choices=["every", "lazy"], default="every",
                   help="publish after every step, or only when admission would block")
    p.add_argument("--steps", type=int, default=200, help="batches per simulated run")
    p.add_argument("--batch", type=int, default=256, help="samples per batch")
    p.add_argument("--version-gb", type=float, default=0.0,
                   help="GB one kept version costs (docs/scale.md), for snapshot memory")
    p.add_argument("--seeds", type=int, default=5, help="simulated runs per row (mean)")
    p.add_argument("--json", help="also write the rows as JSON here")
    return p.parse_args()


def mean_of(runs: list[dict]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in runs) for k in runs[0]}


def table(rows: list[dict]) -> None:
    print(f"{'setup':34s} {'W':>2s} {'eta':>3s} {'samples/s':>9s} {'x sync':>6s} {'measured':>8s} "
          f"{'gap':>6s} {'trainer idle':>12s} {'worker idle':>11s} {'stale mean':>10s} "
          f"{'kept max':>8s} {'snap GB':>7s}")
    for r in rows:
        meas = r.get("measured")
        gap = f"{r['samples_per_s'] / meas - 1:+6.1%}" if meas else ""
        print(f"{r['setup']:34s} {r['workers']:2d} {r['eta']:3d} {r['samples_per_s']:9.2f} "
              f"{r.get('x_sync', float('nan')):5.2f}x {meas or float('nan'):8.2f} {gap:>6s} "
              f"{r['trainer_idle']:12.0%} {r['worker_idle']:11.0%} {r['staleness_mean']:10.2f} "
              f"{r['kept_max']:8.0f} {r.get('snapshot_gb', 0.0):7.1f}")


def main() -> None:
    args = parse_args()
    rows = []
    for run_dir in args.from_run:
        import yaml

        phases, measured = phases_of_run(run_dir)
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        loop = cfg["loop"]
        res = mean_of([simulate(phases, loop["workers"], loop["max_staleness"], measured["steps"],
                                measured["batch"], seed=s) for s in range(args.seeds)])
        rows.append({"setup": f"run {run_dir.name}", "workers": loop["workers"],
                     "eta": loop["max_staleness"], "measured": measured["samples_per_s"], **res})
    if args.peer:
        rows += peer_rows(args)
    if not args.from_run and not args.peer:
        old = {"worker": ("old_logprob_worker", 0), "trainer": ("old_logprob_trainer", 0)}
        phases = Phases({"generate": [args.generate], "reward": [args.reward], "train": [args.train],
                         "publish": [args.publish], "load": [args.load]}, args.cv)
        if args.score_old in old:
            phases.values[old[args.score_old][0]] = [args.old_logprob]
        rng = random.Random(0)
        sync = args.batch / statistics.fmean(sync_step(phases, rng) for _ in range(1000))
        for w in map(int, args.workers.split(",")):
            for eta in map(int, args.eta.split(",")):
                res = mean_of([simulate(phases, w, eta, args.steps, args.batch, args.policy, seed=s)
                               for s in range(args.seeds)])
                rows.append({"setup": "given phases", "workers": w, "eta": eta,
                             "x_sync": res["samples_per_s"] / sync,
                             "snapshot_gb": res["kept_max"] * args.version_gb, **res})
    table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def peer_rows(args: argparse.Namespace) -> list[dict]:
    """The peer's sync phases on all its GPUs, split between W = 1 rollout group and the
    trainer at the peer's ratio, under stated scaling assumptions; printed beside the
    published speedup."""
    peer = PEERS[args.peer]
    s = peer["sync"]
    sync_step_s = s["generate"] + s["old_logprob"] + s["train"] + s["other"]
    print(f"{args.peer}: {peer['source']}\n  sync step {sync_step_s:.2f} s (generate {s['generate']}, "
          f"old_logprob {s['old_logprob']}, train {s['train']}, other {s['other']}); published async "
          f"speedup {peer['published_speedup']}x (400 steps), {peer['published_speedup_100_steps']}x (100)")
    half = {  # half the GPUs each side: what each phase takes there, per assumption
        "linear (each phase 2x on half the GPUs), pi_old on the trainer":
            {"generate": 2 * s["generate"], "old_logprob_trainer": 2 * s["old_logprob"],
             "train": 2 * s["train"] + s["other"]},
        "linear, pi_old reused from the rollout (verl's async)":
            {"generate": 2 * s["generate"], "train": 2 * s["train"] + s["other"]},
        "train as measured async (113.16 s), pi_old reused, generate linear":
            {"generate": 2 * s["generate"], "train": peer["async_measured"]["train"] + s["other"]},
        # Not a prediction: the generation time the published figure implies, for the gap.
        "implied: train as measured async, pi_old reused, generate at the async step's pace":
            {"generate": peer["async_measured"]["step"] - 1.0,
             "train": peer["async_measured"]["train"] + s["other"]},
    }
    rows = []
    for name, p in half.items():
        phases = Phases({k: [v] for k, v in p.items()}, args.cv)
        res = mean_of([simulate(phases, 1, 1, args.steps, peer["batch"], seed=k)
                       for k in range(args.seeds)])
        rows.append({"setup": name[:34], "assumption": name, "workers": 1, "eta": 1,
                     "x_sync": res["samples_per_s"] * sync_step_s / peer["batch"],
                     "published_speedup": peer["published_speedup"], **res})
    for r in rows:
        how = "back-solved" if r["assumption"].startswith("implied") else "predicted"
        print(f"  {r['x_sync']:.2f}x {how} vs {r['published_speedup']}x published: {r['assumption']}")
    return rows


if __name__ == "__main__":
    main()
