"""Synchronous against asynchronous training, side by side in one run, on the same work.

    python benchmarks/async.py                       # tether's demo model, HF engine
    python benchmarks/async.py --steps 30 --engines hf --json out.json
    python benchmarks/async.py --engines hf --backends local,ray --workers 1,2   # + Ray rows
    python benchmarks/async.py --publish-cost        # what publishing one version costs
    python benchmarks/async.py --pi-old-cost         # what the trainer's pi_old forward costs
    python benchmarks/async.py --dlc                 # E-DLC's race: fixed vs ESS window
    python benchmarks/async.py --engines hf --workers 1,2 --keep-runs runs/async-bench
                                                     # then: simulate_async.py --from-run ...

Every run trains the same model on the same Countdown prompts, with the same batch
(prompts x group), response length, learning rate and number of steps, so the same
number of samples: `sync` (generate, then train, in turn), then `async` with one rollout
worker at eta = 1 and eta = 2 (loop.max_staleness). One torch thread per side: the
trainer's and, in async mode, the worker's, so on a 2-core machine each side has a core.

samples/s leaves out engine start-up: sync as the samples of steps 2..N over their summed
step times; async as `async/samples_per_s` at the last step, every batch's samples over the
wall time from the first batch's arrival to the end of the last step (so the async rows
also pay the per-step work outside `time/step`: admission, ledger, logging). Held-out accuracy is sampled like the rollouts at the end
(eval.samples per problem) at the trainer's weights. "Where the time goes" is the
synchronous step split by phase; its generate share bounds what overlapping can save:
with one generator and one trainer the step cannot take less than the larger of
generation and the rest (ideal speedup = step / max(generate, rest)).

`--backends local,ray --workers 1,2` adds async rows at eta = 2 for each backend and
number of rollout workers (loop.backend, loop.workers; the Ray rows start a local Ray
with this machine's CPUs, one CPU reserved per worker actor), side by side with the
rows above. The row `eta=2 pi_old@trainer` is `async eta=2` with the trainer scoring pi_old
(loop.score_old=trainer) instead of the rollout worker. "Where the time goes, seconds per
step" breaks each run down by side: the trainer's phases (time/*), and the worker's per
batch (worker/*: sampling, reward, pi_old, weight loads, idle), which overlap the trainer's.
`--publish-cost` times publishing one weight version instead: packing the
state dict, then handing it over by shared memory (local) or `ray.put` plus an actor's
fetch (ray), for the model and for a 1 GiB buffer (the per-GB rate that scales to a
larger model).

`--dlc` runs E-DLC's real race instead (tether.experiments.dlc: its warm start, fp8
generator, lr 2e-4, 60 steps, estimator dlc with `sync.policy=ess:0.5`, one rollout
worker, eta = 32): the synchronous loop at lag 0, then the asynchronous one with the fixed
window (today's: trips publish, batches in flight are trained), and with the ESS window
(`loop.window=ess`) under each `loop.after_trip` rule. Beside samples/s it reports what
drops cost: trained samples per generated sample (the rest were generated and dropped),
the ESS trips, the mean window, and mean and max staleness.

What it leaves out: vLLM's start-up (~20 s) is excluded like the HF worker's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from harness import COUNTDOWN, interleaved, model_path, timed, train_run, use_threads


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local HF model dir (default: the demo's tiny model, built "
                   "and warm-started on first use)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="responses per prompt")
    p.add_argument("--max-new-tokens", type=int, default=12, help="longest response")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    p.add_argument("--engines", default="hf,vllm",
                   help="comma list of hf, vllm (vllm is skipped where not installed)")
    p.add_argument("--backends", default="local",
                   help="comma list of local, ray: async eta=2 rows per backend and worker count")
    p.add_argument("--workers", default="1", help="comma list of rollout worker counts")
    p.add_argument("--publish-cost", action="store_true",
                   help="time publishing one weight version (local and ray) and exit")
    p.add_argument("--pi-old-cost", action="store_true",
                   help="time the pi_old forward of one batch (trainer's model, snapshot, "
                   "snapshot reloaded), alone and beside a generating process, and exit")
    p.add_argument("--dlc", action="store_true",
                   help="E-DLC's race (fp8, dlc, ess:0.5, eta 32, lr 2e-4, 60 steps): sync at lag "
                   "0 against async with the fixed window and the ESS window under each "
                   "loop.after_trip rule; samples/s, trained per generated, staleness")
    p.add_argument("--json", help="also write the table as JSON here")
    p.add_argument("--keep-runs", help="keep each run's directory under this one (for "
                   "benchmarks/simulate_async.py --from-run)")
    return p.parse_args()


def run_one(common: list[str], extra: list[str], keep: Path | None = None) -> dict[str, float]:
    """One run; `keep`: its run directory (else a temporary one)."""
    run = train_run([*common, *extra], keep)
    cfg, rows, wall = run.cfg, run.rows[1:], run.wall_s
    last, batch = rows[-1], cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if cfg.loop.mode == "async":
        sps = last["async/samples_per_s"]
    else:
        sps = batch * (len(rows) - 1) / sum(r["time/step"] for r in rows[1:])
    # time/generate: the sync loop's generation; in async runs the worker's generate + reward.
    phases = {k: sum(r.get(k, 0.0) for r in rows[1:])
              for k in (*TRAINER, *WORKER, "time/generate", "time/step")}
    stale = [r.get("staleness/versions/mean", 0.0) for r in rows]
    return {"samples_per_s": sps, "accuracy_sampled": last["eval/accuracy_sampled"],
            "accuracy_greedy": last["eval/accuracy"], "wall_s": wall,
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(r.get("staleness/versions/max", 0.0) for r in rows),
            "trained_per_generated": last.get("async/trained_per_generated", 1.0),
            "trips": sum(r.get("sync/tripped", 0.0) for r in rows),
            "window_mean": sum(r.get("async/window", 0.0) for r in rows) / len(rows),
            "steps_timed": len(rows) - 1, **phases}


# The per-side breakdown: the trainer's phases (time/sync holds publish and snapshots) and,
# in async runs, the worker's (overlapping the trainer's).
TRAINER = ("time/wait_data", "time/collate", "time/old_logprob", "time/train",
           "time/diagnostics", "time/sync", "time/publish", "time/snapshots")
WORKER = ("worker/generate", "worker/reward", "worker/old_logprob", "worker/load_weights",
          "async/generator_idle")


def breakdown(runs: list[dict]) -> None:
    """Seconds per step by phase on each side. The trainer's `sync` holds its `publish` and
    `snapshots`; the worker's columns are per batch and overlap the trainer's (the sync
    loop generates on the trainer's side, shown under the generator's columns)."""
    name = {k: k.split("/")[-1] for k in (*TRAINER, *WORKER)} | {
        "time/wait_data": "wait", "time/old_logprob": "pi_old", "time/diagnostics": "diag",
        "worker/old_logprob": "pi_old", "worker/load_weights": "load",
        "async/generator_idle": "idle"}
    print("\nWhere the time goes, seconds per step")
    print(f"{'':27s}trainer{'':58s}generator")
    print(f"{'run':26s} " + " ".join(f"{name[k]:>7s}" for k in TRAINER) + f" {'step':>7s}  | "
          + " ".join(f"{name[k]:>7s}" for k in WORKER))
    for r in runs:
        n = r["steps_timed"]
        gen = [r["time/generate"] if k == "worker/generate" and r["run"] == "sync" else r[k]
               for k in WORKER]
        print(f"{r['engine'] + ' ' + r['run']:26s} " + " ".join(f"{r[k] / n:7.3f}" for k in TRAINER)
              + f" {r['time/step'] / n:7.3f}  | " + " ".join(f"{v / n:7.3f}" for v in gen))


def main() -> None:
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tether.rollout.vllm_engine import vllm_available

    if args.dlc:  # E-DLC's own warm start, not the demo's model
        dlc_race(args)
        return
    model = model_path(args.model)
    if args.publish_cost:
        publish_cost(model)
        return
    if args.pi_old_cost:
        pi_old_cost(model, args.prompts, args.group, args.max_new_tokens)
        return
    common = [f"model.path={model}", f"train.steps={args.steps}", f"train.lr={args.lr}",
              f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
              f"rollout.max_new_tokens={args.max_new_tokens}", "run.progress=false",
              use_threads(1), "eval.every=0", "eval.samples=4", "run.checkpoint_every=0",
              "diagnostics.monitor_every=0"]
    runs = []
    for engine in args.engines.split(","):
        if engine == "vllm" and not vllm_available():
            print("vllm: not installed, skipped (make install-vllm)")
            continue
        grid = [(b, int(w)) for b in args.backends.split(",") for w in args.workers.split(",")]
        eta2 = ["loop.mode=async", "loop.max_staleness=2"]
        for name, extra in [("sync", []),
                            ("async eta=1", ["loop.mode=async", "loop.max_staleness=1"]),
                            ("async eta=2", eta2),
                            ("eta=2 pi_old@trainer", [*eta2, "loop.score_old=trainer"]),
                            *[(f"{b} x{w} eta=2", [*eta2, f"loop.backend={b}", f"loop.workers={w}"])
                              for b, w in grid if (b, w) != ("local", 1)]]:
            keep = args.keep_runs and Path(args.keep_runs) / f"{engine}-{name.replace(' ', '_')}"
            res = run_one(common, [f"rollout.engine={engine}", *extra], keep or None)
            runs.append({"engine": engine, "run": name, **res})
            print(f"{engine:5s} {name:20s} {res['samples_per_s']:7.1f} samples/s  "
                  f"acc(sampled) {res['accuracy_sampled']:.3f}  wall {res['wall_s']:.0f}s",
                  flush=True)
    print(f"\n{args.steps} steps of {args.prompts} x {args.group}, <= {args.max_new_tokens} "
          f"new tokens, lr {args.lr}, one torch thread per side, {os.cpu_count()} CPUs")
    print(f"{'engine':6s} {'run':20s} {'samples/s':>9s} {'speedup':>7s} {'acc sampled':>11s} "
          f"{'acc greedy':>10s} {'staleness':>9s} {'trainer idle':>12s}")
    for r in runs:
        base = next(x for x in runs if x["engine"] == r["engine"] and x["run"] == "sync")
        idle = r["time/wait_data"] / r["time/step"] if r["time/step"] else 0.0
        print(f"{r['engine']:6s} {r['run']:20s} {r['samples_per_s']:9.1f} "
              f"{r['samples_per_s'] / base['samples_per_s']:6.2f}x {r['accuracy_sampled']:11.3f} "
              f"{r['accuracy_greedy']:10.3f} {r['staleness_mean']:9.2f} {idle:11.0%}")
    breakdown(runs)
    for r in (x for x in runs if x["run"] == "sync"):
        step = r["time/step"]
        rest = step - r["time/generate"]
        shares = ", ".join(f"{k} {r[f'time/{k}'] / step:.0%}" for k in
                           ("generate", "old_logprob", "train", "diagnostics", "sync"))
        print(f"\n{r['engine']} sync step, where the time goes: {shares}; ideal overlap "
              f"speedup with one generator and one trainer: {step / max(r['time/generate'], rest):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def dlc_race(args: argparse.Namespace) -> None:
    """E-DLC's fp8_async row at its settings: what the ESS window and each after_trip rule
    cost in throughput and buy in staleness, against sync at lag 0 on the same work."""
    from tether.experiments import dlc

    # The matrix's own keys (its base, the fp8 scenarios, the methods), timing-friendly
    # overrides after them: no evaluation but the last, no monitor, no checkpoints.
    scen, method = dlc.scenarios(dlc.LAG), dlc.METHODS
    base = dlc.build().base
    model = model_path(args.model, *base)
    common = [*base, f"model.path={model}", "run.progress=false", use_threads(1),
              "eval.every=0", "run.checkpoint_every=0", "diagnostics.monitor_every=0"]
    race = scen[f"fp8_async{dlc.LAG}"]
    rows = [("sync, lag 0", [*scen["fp8"], *method["dlc"]]),
            ("async, fixed window", [*race, *method["dlc"]]),
            ("async, ESS window, after_trip=window", [*race, *method["dlc_window"]]),
            ("async, ESS window, after_trip=regenerate", [*race, *method["dlc_regen"]])]
    runs = []
    for name, extra in rows:
        res = run_one(common, extra)
        runs.append({"run": name, **res})
        print(f"{name:42s} {res['samples_per_s']:7.1f} samples/s  wall {res['wall_s']:.0f}s",
              flush=True)
    print(f"\nE-DLC's race: {dlc.STEPS} steps of 32 x 8, fp8 generator, dlc + ess:0.5, lr "
          f"{dlc.LR}, eta {dlc.LAG}, one torch thread per side, {os.cpu_count()} CPUs")
    print(f"{'run':42s} {'samples/s':>9s} {'x sync':>6s} {'trained/gen':>11s} {'trips':>5s} "
          f"{'window':>6s} {'stale mean':>10s} {'stale max':>9s} {'acc sampled':>11s}")
    for r in runs:
        print(f"{r['run']:42s} {r['samples_per_s']:9.1f} {r['samples_per_s'] / runs[0]['samples_per_s']:5.2f}x "
              f"{r['trained_per_generated']:11.2f} {r['trips']:5.0f} {r['window_mean']:6.1f} "
              f"{r['staleness_mean']:10.2f} {r['staleness_max']:9.0f} {r['accuracy_sampled']:11.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def _generate_forever(cfg) -> None:
    """A rollout worker's load: sample and reward batches until terminated."""
    from tether.rollout.worker import RolloutEngine, WorkItem

    engine = RolloutEngine(0, cfg, cfg.model.path)  # one torch thread (loop.worker_threads)
    prompts = tuple(range(cfg.rollout.prompts_per_step))
    for slot in iter(int, 1):
        engine.make(WorkItem(slot, prompts, (0,) * len(prompts), 0, slot), 0.0)


def pi_old_cost(model: str, prompts: int, group: int, new_tokens: int,
                repeats: int = 12) -> None:
    """Median seconds of the async trainer's pi_old forward on one batch: at the trainer's own
    model, at the snapshot model (loaded once), and at the snapshot model reloaded every call
    (as when each batch is at a new version); alone, then beside a process that generates
    (the rollout worker on the other core, pi_old left to the trainer). One torch thread each."""
    import multiprocessing

    from tether.config import load_config
    from tether.rollout.worker import RolloutEngine, WorkItem
    from tether.scoring import collate
    from tether.setup import load_policy, sampling_params
    from tether.trainer import Trainer
    from tether.weights.snapshots import SnapshotStore

    use_threads(1)
    cfg = load_config(COUNTDOWN, [f"model.path={model}",
                      f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}",
                      f"rollout.max_new_tokens={new_tokens}", "loop.score_old=trainer"])
    _, policy, tok = load_policy(cfg)
    trainer = Trainer(policy, cfg.train, sampling_params(cfg, policy.config.vocab_size))
    snapshots = SnapshotStore(policy)
    for v in (0, 1):
        snapshots.put(v, policy.state_dict())
    item = WorkItem(0, tuple(range(prompts)), (0,) * prompts, 0, 1)
    batch = collate(RolloutEngine(0, cfg, model).make(item, 0.0).rollouts, tok.pad_token_id)
    flip = [0]

    def reloaded():
        flip[0] ^= 1
        trainer.score(batch, snapshots.model_at(flip[0]))

    cases = {"trainer's model": lambda: trainer.score(batch, policy),
             "snapshot, loaded": lambda: trainer.score(batch, snapshots.model_at(0)),
             "snapshot, reloaded each call": reloaded}
    print(f"pi_old forward on one batch of {prompts} x {group}, median of {repeats} (s)")
    for beside in (False, True):
        other = None
        if beside:
            other = multiprocessing.get_context("spawn").Process(
                target=_generate_forever, args=(cfg,), daemon=True)
            other.start()
            time.sleep(8)  # its model loaded and generating
        for c, t in interleaved(cases, repeats).items():  # so drift hits every case alike
            print(f"{'beside a generating process' if beside else 'alone':28s} {c:30s} "
                  f"{t.median:.3f}", flush=True)
        if other is not None:
            other.terminate()


def publish_cost(path: str, repeats: int = 5) -> None:
    """Median seconds to publish one version: pack it (one copy into a flat buffer), then
    shared memory (local backend) or ray.put and one actor's fetch (ray backend)."""
    import torch

    from tether.models import load_model
    from tether.weights.publisher import pack

    def median(fn) -> float:
        return timed(fn, repeats).median

    model, _ = load_model(path)
    cases = {"model": model.state_dict(), "1 GiB": {"w": torch.zeros(2**28)}}  # fp32
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)

    @ray.remote(num_cpus=0)
    def fetch(box: list) -> int:  # an actor's side: the buffer, zero-copy on its node
        return len(ray.get(box[0])[2])

    print(f"{'what':8s} {'MB':>8s} {'pack':>9s} {'local':>9s} {'ray':>9s} {'fetch':>9s}   "
          "(local = packed into shared memory, ray = pack + ray.put, fetch = one actor's ray.get)")
    for name, sd in cases.items():
        mb = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
        t_pack = median(lambda sd=sd: pack(0, sd))
        t_local = median(lambda sd=sd: pack(0, sd, shared=True))

        def put(sd=sd):
            packed = pack(0, sd)
            return ray.put((0, packed.layout, packed.buffer.numpy()))

        t_ray = median(put)
        ref = put()
        t_fetch = median(lambda r=ref: ray.get(fetch.remote([r])))
        print(f"{name:8s} {mb:8.1f} {t_pack * 1e3:7.1f}ms {t_local * 1e3:7.1f}ms "
              f"{t_ray * 1e3:7.1f}ms {t_fetch * 1e3:7.1f}ms", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
