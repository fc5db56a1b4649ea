"""The training loops: `loop.mode=sync` (tether.loops.sync_loop) or `async`
(tether.loops.async_loop), both around one shared step (tether.step) inside one skeleton
(tether.loops.skeleton: start, end-of-step tail, teardown)."""

from __future__ import annotations

from tether.config import Config
from tether.run import RunResult


def train(cfg: Config, resume: bool = False) -> RunResult:
    """Run RL as `cfg` says; `resume`: continue the run in run.dir from its last checkpoint."""
    if cfg.loop.mode == "async":
        from tether.loops.async_loop import train_async

        return train_async(cfg, resume)
    from tether.loops.sync_loop import train_sync

    return train_sync(cfg, resume)
