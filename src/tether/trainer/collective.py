"""What a trainer needs from the other trainer ranks: the `Collective` it is handed.

With one process it is `Solo`, where every collective is the identity. Data-parallel
(`train.world_size` > 1), tether.distributed hands rank 0 the driver of the other ranks
and each other rank its own view; the trainer calls the same methods either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class Collective(Protocol):
    rank: int
    world_size: int

    def rows(self, start: int, n: int) -> slice:
        """This rank's contiguous share of rows start..start+n (n divisible by world_size)."""
        ...

    def begin(self, *work: Any) -> None:
        """A training step starts on `work` (the estimator's spec, batch, advantages, logp_old,
        topk_logp_old): rank 0 hands it to the other ranks; elsewhere nothing."""
        ...

    def failed(self, cause: Exception, intact: bool) -> None:
        """A collective of the step raised `cause`: raise what the run should stop with
        (tether.errors.RankFailed on rank 0 when a rank is gone; `intact`: no optimizer step
        of it ran yet)."""
        ...

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over ranks (a copy)."""
        ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Rank 0 of a sharded trainer: `fn(ctx, *args)` on every rank together, each on its
        own RankContext (tether.trainer.spmd); rank 0's result."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small Python values), in rank order."""
        ...

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' equal-shaped tensors concatenated along dim 0, in rank order."""
        ...

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the parameters' gradients over ranks, in place."""
        ...


class Solo:
    """One trainer process: every row is its own and every collective is the identity."""

    rank, world_size = 0, 1

    def rows(self, start: int, n: int) -> slice:
        return slice(start, start + n)

    def begin(self, *work: Any) -> None:
        pass

    def failed(self, cause: Exception, intact: bool) -> None:
        raise cause

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        pass
