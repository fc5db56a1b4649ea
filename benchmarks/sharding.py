"""The sharded trainer (`train.sharding=fsdp`) against the replicated one: memory per rank on
a 104 M model, and the demo's throughput at two ranks.

    .venv/bin/python benchmarks/sharding.py                          # both; about 3 min here
    .venv/bin/python benchmarks/sharding.py --only memory --worlds 1,2 --kept 3 --json out.json
    .venv/bin/python benchmarks/sharding.py --only throughput --steps 10 --rounds 2

memory: for each world size W, W processes on this machine (gloo) each build the same random
Qwen3-shaped model (`harness.random_model("100M")`, 104 M parameters): at W = 1 held as the
replicated trainer holds it (`train.sharding=none`, the baseline), at W > 1 sharded over
the W ranks as `train.sharding=fsdp` shards it (`tether.trainer.spmd.rank_context`). Each
trains one step on synthetic rollouts (so that gradients and AdamW moments exist) and keeps
`--kept` versions, as `sync.lag = kept - 1` would. Each rank then reports:

- params, grads, optimizer, kept: bytes of its own tensors (its shards under fsdp; kept is
  its `snapshots/bytes`);
- state: their sum, and its ratio to W = 1's;
- publish: at W > 1, the seconds to gather the whole weights onto rank 0 as a publish does,
  and the bytes rank 0 then holds;
- peak RSS: the process's resident high-water mark (getrusage), which also counts torch's
  libraries, the activations, the whole model each rank builds before sharding it, and on
  rank 0 the gathered weights.

4 ranks on 2 cores is fine here: the figures are memory, not speed.

throughput: the demo's synchronous run (configs/countdown.yaml: tether's tiny model,
Countdown, 32 prompts x 8 samples) at two trainer ranks, replicated and sharded, in turn
(`--rounds` of each, alternating, so a drift of the machine hits both alike): the median
step time over `--steps` steps, its training phase (time/train), and samples per second.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import random_model, step_median, train_run
from step import synthetic_rollouts

from tether.config import load_config
from tether.distributed import RankView
from tether.scoring import collate
from tether.trainer import group_advantages
from tether.trainer.spmd import gather, keep, rank_context
from tether.weights.snapshots import SnapshotStore

VOCAB, PROMPT_LEN, LENGTH = 21, 9, 16  # the char vocabulary and Countdown's prompt length
MiB = 2 ** 20
BAR = {4: 0.3}  # issue 71: per-rank state at W = 4 at most 0.3x its W = 1 value


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors: Any) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _rank(rank: int, world: int, port: int, kept: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    sharding = "fsdp" if world > 1 else "none"
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(None, [f"train.sharding={sharding}", f"train.world_size={world}",
                             "rollout.prompts_per_step=4", "rollout.group_size=4",
                             "train.micro_batch=16", f"sync.lag={kept - 1}"])
    model = random_model("100M", VOCAB)
    ctx = rank_context(cfg, model, None, RankView(rank, world) if world > 1 else None)
    trainer = ctx.trainer
    batch = collate(synthetic_rollouts(4, 4, PROMPT_LEN, LENGTH, VOCAB), 0)
    trainer.train_on(batch, group_advantages(batch.rewards, batch.group_ids, True), None, None)
    publish_s = publish_bytes = 0.0
    if world > 1:
        for v in range(kept):
            keep(ctx, v)
        store = ctx.kept
        t0 = time.perf_counter()
        whole = gather(ctx)  # what a publish gathers onto rank 0 (peak RSS counts it)
        publish_s = time.perf_counter() - t0
        publish_bytes = _nbytes(whole.values()) if whole is not None else 0
    else:
        store = SnapshotStore.of(cfg, model)
        for v in range(kept):
            store.put(v, model.state_dict())
    params = list(trainer.model.parameters())
    row = {"world": world, "rank": rank, "params": _nbytes(params),
           "grads": _nbytes(p.grad for p in params if p.grad is not None),
           "optimizer": _nbytes(t for s in trainer.optimizer.state.values() for t in s.values()),
           "kept": store.nbytes, "publish_s": publish_s, "publish_bytes": publish_bytes,
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    row["state"] = row["params"] + row["grads"] + row["optimizer"] + row["kept"]
    out[(world, rank)] = row
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, kept: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(world, port, kept, out), nprocs=world, start_method="spawn")
        return [out[(world, r)] for r in range(world)]


def throughput(steps: int, rounds: int) -> list[dict]:
    """The demo's run at two ranks, replicated and sharded in turn, `rounds` times each."""
    batch = 32 * 8
    out = []
    for r in range(rounds):
        for sharding in ("none", "fsdp"):
            run = train_run([f"train.steps={steps}", "train.world_size=2",
                             f"train.sharding={sharding}", "eval.every=0", "run.progress=false",
                             "diagnostics.monitor_every=0", "diagnostics.routing=false"])
            step = step_median(run.rows)
            out.append({"sharding": sharding, "round": r, "step_s": step,
                        "train_s": step_median(run.rows, "time/train"),
                        "samples_per_s": batch / step})
    return out


def report_throughput(rows: list[dict]) -> None:
    print("\nthe demo's run (32 prompts x 8), two trainer ranks; median over the steps of a run")
    print("| train.sharding | round | s/step | s/step training | samples/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sharding']} | {r['round']} | {r['step_s']:.2f} | {r['train_s']:.2f} | "
              f"{r['samples_per_s']:.1f} |")
    mean = {k: sum(r["samples_per_s"] for r in rows if r["sharding"] == k)
            / sum(r["sharding"] == k for r in rows) for k in ("none", "fsdp")}
    print(f"fsdp / none, samples/s: {mean['fsdp'] / mean['none']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=["memory", "throughput"], help="one section (default: both)")
    p.add_argument("--worlds", default="1,2,4", help="memory: world sizes to measure, "
                   "comma-separated; the first is the baseline of the ratios (1: replicated)")
    p.add_argument("--kept", type=int, default=3, help="memory: kept versions per rank "
                   "(sync.lag + 1)")
    p.add_argument("--steps", type=int, default=10, help="throughput: steps per run")
    p.add_argument("--rounds", type=int, default=2, help="throughput: runs of each, alternating")
    p.add_argument("--json", type=Path, help="also write every row measured to this file")
    args = p.parse_args()
    found: dict[str, list[dict]] = {}
    if args.only != "throughput":
        found["memory"] = report_memory(args.worlds, args.kept)
    if args.only != "memory":
        found["throughput"] = throughput(args.steps, args.rounds)
        report_throughput(found["throughput"])
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))


def report_memory(worlds: str, kept: int) -> list[dict]:
    rows = [row for w in (int(x) for x in worlds.split(",")) for row in measure(w, kept)]
    base = max(r["state"] for r in rows if r["world"] == rows[0]["world"])
    print(f"104 M-parameter model (harness.random_model 100M), {kept} kept versions, "
          "one training step; MiB per rank")
    print("| W | rank | params | grads | AdamW | kept | state | state / W=1 | publish gather "
          "(MiB, s) | peak RSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gathered = (f"{r['publish_bytes'] / MiB:.0f}, {r['publish_s']:.2f}"
                    if r["publish_s"] else "-")
        print(f"| {r['world']} | {r['rank']} | {r['params'] / MiB:.0f} | {r['grads'] / MiB:.0f} | "
              f"{r['optimizer'] / MiB:.0f} | {r['kept'] / MiB:.0f} | {r['state'] / MiB:.0f} | "
              f"{r['state'] / base:.3f} | {gathered} | {r['peak_rss'] / MiB:.0f} |")
    for w in sorted({r["world"] for r in rows} - {rows[0]["world"]}):
        worst = max(r["state"] for r in rows if r["world"] == w) / base
        bar = BAR.get(w)
        verdict = "" if bar is None else f"; bar <= {bar}: {'met' if worst <= bar else 'not met'}"
        print(f"W={w}: largest per-rank state {worst:.3f} x W={rows[0]['world']}'s "
              f"(1/W = {1 / w:.3f}{verdict})")
    return rows


if __name__ == "__main__":
    main()
