"""A data-parallel trainer: `train.world_size` = N ranks, each training on its shard of every
mini-batch, with the loss and gradient of the whole mini-batch.

Rank 0 is the driver's own `Trainer` (it scores pi_old, logs, publishes and checkpoints as
with one process), handed `TrainerRanks` as its collective; ranks 1..N-1 are processes
(`torch.multiprocessing`, spawn) holding a copy of the model (placed with `run.device`,
tether.setup) and optimizer, each handed a `RankView`, fed each step's batch through a
queue. They meet in torch.distributed (`train.dist_backend`: gloo on CPU; nccl where the
trainer's weights are on a GPU). Every rank starts from rank 0's state and applies the
same summed gradient with the same optimizer, so the copies stay equal.

The whole batch's gradient, not the mean of the ranks' (tether.trainer.core.Trainer._step):
each rank scales its loss by its share of the mini-batch under the estimator's
aggregation, with the denominator counted over *all* ranks: token-mean divides by the
global number of response tokens (all-reduced first), the sequence means by the global
number of sequences. The ranks' gradients are then summed (one all-reduce of a flat
buffer: DDP's all-reduce without its averaging). The mean of per-rank token-means would
weight each rank's tokens by 1 / its own count, a different, length-biased loss.

A rank that dies makes rank 0's next collective fail: `RankFailed` names it, and the loop
stops with a checkpoint (docs/distributed.md).
"""

from __future__ import annotations

import copy
import dataclasses
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

from tether.config import Config
from tether.errors import EnvironmentFault, InputError, RankFailed
from tether.models import quiet_transformers
from tether.rollout.worker import next_or_orphaned
from tether.setup import configure_numerics, load_policy, resolve_device, sampling_params
from tether.trainer import Trainer

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
    """Rank 0's collective: ranks 1..N-1 as processes, started from `state` (rank 0's
    trainer state). `begin` sends them each step's batch, `stop` ends them."""

    def __init__(self, state: dict[str, Any], cfg: Config, model_path: str | Path,
                 device: torch.device):
        W = cfg.train.world_size
        super().__init__(0, W)
        backend = resolve_backend(cfg.train.dist_backend, device.type == "cuda")
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = torch.multiprocessing.get_context("spawn")
        self.queues = [ctx.Queue() for _ in range(W - 1)]
        self.placed = ctx.Queue()  # (rank, device) from each rank once its model is placed
        joining = ctx.Queue()  # each rank's number, just before it joins the process group
        self.procs = [ctx.Process(target=_rank_main, daemon=True, name=f"tether-rank-{r}",
                                  args=(r, W, backend, init, cfg, str(model_path),
                                        self.queues[r - 1], self.placed, joining, os.getpid()))
                      for r in range(1, W)]
        for p in self.procs:
            p.start()
        self.closed = False
        self._await_joining(joining, cfg.run.start_timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # nccl's collectives (all_gather_object) use it
        dist.init_process_group(backend, init_method=init, rank=0, world_size=W, timeout=TIMEOUT)
        state = _shared(state)  # each rank moves it to its own device
        for q in self.queues:
            q.put(state)  # every rank starts from rank 0's weights and optimizer moments
        self.device, self._devices = str(device), None

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
        """Where each rank placed its model, in rank order (waits for ranks still loading;
        asked for, not awaited at start-up, so rank 0 goes on while they load)."""
        if self._devices is None:
            got = dict(self.placed.get(timeout=TIMEOUT.total_seconds()) for _ in self.procs)
            self._devices = [self.device, *(got[r] for r in range(1, self.world_size))]
        return self._devices

    def begin(self, *work: Any) -> None:
        """Hand the other ranks this step's (batch, advantages, logp_old, topk_logp_old)."""
        self.check(intact=True)
        work = _shared(work)
        for q in self.queues:
            q.put(work)

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
        for q in self.queues:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10.0)
            if p.is_alive():
                p.terminate()
        dist.destroy_process_group()


class OneRank:
    """`train.world_size=1`: no other ranks; stopping them is nothing (keeps the loops free
    of `if world_size > 1`)."""

    def stop(self) -> None:
        pass


def start_ranks(trainer: Trainer, cfg: Config, model_path: str | Path) -> TrainerRanks | OneRank:
    """With `train.world_size` > 1, start the other ranks from `trainer`'s state and hand
    it their collective (it becomes rank 0)."""
    if cfg.train.world_size == 1:
        return OneRank()
    ranks = TrainerRanks(trainer.state_dict(), cfg, model_path,
                         next(trainer.model.parameters()).device)
    trainer.attach(ranks)
    return ranks


def _rank_main(rank: int, world_size: int, backend: str, init: str, cfg: Config,
               model_path: str, work: Any, placed: Any, joining: Any, parent_pid: int) -> None:
    """A trainer rank > 0: the model on `run.device` and the optimizer, then one `train_on`
    per batch sent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: rank 0 finishes the step, then stops us
    quiet_transformers()
    configure_numerics(cfg)
    device = rank_device(resolve_device(cfg.run.device), rank, torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the process group: nccl binds to it
    joining.put(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    _, model, _ = load_policy(cfg, model_path, device)
    placed.put((rank, str(device)))  # TrainerRanks.devices
    print(f"tether: trainer rank {rank} ready on {device}", file=sys.stderr, flush=True)
    trainer = Trainer(model, cfg.train, sampling_params(cfg, model.config.vocab_size))
    trainer.attach(RankView(rank, world_size))
    # A copy of its own: the queue hands over rank 0's tensors in shared memory, and the
    # optimizer keeps loaded moments without copying them, so a resumed run's ranks would
    # otherwise update one set of Adam moments (and step counts) in place, twice a step.
    trainer.load_state_dict(on_device(copy.deepcopy(work.get()), device))
    while (item := next_or_orphaned(work, parent_pid)) is not None:
        trainer.train_on(*on_device(item, device))
    dist.destroy_process_group()


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


def on_device(obj: Any, device: torch.device | str) -> Any:
    """`obj` with every tensor in it on `device` (tensors already there are kept, not copied)."""
    return _map_tensors(obj, lambda t: t.to(device))


def _shared(obj: Any) -> Any:
    """`obj` with every tensor in it in host shared memory, moved there now, in this thread.

    Host memory: a CUDA tensor would reach another rank as a handle to this rank's GPU,
    valid only while this rank keeps it, and on the wrong device for them. Now: a
    torch.multiprocessing queue would otherwise move a CPU tensor in its feeder thread,
    after `put` returns: the storage is replaced in place and the old one freed while this
    thread may still be reading it (seen: a segfault in a matmul of the evaluation that
    follows `start_ranks`)."""
    return _map_tensors(obj, lambda t: t.to("cpu").share_memory_())


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` (tensors in dicts, lists, tuples, dataclasses) with `fn` applied to each tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
