"""The trainer's ranks: `train.world_size` = N processes, each training on its shard of every
mini-batch, with the loss and gradient of the whole mini-batch.

Rank 0 is the driver's own `Trainer` (it logs, publishes and checkpoints as with one
process), handed `TrainerRanks` as its collective; ranks 1..N-1 are processes
(`torch.multiprocessing`, spawn) on this machine, each handed a `RankView`. They meet in
torch.distributed (`train.dist_backend`: gloo on CPU; nccl where the trainer's weights are
on a GPU), and rank 0's work reaches them through it too (`Channel`: a step's batch, or a
call), never through host memory. Two ways to hold the model (`train.sharding`):

- none: every rank holds a copy of the model (placed with `run.device`, tether.setup) and
  optimizer, started from rank 0's state; every rank applies the same summed gradient
  with the same optimizer, so the copies stay equal (DDP without its averaging).
- fsdp: every rank holds an FSDP2 shard of the model, its gradients, moments and kept
  versions (tether.trainer.sharding); whatever reads the weights runs on all of them
  together (`TrainerRanks.call`, tether.trainer.spmd).

The whole batch's gradient, not the mean of the ranks' (tether.trainer.core.Trainer._step):
each rank scales its loss by its share of the mini-batch under the estimator's
aggregation, with the denominator counted over *all* ranks: token-mean divides by the
global number of response tokens (all-reduced first), the sequence means by the global
number of sequences. The ranks' gradients are then summed (replicated: one all-reduce of a
flat buffer; sharded: FSDP's reduce-scatter, as a sum). The mean of per-rank token-means
would weight each rank's tokens by 1 / its own count, a different, length-biased loss.

A rank that dies makes rank 0's next collective fail: `RankFailed` names it, and the loop
stops with a checkpoint (replicated) or names the last one (sharded; docs/distributed.md).
"""

from __future__ import annotations

import os
import queue as queue_lib
import signal
import socket
import sys
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.config import Config
from tether.errors import EnvironmentFault, InputError, RankFailed
from tether.models import quiet_transformers
from tether.setup import build_task_and_reward, configure_numerics, load_policy, resolve_device
from tether.tasks.base import Task
from tether.trainer import Trainer
from tether.trainer.channel import Channel, on_device
from tether.trainer.spmd import RankContext, rank_context

TIMEOUT = timedelta(minutes=5)  # a collective waiting this long for a rank fails


class RankView:
    """A rank's `Collective` (tether.trainer.collective): which rows of a mini-batch are its
    own, and the collectives of torch.distributed. Ranks 1..N-1 use it as it is."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def begin(self, *work: Any) -> None:
        pass

    def failed(self, cause: Exception, intact: bool) -> None:
        raise cause

    def rows(self, start: int, n: int) -> slice:
        """This rank's contiguous share of rows start..start+n (n divisible by world_size)."""
        k = n // self.world_size
        return slice(start + self.rank * k, start + (self.rank + 1) * k)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().clone()
        dist.all_reduce(x)
        return x

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small Python values: metrics, a guard's verdict)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' (equal-shaped) tensors along dim 0, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients over ranks in place (one flat buffer). A parameter without a
        gradient on this rank (an MoE expert no token of its shard reached) counts as zero;
        one without a gradient on every rank keeps none, as with one process."""
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                           device=params[0].device)  # nccl reduces only GPU tensors
        dist.all_reduce(has)
        live = [p for p, h in zip(params, has.tolist()) if h]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in live])
        dist.all_reduce(flat)
        offset = 0
        for p in live:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def resolve_backend(requested: str, params_on_gpu: bool) -> str:
    """`train.dist_backend`: auto -> nccl when the trainer's weights are on a GPU, else gloo."""
    if requested == "auto":
        return "nccl" if params_on_gpu else "gloo"
    if requested == "nccl" and not params_on_gpu:
        raise ValueError("train.dist_backend=nccl needs the trainer's weights on a GPU; tether's "
                         "trainer runs on CPU here: use gloo (or auto)")
    return requested


class TrainerRanks(RankView):
    """Rank 0's collective: ranks 1..N-1 as processes, joined in one process group with
    rank 0. `begin` sends them each step's batch, `call` any other work (sharded: everything
    that reads the weights, tether.trainer.spmd), `stop` ends them. `ctx`: rank 0's own
    RankContext, set once its trainer exists."""

    def __init__(self, cfg: Config, model_path: str | Path, device: torch.device):
        W = cfg.train.world_size
        super().__init__(0, W)
        backend = resolve_backend(cfg.train.dist_backend, device.type == "cuda")
        self.procs: list[Any] = []
        self.closed = False
        if launched() is not None:  # torchrun started every rank, on any machine: its env joins them
            init = "env://"
        else:  # ranks 1..N-1: processes of this one
            init = f"tcp://127.0.0.1:{_free_port()}"
            ctx = torch.multiprocessing.get_context("spawn")
            joining = ctx.Queue()  # each rank's number, just before it joins the process group
            self.procs = [ctx.Process(target=_rank_main, daemon=True, name=f"tether-rank-{r}",
                                      args=(r, W, backend, init, cfg, joining))
                          for r in range(1, W)]
            for p in self.procs:
                p.start()
            self._await_joining(joining, cfg.run.start_timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # nccl's collectives (all_gather_object) use it
        dist.init_process_group(backend, init_method=init, rank=0, world_size=W, timeout=TIMEOUT)
        self.channel = Channel()
        self.channel.send(str(model_path))  # every rank loads the model rank 0 resolved
        self.device = str(device)
        self.ctx: RankContext | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(ctx, *args)` on every rank together (each its own RankContext); rank 0's result.
        A collective in it that fails raises `RankFailed` (the weights intact: no call but
        the training step's changes them)."""
        self.check(intact=True)
        try:
            self.channel.send((fn, args))
            return fn(self.ctx, *args)
        except RuntimeError as e:  # a collective failed: a rank is likely gone
            self.failed(e, intact=True)

    def _await_joining(self, joining: Any, timeout: float) -> None:
        """Every rank about to join within `timeout` seconds; else end them all and raise an
        EnvironmentFault naming the ranks that died or never came (the process group itself
        would wait for them for minutes)."""
        deadline, joined = time.monotonic() + timeout, set()
        while len(joined) < len(self.procs):
            dead = self._dead(skip=joined)
            late = time.monotonic() >= deadline
            if dead or late:
                for p in self.procs:
                    p.kill()
                    p.join()
                missing = sorted(set(range(1, self.world_size)) - joined)
                raise EnvironmentFault(
                    f"trainer {', '.join(dead)} exited before joining the process group (its "
                    "error is above)" if dead else
                    f"join: trainer rank(s) {missing} did not start within {timeout:g} s "
                    "(run.start_timeout): the process did not reach the process group (its model "
                    "load comes after and is not counted); the machine may be overloaded; raise "
                    "run.start_timeout or lower train.world_size")
            try:
                joined.add(joining.get(timeout=0.5))
            except queue_lib.Empty:
                pass

    def _dead(self, skip: Collection[int] = ()) -> list[str]:
        """'rank R (exit code C)' for each rank process that has ended, but those in `skip`."""
        return [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1)
                if r not in skip and not p.is_alive()]

    @property
    def devices(self) -> list[str]:
        """Where each rank placed its model, in rank order (asked of every rank: waits for
        ranks still loading)."""
        return self.call(placement)

    def begin(self, *work: Any) -> None:
        """Hand the other ranks this step's (estimator spec, batch, advantages, logp_old,
        topk_logp_old)."""
        self.check(intact=True)
        try:
            self.channel.send((train, work))
        except RuntimeError as e:  # a rank on another machine is gone (none of ours died)
            self.failed(e, intact=True)

    def failed(self, cause: Exception, intact: bool) -> None:
        self.check(intact, cause)

    def check(self, intact: bool, cause: Exception | None = None) -> None:
        """Raise `RankFailed` naming the ranks whose process is gone (or, with `cause`, the
        collective that failed, when none is gone yet)."""
        deadline = time.monotonic() + (5.0 if cause is not None else 0.0)
        while True:  # a collective can fail a moment before the dead rank's exit is seen
            dead = self._dead()
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if dead or cause is not None:
            self.abort()
        if dead:
            raise RankFailed(f"trainer {', '.join(dead)} died", intact)
        if cause is not None:
            raise RankFailed(f"a trainer collective failed: {cause}", intact) from cause

    def abort(self) -> None:
        """End the surviving ranks and leave the process group (a resume starts anew)."""
        self.closed = True
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        dist.destroy_process_group()

    def stop(self) -> None:
        """End the other ranks after their step; leave the process group (once)."""
        if self.closed:
            return
        self.closed = True
        self.channel.send(None)
        for p in self.procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.terminate()
        dist.destroy_process_group()


class OneRank:
    """`train.world_size=1`, not sharded: no other ranks; stopping them is nothing (keeps the
    loops free of `if world_size > 1`)."""

    def stop(self) -> None:
        pass


def start_ranks(trainer: Trainer, cfg: Config, model_path: str | Path) -> TrainerRanks | OneRank:
    """Replicated (`train.sharding=none`) with `train.world_size` > 1: start the other ranks
    from `trainer`'s state and hand it their collective (it becomes rank 0)."""
    if cfg.train.world_size == 1:
        return OneRank()
    ranks = TrainerRanks(cfg, model_path, next(trainer.model.parameters()).device)
    ranks.channel.send(trainer.state_dict())  # every rank starts from rank 0's weights and moments
    ranks.ctx = RankContext(cfg, trainer, None, trainer.sampling)
    trainer.attach(ranks)
    return ranks


def start_sharded(cfg: Config, model_path: str | Path, model: PreTrainedModel,
                  tokenizer: PreTrainedTokenizerBase, task: Task, reward_fn: Any,
                  device: torch.device) -> TrainerRanks:
    """`train.sharding=fsdp`: the other ranks started (each loads the model from `model_path`
    as rank 0 did), then `model` (in host memory) sharded over all of them onto `device`,
    and rank 0's trainer built on it: `ranks.ctx.trainer`."""
    ranks = TrainerRanks(cfg, model_path, device)
    ranks.ctx = rank_context(cfg, model, tokenizer, ranks, task, reward_fn, device)
    return ranks


def launched() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) of a process torchrun started (its environment holds
    TORCHELASTIC_RUN_ID), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def follow(cfg: Config) -> None:
    """A trainer rank > 0 that torchrun started (on any machine): join rank 0 through
    torchrun's environment, then serve it until the run ends. A GPU is the local rank's."""
    where = launched()
    assert where is not None
    rank, world_size, local_rank = where
    quiet_transformers()
    configure_numerics(cfg)
    device = resolve_device(cfg.run.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before the process group: nccl binds to it
    backend = resolve_backend(cfg.train.dist_backend, device.type == "cuda")
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    _serve(cfg, RankView(rank, world_size), device)


def _rank_main(rank: int, world_size: int, backend: str, init: str, cfg: Config,
               joining: Any) -> None:
    """A trainer rank > 0 that rank 0 spawned on its machine: join, then serve it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 finishes the step, then stops us
    quiet_transformers()
    configure_numerics(cfg)
    device = rank_device(resolve_device(cfg.run.device), rank, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group: nccl binds to it
    joining.put(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    _serve(cfg, RankView(rank, world_size), device)


def _serve(cfg: Config, view: RankView, device: torch.device) -> None:
    """A rank > 0 in the process group: the model rank 0 names, on `device` (replicated:
    rank 0's state, sent; sharded: its shards of the model it loaded), then whatever rank 0
    sends, a training step's batch or a call (tether.trainer.spmd), until it sends None."""
    channel = Channel()  # each rank makes its groups in rank 0's order
    model_path = channel.recv()
    sharded = cfg.train.sharding == "fsdp"
    # Sharded, the whole model is loaded in host memory and only this rank's shards reach
    # the device.
    _, model, tokenizer = load_policy(cfg, model_path, torch.device("cpu") if sharded else device)
    print(f"tether: trainer rank {view.rank} ready on {device}", file=sys.stderr, flush=True)
    task, reward_fn = build_task_and_reward(cfg) if sharded else (None, None)
    ctx = rank_context(cfg, model, tokenizer, view, task, reward_fn, device)
    if not sharded:
        ctx.trainer.load_state_dict(on_device(channel.recv(), device))
    while (item := channel.recv()) is not None:
        fn, args = item
        fn(ctx, *on_device(args, device))
    dist.destroy_process_group()


def placement(ctx: RankContext) -> list[str]:
    """Every rank's device, in rank order (`TrainerRanks.devices`)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, str(next(ctx.trainer.model.parameters()).device))
    return out


def train(ctx: RankContext, spec: Any, *work: Any) -> None:
    """A training step on a rank > 0 (`TrainerRanks.begin`), with rank 0's estimator."""
    ctx.trainer.use(spec)
    ctx.trainer.train_on(*work)


def rank_device(device: torch.device, rank: int, gpus: int) -> torch.device:
    """Where trainer rank `rank` places its model when rank 0's is on `device`: the CPU for
    every rank, or one GPU each, rank r on the r-th GPU after rank 0's (cuda:N -> cuda:N+r).
    InputError when there are not that many GPUs (`gpus`: how many torch sees)."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= gpus:
        raise InputError(
            f"train.world_size: trainer rank {rank} needs cuda:{index} (one GPU per rank, "
            f"from run.device={device}), and torch sees {gpus} GPU(s); lower train.world_size "
            "or start from a lower run.device")
    return torch.device("cuda", index)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
