"""What the trainer ranks run together when the weights are sharded (`train.sharding=fsdp`).

No rank holds the whole model, so anything that reads the trainer's weights is a collective:
rank 0 (the driver) asks with `TrainerRanks.call(fn, *args)` (tether.distributed), every
rank runs `fn(ctx, *args)` on its own `RankContext`, and rank 0 keeps its own result. The
functions here are those `fn`s, module-level so that a name crosses the wire, not code:

    keep / release   kept versions (pi_old, lagged deliveries): each rank keeps its own shard
                     of every version, in the `SnapshotStore` forms (`weights.*`), so their
                     memory divides by the world size too
    score_old        pi_old at the versions that sampled each token: the whole batch on every
                     rank, each kept version's shards put into the module for its forward
                     (`VersionSwap`); equal to the replicated trainer's pi_old bit for bit
    gather           the whole weights of the current or a kept version on rank 0, parameter
                     by parameter (publishing, export)
    evaluate         the held-out evaluation, every rank generating the same tokens
    save / load      the weights, moments and kept versions in torch.distributed.checkpoint
                     (DCP) form: each rank writes its shards, and a load at another world
                     size reshards them

`ShardedSnapshots` is rank 0's face of the kept versions: the `SnapshotStore` interface the
loops and checkpoints already use, each operation asked of every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.config import Config
from tether.evaluate import heldout_metrics
from tether.rollout.types import SamplingParams
from tether.scoring import RolloutTensors
from tether.scoring.versions import score_at_versions
from tether.setup import sampling_params
from tether.tasks.base import Task
from tether.trainer.collective import Collective
from tether.trainer.core import Trainer
from tether.trainer.sharding import VersionSwap, gather_full, local_shards, resharded, shard_model
from tether.weights.snapshots import SnapshotStore


@dataclass
class RankContext:
    """One trainer rank's parts: its trainer, and under fsdp its shards of the kept versions
    and what the held-out evaluation needs (every rank evaluates together)."""

    cfg: Config
    trainer: Trainer
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    task: Task | None = None
    reward_fn: Any = None
    kept: SnapshotStore | None = None

    @property
    def rank(self) -> int:
        return self.trainer.collective.rank


def rank_context(cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 collective: Collective | None = None, task: Task | None = None,
                 reward_fn: Any = None, device: torch.device | None = None) -> RankContext:
    """A rank's trainer on `model`. `train.sharding=fsdp`: `model` sharded over the process
    group first (every rank at once), its shards moved to `device` (default: where `model`
    is; FSDP2 moves one unit at a time, so the device never holds the whole model), with a
    store for this rank's shards of kept versions."""
    kept = None
    if cfg.train.sharding == "fsdp":
        device = device or next(model.parameters()).device
        kept = SnapshotStore.of(cfg, model)  # before sharding: finding its bf16 names runs a forward
        shard_model(model, init_device_mesh(device.type, (dist.get_world_size(),)))
    trainer = Trainer(model, cfg.train, sampling_params(cfg, model.config.vocab_size))
    if collective is not None:
        trainer.attach(collective)
    return RankContext(cfg, trainer, tokenizer, trainer.sampling, task, reward_fn, kept)


class Asker(Protocol):
    def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


def keep(ctx: RankContext, version: int) -> None:
    """Keep this rank's shards of the current weights as `version`."""
    assert ctx.kept is not None
    ctx.kept.put(version, local_shards(ctx.trainer.model))


def release(ctx: RankContext, versions: set[int]) -> list[int]:
    assert ctx.kept is not None
    return ctx.kept.release(versions)


def score_old(ctx: RankContext, batch: RolloutTensors,
              ) -> tuple[torch.Tensor, torch.Tensor | None, RolloutTensors]:
    """`score_at_versions` of the whole batch, each version's shards in the module for its
    forward (the current weights for the current version); the current ones back after."""
    trainer, kept = ctx.trainer, ctx.kept
    assert kept is not None
    swap = VersionSwap(trainer.model)
    model_at = lambda v: trainer.model if v == trainer.version else swap.load(kept.state(v))
    try:
        return score_at_versions(trainer, batch, model_at)
    finally:
        resharded(trainer.model)
        swap.restore()


def gather(ctx: RankContext, version: int | None = None) -> dict[str, torch.Tensor] | None:
    """The whole state dict (fp32; a tied weight under each of its names) of `version` (None:
    the current weights) on rank 0; None elsewhere."""
    trainer, kept = ctx.trainer, ctx.kept
    assert kept is not None
    swap = VersionSwap(trainer.model)
    if version is not None and version != trainer.version:
        swap.load(kept.state(version))
    try:
        whole = gather_full(trainer.model, keep=ctx.rank == 0)
    finally:
        swap.restore()
    if ctx.rank != 0:
        return None
    owner = {id(p): name for name, p in trainer.model.named_parameters()}
    return {name: whole[owner[id(t)]] if id(t) in owner else t.detach()  # buffers: whole on every rank
            for name, t in trainer.model.state_dict(keep_vars=True).items()}


def evaluate(ctx: RankContext) -> dict[str, float]:
    """The held-out evaluation (tether.evaluate.heldout_metrics) at the current weights."""
    assert ctx.task is not None
    try:
        return heldout_metrics(ctx.trainer.model, ctx.tokenizer, ctx.task, ctx.reward_fn,
                               ctx.sampling, ctx.cfg)
    finally:
        resharded(ctx.trainer.model)


def export(ctx: RankContext, path: Path) -> None:
    """The trained model as a Hugging Face directory (safetensors), written by rank 0 from the
    gathered weights."""
    whole = gather(ctx)
    if whole is not None:
        ctx.trainer.model.save_pretrained(path, state_dict=whole)  # a tied head saved once


def save(ctx: RankContext, path: Path, versions: list[int]) -> None:
    """Write this rank's shards (weights, AdamW moments, kept `versions`) into `path` (DCP)."""
    dcp.save(_state(ctx, versions, kept=True), checkpoint_id=path)


def load(ctx: RankContext, path: Path, versions: list[int], counters: dict[str, Any]) -> None:
    """Read the shards `save` wrote, at this run's world size (DCP reshards), into the
    model, the optimizer and the kept versions; the trainer's `counters` (its version, which
    says which kept version is the current weights, and the guard's) on every rank."""
    trainer, kept = ctx.trainer, ctx.kept
    assert kept is not None
    trainer.load_counters(counters)
    state = _state(ctx, versions, kept=False)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    kept.release(set())
    for v in versions:
        kept.put(v, {name: t.to_local() if isinstance(t, DTensor) else t
                     for name, t in state["kept"][str(v)].items()})


def _state(ctx: RankContext, versions: list[int], kept: bool) -> dict[str, Any]:
    """DCP's view of this rank's state: the model and optimizer as sharded state dicts, and
    each kept version as DTensors laid out as the parameters (from the kept shards, or
    empty ones to load into)."""
    trainer, store = ctx.trainer, ctx.kept
    assert store is not None
    resharded(trainer.model)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    params = dict(trainer.model.named_parameters())

    def laid_out(name: str, local: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        p = params[name]
        if not isinstance(p, DTensor):
            return local if local is not None else torch.empty_like(p, dtype=dtype)
        if local is None:
            local = torch.empty_like(p.to_local(), dtype=dtype)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())

    versions_sd: dict[str, dict[str, torch.Tensor]] = {}
    for v in versions:
        shards = store.state(v) if kept else None
        versions_sd[str(v)] = {
            name: laid_out(name, None if shards is None else shards[name],
                           torch.bfloat16 if name in store.rounded else params[name].dtype)
            for name in params}
    return {"model": model_sd, "optim": optim_sd, "kept": versions_sd}


class ShardedSnapshots:
    """Rank 0's kept versions under fsdp: the `SnapshotStore` interface, each operation on
    every rank's own store of shards. Bookkeeping (which versions, bytes) is rank 0's store,
    which every rank's mirrors; the bytes are one rank's, the memory per rank."""

    def __init__(self, ranks: Asker, local: SnapshotStore):
        self.ranks, self.local = ranks, local

    def put(self, version: int, state_dict: Any = None) -> None:
        """Keep the current weights as `version` (every rank its shards; `state_dict`, the
        whole weights the replicated store copies, is not needed)."""
        if version not in self.local:
            self.ranks.call(keep, version)

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """`version`'s whole weights, gathered on rank 0 (for a delivery to the generator)."""
        return self.ranks.call(gather, version)

    def release(self, keep: set[int]) -> list[int]:
        if not set(self.local.versions) - keep:
            return []
        return self.ranks.call(release, keep)

    def pi_old(self, trainer: Trainer, batch: RolloutTensors,
               ) -> tuple[torch.Tensor, torch.Tensor | None, RolloutTensors]:
        return self.ranks.call(score_old, batch)

    def model_at(self, version: int) -> None:
        """No rank holds a whole model at a kept version: the diagnostics that would read one
        (routing, the R3 replay-off forward) are off under fsdp (tether.loops.skeleton)."""
        return

    def __len__(self) -> int:
        return len(self.local)

    def __contains__(self, version: int) -> bool:
        return version in self.local

    @property
    def versions(self) -> list[int]:
        return self.local.versions

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def metrics(self, freed: list[int]) -> dict[str, float]:
        return self.local.metrics(freed)


class ShardedCheckpoint:
    """A checkpoint's sharded part (tether.checkpoint.Shards), each rank its own shards."""

    def __init__(self, ranks: Asker):
        self.ranks = ranks

    def save(self, path: Path, versions: list[int]) -> None:
        self.ranks.call(save, path, versions)

    def load(self, path: Path, versions: list[int], counters: dict[str, Any]) -> None:
        self.ranks.call(load, path, versions, counters)


class Gathered(Mapping[str, torch.Tensor]):
    """The current whole weights as a state dict, gathered from the ranks when first read:
    the loops hand the weights to the synchronizer every step, which reads them only on the
    steps it delivers them."""

    def __init__(self, ranks: Asker):
        self.ranks = ranks
        self._whole: dict[str, torch.Tensor] | None = None

    def _get(self) -> dict[str, torch.Tensor]:
        if self._whole is None:
            self._whole = self.ranks.call(gather)
        return self._whole

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())
