"""The cost of exactness (issue 32): kept versions in the trainer's dtype and as exact XOR
deltas, and delta publishing to rollout workers, all bit for bit what the full fp32 copies
give."""

from __future__ import annotations

import multiprocessing
import queue as queue_lib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.config import load_config
from tether.models import load_model
from tether.rollout.types import Rollout
from tether.scoring import collate
from tether.setup import sampling_params
from tether.trainer import Trainer
from tether.weights import delta
from tether.weights.publisher import SharedMemoryPublisher, WeightSubscriber, pack
from tether.weights.snapshots import SnapshotStore, compute_dtype_names

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(0, 300)), min_size=1, max_size=6),
       bucket=st.integers(1, 700), seed=st.integers(0, 2**31 - 1), flips=st.floats(0.0, 1.0),
       threads=st.sampled_from([1, 3]))
def test_a_delta_rebuilds_any_bytes_exactly(sizes, bucket, seed, flips, threads):
    """Random bytes (NaN and inf patterns included), any mix of dtypes and bucket sizes,
    with and without a reference, a few or all bits changed."""
    g = torch.Generator().manual_seed(seed)
    ref = {f"t{i}": torch.randint(0, 256, (n * torch.empty(0, dtype=d).element_size(),),
                                  dtype=torch.uint8, generator=g).view(d)
           for i, (d, n) in enumerate(sizes)}
    new = {}
    for k, t in ref.items():
        raw = t.view(torch.uint8).clone()
        changed = torch.rand(raw.shape, generator=g) < flips
        raw[changed] ^= torch.randint(1, 256, raw.shape, dtype=torch.uint8, generator=g)[changed]
        new[k] = raw.view(t.dtype)
    a, b = pack(0, ref), pack(1, new)
    parts = delta.buckets(b.layout, bucket)
    assert all(p.end - p.start <= max(bucket, 8) for p in parts)
    for base in (a.buffer, None):
        d = delta.encode(b.buffer, base, parts, threads=threads)
        out = base.clone() if base is not None else torch.zeros_like(b.buffer)
        rebuilt = delta.apply(d, out if base is not None else None, out=out, threads=threads)
        covered = torch.zeros_like(b.buffer, dtype=torch.bool)
        for p in parts:
            covered[p.start:p.end] = True
        assert torch.equal(rebuilt[covered], b.buffer[covered])


def _steps(model, n: int, lr: float = 1e-3):
    """n AdamW steps on random tokens: each yields the state dict after it."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        yield model.state_dict()
        x = torch.randint(0, model.config.vocab_size, (4, 12), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def _batch():
    g = torch.Generator().manual_seed(2)
    rollouts = [Rollout(prompt_id=f"p{i // 2}", group_id=i // 2, prompt_ids=[5, 6, 7, 8],
                        response_ids=torch.randint(3, 20, (6 + i % 3,), generator=g).tolist(),
                        logp_rollout=[-1.0] * (6 + i % 3), version=0, engine="hf",
                        precision="bf16", finish_reason="length") for i in range(6)]
    return collate(rollouts, pad_id=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_kept_forms_give_pi_old_bit_for_bit(kind, warm_model_dir, random_moe_dir):
    """train.precision=bf16: the full fp32 copy, the rounded one and the compressed rounded
    one score the same pi_old, bit for bit, at every kept version, after releases that
    free the oldest, a middle and the newest version; compressed fp32 rebuilds the fp32
    copy bit for bit; the forms cost less, in that order."""
    model, _ = load_model(warm_model_dir if kind == "dense" else random_moe_dir)
    cfg = load_config("configs/countdown.yaml", [f"model.path={warm_model_dir}", "train.precision=bf16",
                                                 "rollout.precision=bf16"])
    names = compute_dtype_names(model, "bf16")
    assert SnapshotStore.of(cfg, model).rounded == names
    head = model.get_output_embeddings().weight
    assert names and not any(model.state_dict()[n] is head for n in names)
    assert all("norm" not in n and "embed" not in n for n in names)  # read in fp32
    stores = {"fp32": SnapshotStore(model), "rounded": SnapshotStore(model, names),
              "rounded+xor": SnapshotStore(model, names, compress=True, bucket_bytes=1 << 15),
              "fp32+xor": SnapshotStore(model, compress=True, bucket_bytes=1 << 15)}
    for v, sd in enumerate(_steps(model, 6)):
        for s in stores.values():
            s.put(v, sd)
        if v == 3:
            for s in stores.values():
                s.release({1, 3})  # the oldest and a middle one go
    for s in stores.values():
        s.release({1, 3, 4})  # the newest goes
        assert s.versions == [1, 3, 4]
    nbytes = {k: s.nbytes for k, s in stores.items()}
    assert nbytes["rounded+xor"] < nbytes["rounded"] < nbytes["fp32"]
    assert nbytes["fp32+xor"] < nbytes["fp32"]
    trainer = Trainer(model, cfg.train, sampling_params(cfg, model.config.vocab_size))
    batch, mask = _batch(), _batch().response_mask.bool()
    for v in (4, 1, 3):  # out of order: the scratch model reloads
        fp32 = stores["fp32"].state(v)
        assert all(torch.equal(fp32[k], t) and t.dtype == fp32[k].dtype
                   for k, t in stores["fp32+xor"].state(v).items())
        logp = {k: trainer.score(batch, s.model_at(v)).logp[mask] for k, s in stores.items()}
        for k, lp in logp.items():
            assert torch.equal(lp, logp["fp32"]), (k, v)
    with pytest.raises(KeyError, match="not kept"):
        stores["rounded+xor"].state(2)


def test_rounding_is_refused_where_the_generator_rounds_otherwise(warm_model_dir):
    with pytest.raises(Exception, match="weights.snapshot_dtype"):
        load_config("configs/countdown.yaml", ["weights.snapshot_dtype=train", "train.precision=bf16",
                                               "rollout.precision=fp8"])
    cfg = load_config("configs/countdown.yaml", ["train.precision=bf16"])  # fp32 generator
    model, _ = load_model(warm_model_dir)
    assert SnapshotStore.of(cfg, model).rounded == frozenset()  # auto keeps fp32 there


class _Engine:
    """What a worker's engine keeps: the state dict it was last handed, copied."""

    def __init__(self):
        self.loaded: dict[int, dict[str, torch.Tensor]] = {}

    def load_weights(self, state_dict, version):
        self.loaded[version] = {k: t.clone() for k, t in state_dict.items()}


def _subscriber(q, out, wait_for: list[int]) -> None:
    torch.set_num_threads(1)
    sub = WeightSubscriber(q, _Engine())
    for v in wait_for:
        sub.wait_for(v, timeout=120)
    # As bytes: tensors would go by file descriptor, which dies with this process.
    out.put({v: {k: t.contiguous().view(torch.uint8).numpy() for k, t in sd.items()}
             for v, sd in sub.engine.loaded.items()})


def test_delta_publish_reaches_a_worker_process_bit_for_bit(warm_model_dir):
    """A real spawned worker: version 0 whole, then deltas; it loads the newest, 4 (the
    ones between it must still apply), equal to the trainer's bit for bit, and each delta
    costs fewer bytes than a whole version."""
    model, _ = load_model(warm_model_dir)
    ctx = multiprocessing.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    pub = SharedMemoryPublisher([q], delta=True, bucket_bytes=1 << 16)
    sent, sizes = {}, []
    for v, sd in enumerate(_steps(model, 5, lr=1e-4)):
        sent[v] = {k: t.clone() for k, t in sd.items()}
        pub.publish(v, sd)
        sizes.append(pub.last_bytes)
    p = ctx.Process(target=_subscriber, args=(q, out, [4]))
    p.start()
    loaded = out.get(timeout=180)
    p.join(timeout=30)
    assert max(loaded) == 4
    assert all(torch.equal(torch.from_numpy(loaded[v][k]), sent[v][k].view(torch.uint8))
               for v in loaded for k in sent[v])
    assert sizes[0] == pack(0, sent[0]).buffer.numel() and max(sizes[1:]) < sizes[0] / 1.2


class _ListQueue:
    """A weight queue in this process (the order of puts is all this test needs)."""

    def __init__(self):
        self.items = []

    def put(self, x):
        self.items.append(x)

    def get_nowait(self):
        if not self.items:
            raise queue_lib.Empty
        return self.items.pop(0)


def test_a_delta_that_does_not_follow_is_refused():
    q = _ListQueue()
    pub = SharedMemoryPublisher([q], delta=True)
    pub.publish(0, {"w": torch.ones(8)})
    pub.publish(1, {"w": torch.full((8,), 2.0)})
    q.items.pop(0)  # the worker never saw version 0
    with pytest.raises(RuntimeError, match="does not apply"):
        WeightSubscriber(q, _Engine()).poll()
