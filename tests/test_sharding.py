"""FSDP2 primitives on two gloo ranks (tether.trainer.sharding): a sharded forward equals the
whole model's bit for bit, a kept version swapped in scores as that version's whole model,
and the whole tensors gathered onto one rank are the model's."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tether.models import build_tiny_model

W = 2


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(2, 21, (4, 16), generator=g)


def _rank(rank: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=W)
    for moe in (False, True):  # one pair of processes for both: their start is the cost
        got = _check(build_tiny_model(21, moe=moe, seed=0).eval(), rank)
        if rank == 0:
            out[moe] = got
    # Tear gloo down together: a rank that leaves while its peer still writes to the manager
    # aborted once in CI ("terminate called without an active exception", SIGABRT).
    dist.barrier()
    dist.destroy_process_group()


def _check(model: torch.nn.Module, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tether.trainer.sharding import (
        VersionSwap,
        gather_full,
        local_shards,
        resharded,
        shard_model,
    )

    ids = _batch()
    v0 = {k: t.clone() for k, t in model.state_dict().items()}
    shard_model(model, init_device_mesh("cpu", (W,)))
    with torch.no_grad():
        at_v0 = model(ids).logits
    resharded(model)
    kept = {k: t.clone() for k, t in local_shards(model).items()}
    with torch.no_grad():  # move the weights: the kept version must still score as v0
        for t in local_shards(model).values():
            t.add_(0.01)
        moved = model(ids).logits
        swap = VersionSwap(model)
        swapped_logits = swap.load(kept)(ids).logits
        swap.restore()
        after = model(ids).logits
    whole = gather_full(model, keep=rank == 0)
    return {"at_v0": at_v0, "moved": moved, "swapped": swapped_logits, "after": after, "v0": v0,
            "whole": whole, "tied": model.lm_head.weight is model.model.embed_tokens.weight}


@pytest.fixture(scope="module")
def ranks_saw() -> dict:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_rank, args=(port, out), nprocs=W, start_method="spawn")
        return dict(out)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_sharded_forward_kept_versions_and_gather_are_exact(moe, ranks_saw):
    got = ranks_saw[moe]
    whole = build_tiny_model(21, moe=moe, seed=0).eval()
    with torch.no_grad():
        expected = whole(_batch()).logits
    assert torch.equal(got["at_v0"], expected)  # the all-gather is an exact copy
    assert torch.equal(got["swapped"], expected)  # a kept version scores as that version
    assert not torch.equal(got["moved"], expected)
    assert torch.equal(got["after"], got["moved"])  # and the current shards come back
    assert got["tied"]
    gathered = got["whole"]
    for name, p in whole.named_parameters():
        assert torch.equal(gathered[name], got["v0"][name] + 0.01), name
