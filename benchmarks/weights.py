"""What exact pi_old costs in weights: a kept version in each form, and a publish, full or delta.

    python benchmarks/weights.py                      # 2.4 M, 17 M, 104 M; lr 1e-4 and 1e-6
    python benchmarks/weights.py --sizes tiny --lrs 1e-4 --json out.json

Each model (benchmarks/harness.py's Qwen3 shapes, random weights, Countdown's 21-token
vocabulary) takes real AdamW steps on random tokens, so consecutive versions differ as
training makes them differ: by about the learning rate per weight (Adam normalises the
step). The delta's size depends on that alone, so it is measured at tether's Countdown lr
(1e-4) and at the lr LLM RL recipes use (1e-6: DAPO, verl's and TRL's GRPO examples).

- **Kept version** (`weights.snapshot_dtype`, `weights.snapshot_compress`): bytes per kept
  version with `--keep` versions kept (the newest whole, the others deltas), in four forms:
  fp32, train dtype (what bf16 autocast reads in bf16, stored in bf16), and each XOR-
  compressed; the seconds to keep one more (put) and to rebuild the oldest (state).
- **Publish** (`weights.publish`): bytes each worker receives for one version and the
  seconds on each side: full = packed into shared memory (the worker copies it into its
  engine either way, not counted); delta = pack + XOR + zstd on the trainer, zstd + XOR
  on the worker. Medians of `--repeats`, one torch thread, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from harness import random_model, timed, use_threads

from tether.weights import delta
from tether.weights.publisher import pack
from tether.weights.snapshots import SnapshotStore, compute_dtype_names

MB = 1e6
VOCAB = 21  # Countdown's alphabet


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="tiny,20M,100M", help="comma list of tiny, 20M, 100M")
    p.add_argument("--lrs", default="1e-4,1e-6", help="comma list of AdamW learning rates")
    p.add_argument("--keep", type=int, default=3, help="versions kept (eta + 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    p.add_argument("--bucket-mb", type=int, default=64, help="delta bucket size (weights.bucket_mb)")
    p.add_argument("--json", help="also write the rows as JSON here")
    return p.parse_args()


def versions(model, n: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """n consecutive versions: one AdamW step on 8 x 32 random tokens between each."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (8, 32), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        out.append({k: t.clone() for k, t in model.state_dict().items()})
    return out


def kept_rows(model, vs: list[dict], keep: int, repeats: int, bucket: int) -> dict[str, dict]:
    names = compute_dtype_names(model, "bf16")
    forms = {"fp32": (frozenset(), False), "train dtype": (names, False),
             "fp32 + xor": (frozenset(), True), "train dtype + xor": (names, True)}
    out = {}
    for form, (rounded, compress) in forms.items():
        def filled(n: int, rounded=rounded, compress=compress) -> SnapshotStore:
            store = SnapshotStore(model, rounded, compress, bucket_bytes=bucket)
            for v, sd in enumerate(vs[:n]):
                store.put(v, sd)
            return store

        def put_newest(store: SnapshotStore) -> SnapshotStore:
            store.put(keep - 1, vs[keep - 1])
            return store

        # the newest version into a store holding the others, a fresh one each time
        put = timed(put_newest, repeats, setup=lambda filled=filled: filled(keep - 1))
        store = put.result
        state_s = timed(lambda s=store: s.state(0), repeats).median
        out[form] = {"mb_per_version": store.nbytes / len(store) / MB, "put_s": put.median,
                     "state_s": state_s, "ratio": ratios(store.deltas.values())}
    return out


def ratios(deltas) -> dict[str, float]:
    """Compression ratio of the deltas by element size (2: bf16 elements, 4: fp32): raw
    bytes over compressed bytes, so a real model's mix of the two can be priced."""
    raw, packed = collections.Counter(), collections.Counter()
    for d in deltas:
        for p, blob in zip(d.buckets, d.blobs):
            raw[p.itemsize] += p.end - p.start
            packed[p.itemsize] += len(blob)
    return {str(size): raw[size] / packed[size] for size in raw}  # str: as JSON has it


def publish_rows(vs: list[dict], repeats: int, bucket: int) -> dict[str, dict]:
    a, b = pack(0, vs[-2]), pack(1, vs[-1])
    parts = delta.buckets(b.layout, bucket)
    d = delta.encode(b.buffer, a.buffer, parts)
    out_buf = a.buffer.clone()
    return {
        "full": {"mb": b.buffer.numel() / MB, "send_s": timed(lambda: pack(1, vs[-1], shared=True), repeats).median,
                 "receive_s": 0.0},
        "delta": {"mb": d.nbytes / MB,
                  "send_s": timed(lambda: delta.encode(pack(1, vs[-1]).buffer, a.buffer, parts), repeats).median,
                  "receive_s": timed(lambda: delta.apply(d, out_buf, out=a.buffer.clone()), repeats).median},
    }


def main() -> None:
    args = parse_args()
    use_threads(1)
    bucket = args.bucket_mb << 20
    rows = []
    for size in args.sizes.split(","):
        for lr in (float(x) for x in args.lrs.split(",")):
            model = random_model(size, VOCAB)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            vs = versions(model, args.keep + 1, lr)
            row = {"size": size, "params_m": params, "lr": lr,
                   "kept": kept_rows(model, vs, args.keep, args.repeats, bucket),
                   "publish": publish_rows(vs, args.repeats, bucket)}
            rows.append(row)
            print(f"{size} ({params:.1f} M params), lr {lr:g}", flush=True)
            for form, r in row["kept"].items():
                print(f"  kept  {form:18s} {r['mb_per_version']:8.2f} MB/version  put {r['put_s']:6.3f} s"
                      f"  rebuild oldest {r['state_s']:6.3f} s", flush=True)
            for form, r in row["publish"].items():
                print(f"  publish {form:16s} {r['mb']:8.2f} MB/worker   send {r['send_s']:6.3f} s"
                      f"  receive {r['receive_s']:6.3f} s", flush=True)
    print(f"\n{args.keep} kept versions, buckets of {args.bucket_mb} MiB, zstd level 1, one torch thread")
    print(f"{'model':6s} {'params M':>8s} {'lr':>6s} | kept MB/version: {'fp32':>7s} {'train':>7s} "
          f"{'fp32+xor':>8s} {'train+xor':>9s} | publish MB: {'full':>7s} {'delta':>7s} | "
          f"publish s: {'full':>6s} {'delta':>6s} {'apply':>6s}")
    for r in rows:
        k, p = r["kept"], r["publish"]
        print(f"{r['size']:6s} {r['params_m']:8.1f} {r['lr']:6.0e} | {'':16s} "
              + " ".join(f"{k[f]['mb_per_version']:{w}.1f}" for f, w in
                         [("fp32", 7), ("train dtype", 7), ("fp32 + xor", 8), ("train dtype + xor", 9)])
              + f" | {'':11s} {p['full']['mb']:7.1f} {p['delta']['mb']:7.1f} | {'':10s} "
              f"{p['full']['send_s']:6.3f} {p['delta']['send_s']:6.3f} {p['delta']['receive_s']:6.3f}")
    scale_table(rows[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


# Real models' shapes (their config.json): hidden, layers, heads, kv heads, head dim,
# intermediate, vocabulary, tied embeddings, q/k/v bias, q/k norm.
ARCH = {
    "Qwen3-0.6B": (1024, 28, 16, 8, 128, 3072, 151936, True, False, True),
    "Qwen2.5-7B": (3584, 28, 28, 4, 128, 18944, 152064, False, True, False),
    "Qwen2.5-32B": (5120, 64, 40, 8, 128, 27648, 152064, False, True, False),
    "Llama-3.1-70B": (8192, 80, 64, 8, 128, 28672, 128256, False, False, False),
}


def param_split(arch: tuple) -> tuple[float, float]:
    """(parameters bf16 autocast reads in bf16: every projection's weight and bias;
    the rest: embeddings, output head, norms), as tether.weights.snapshots finds them."""
    h, layers, heads, kv, hd, inter, vocab, tied, bias, qk_norm = arch
    proj = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter
    proj += (heads + 2 * kv) * hd if bias else 0
    rest = vocab * h * (1 if tied else 2) + layers * (2 * h + (2 * hd if qk_norm else 0)) + h
    return layers * proj, rest


def scale_table(measured: dict) -> None:
    """docs/scale.md's table: bytes and seconds per version at real sizes, from the formulas
    and this run's measured delta ratios and rates (the last row: the largest model)."""
    k, p = measured["kept"], measured["publish"]
    c2 = k["train dtype + xor"]["ratio"]["2"]  # bf16 elements' ratio
    c4 = k["fp32 + xor"]["ratio"]["4"]  # fp32 elements' ratio
    full_gbs = p["full"]["mb"] / 1e3 / p["full"]["send_s"]
    enc_gbs = p["full"]["mb"] / 1e3 / p["delta"]["send_s"]
    dec_gbs = p["full"]["mb"] / 1e3 / p["delta"]["receive_s"]
    print(f"\nAt scale, from {measured['size']} at lr {measured['lr']:g}: delta ratio of fp32 elements "
          f"{c4:.1f}x, of bf16 elements {c2:.1f}x; pack {full_gbs:.2f} GB/s, delta encode {enc_gbs:.2f} GB/s "
          f"and apply {dec_gbs:.2f} GB/s per thread (GB of fp32 weights)")
    print("(pack: one thread; encode and apply: 16 threads, the rate above x 16)")
    print(f"{'model':14s} {'params B':>8s} | GB/version: {'fp32':>6s} {'train':>6s} | kept GB, eta 2: "
          f"{'fp32':>6s} {'train':>6s} {'tr+xor':>6s} | eta 8: {'fp32':>6s} {'train':>6s} {'tr+xor':>6s} | "
          f"publish GB {'full':>6s} {'delta':>6s} | s: {'pack':>5s} {'encode':>6s} {'apply':>6s}")
    for name, arch in ARCH.items():
        low, high = param_split(arch)
        P = low + high
        fp32, train = 4 * P / 1e9, (2 * low + 4 * high) / 1e9
        train_delta = (2 * low / c2 + 4 * high / c4) / 1e9
        kept = lambda eta, m, d=None: m * (eta + 1) if d is None else m + eta * d
        print(f"{name:14s} {P / 1e9:8.2f} | {'':12s}{fp32:6.1f} {train:6.1f} | {'':15s}"
              f"{kept(2, fp32):6.1f} {kept(2, train):6.1f} {kept(2, train, train_delta):6.1f} | {'':6s}"
              f" {kept(8, fp32):6.1f} {kept(8, train):6.1f} {kept(8, train, train_delta):6.1f} | {'':10s}"
              f" {fp32:6.1f} {fp32 / c4:6.1f} | {'':3s}{fp32 / full_gbs:5.1f} "
              f"{fp32 / enc_gbs / 16:6.1f} {fp32 / dec_gbs / 16:6.1f}")

if __name__ == "__main__":
    main()
