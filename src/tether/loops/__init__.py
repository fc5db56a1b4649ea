"""The training loops: `loop.mode=sync` (tether.loops.sync_loop) or `async`
(tether.loops.async_loop), both around one shared step (tether.step) inside one skeleton
(tether.loops.skeleton: start, end-of-step tail, teardown)."""

from __future__ import annotations

import os
from pathlib import Path

from tether.config import Config
from tether.errors import EnvironmentFault, environment_fault
from tether.run import RunResult, discard_unstarted, with_run_dir


def train(cfg: Config, resume: bool = False) -> RunResult:
    """Run RL as `cfg` says; `resume`: continue the run in run.dir from its last checkpoint.

    A new run that fails before its first step ends leaves nothing in run.dir that would
    block the same command (tether.run.discard_unstarted). An OSError the machine causes (a
    full disk, a read-only path) comes out as `EnvironmentFault`, naming the path."""
    cfg = with_run_dir(cfg)
    run_dir = Path(cfg.run.dir)
    before = set(os.listdir(run_dir)) if run_dir.is_dir() else None
    try:
        if cfg.loop.mode == "async":
            from tether.loops.async_loop import train_async

            return train_async(cfg, resume)
        from tether.loops.sync_loop import train_sync

        return train_sync(cfg, resume)
    except BaseException as e:
        kept = resume or discard_unstarted(run_dir, before)
        if fault := environment_fault(e, f"{run_dir} (the run directory)"):
            then = (f"`tether train --resume {run_dir}` continues from its last checkpoint"
                    if kept else "run the same command again")
            raise EnvironmentFault(f"{fault}; once that is fixed, {then}") from e
        raise
