"""What both loops do around their steps, written once: start, the end-of-step tail,
teardown. Each loop (sync_loop, async_loop) is then only its own step.

    with Session(run, state, resume, close=[...], on_stop=..., correction=...) as s:
        for step in s.steps():          # step 0's evaluation first; then until train.steps
            ...                         # the loop's step (tether.step)
            s.end_step(row)             # evaluate, log, progress, stop or checkpoint
        return s.finish()               # the final evaluation; the trained model saved

The session restores the last checkpoint (resume), opens the metric log, starts the
data-parallel trainer ranks and builds the diagnostics. Leaving it by any way closes what
the loop handed it (`close`: its engines, its workers), the ranks and the log. A trainer
rank that fails stops the run with a checkpoint of the weights after the last whole step,
when the failure left them intact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self

from tqdm import tqdm

from tether.advice import batch_of
from tether.checkpoint import RunState, checkpoint_due, latest_checkpoint, save_checkpoint
from tether.config import DiagnosticsConfig
from tether.distributed import start_ranks
from tether.dump import DumpWriter
from tether.errors import RankFailed
from tether.guards import STOP
from tether.logger import read_jsonl
from tether.loops.autocorrect import Correction
from tether.run import Run, RunResult
from tether.step import Diagnostics

log = logging.getLogger("tether.diagnostics")


class Session:
    def __init__(self, run: Run, state: RunState, resume: bool,
                 close: list[Callable[[], Any]] | None = None,
                 on_stop: Callable[[], Any] = lambda: None,
                 correction: Correction | None = None):
        self.run, self.state, self.on_stop = run, state, on_stop
        self.correction = correction  # train.correction=auto: checkpointed, switched per step
        if correction is not None and correction.auto:
            state.extra["correction"] = correction
        self._close = list(close or [])
        try:
            if run.ranks is not None:  # sharded: started with the run, every rank loads the checkpoint
                self._close.insert(0, run.ranks.stop)
            self.start, self.log = run.start(state, resume)  # the step the run goes on from
            self._close.append(self.log.close)
            if run.ranks is None:
                self._close.insert(0, start_ranks(run.trainer, run.cfg, run.model_path).stop)
        except BaseException:
            self._teardown()
            raise
        self.done = self.start  # steps completed
        tok, t = run.tokenizer, run.cfg.train
        self.diagnose = Diagnostics(_diagnostics(run), run.model, run.sampling, run.probe,
                                    tok.eos_token_id, tok.pad_token_id, t.micro_batch,
                                    t.routing_replay, t.precision, self._dump())
        self.before: dict[str, Any] = {}
        self.last: dict[str, Any] = {}
        self.rewards: list[float] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if isinstance(error, RankFailed):
                raise self._rank_failed(error) from None
        finally:
            self._teardown()

    def steps(self) -> Iterator[int]:
        """Evaluate at step 0 (a fresh run), then yield the 0-based step to run until
        `train.steps` are done; a step the loop leaves without `end_step` is run again."""
        run, total = self.run, self.run.cfg.train.steps
        if self.start == 0:
            self.log.log({"step": 0, **run.evaluate()})
        done = read_jsonl(self.log.path)  # step 0, and after a resume the steps up to its checkpoint
        self.before, self.rewards = done[0], [row["reward/mean"] for row in done[1:]]
        self.bar = tqdm(total=total, initial=self.start, disable=not run.cfg.run.progress,
                        desc="train", unit="step")
        while self.done < total:
            yield self.done

    def end_step(self, row: dict[str, Any]) -> None:
        """The step's tail: evaluate every eval.every steps and after the last, log the row,
        then on repeated bad steps or SIGINT/SIGTERM checkpoint and stop, else checkpoint
        every run.checkpoint_every steps and at the end."""
        run, cfg = self.run, self.run.cfg
        self.done += 1
        step = self.done
        row = {"step": step, **row}
        if self.correction is not None:
            row |= self.correction.after_step(step, row)
        if run.eval_due(step):
            row |= run.evaluate()
        self.log.log(row)
        self.rewards.append(row["reward/mean"])
        self.last = row
        self.bar.update(1)
        self.bar.set_postfix(_progress(row))
        stop = run.trainer.guard.stop_reason(step, run.run_dir) or STOP.stop_reason(step, run.run_dir)
        if stop:
            self.on_stop()
        if stop or checkpoint_due(step, cfg.run.checkpoint_every, cfg.train.steps):
            save_checkpoint(run.run_dir, step, self.state, keep=cfg.run.keep_checkpoints)
        if stop:
            raise stop

    def finish(self) -> RunResult:
        """The held-out evaluation after the last step (the last row's), and the result."""
        after = self.run.evaluate() if self.start == self.run.cfg.train.steps else self.last
        return self.run.finish(self.before, after, self.rewards)

    def _dump(self) -> DumpWriter | None:
        """log.dump_logprobs: RUN_DIR/logprobs.jsonl, closed with the session."""
        cfg = self.run.cfg
        if not cfg.log.dump_logprobs:
            return None
        dump = DumpWriter(self.run.run_dir / "logprobs.jsonl", keep_until=self.start,
                          source="tether", estimator=cfg.train.estimator,
                          batch=batch_of(cfg.model_dump()), generator=cfg.rollout.precision,
                          trainer=cfg.train.precision, sync_policy=cfg.sync.policy)
        self._close.append(dump.close)
        return dump

    def _rank_failed(self, error: RankFailed) -> RankFailed:
        """Checkpoint the state after the last whole step when the failure left it intact
        (replicated: rank 0 holds all of it; sharded, every rank writes its own shards, so
        the last checkpoint is the one to resume from); the error to stop the run with."""
        run_dir, step = self.run.run_dir, self.done
        self.on_stop()
        if error.intact and self.run.ranks is None:
            save_checkpoint(run_dir, step, self.state, keep=self.run.cfg.run.keep_checkpoints)
            where = f"a checkpoint was saved after step {step}"
        else:
            last = latest_checkpoint(run_dir)
            why = ("the sharded trainer cannot write one without the rank" if error.intact
                   else "the step had begun updating the weights")
            where = (f"{why}; the last checkpoint is {last}" if last else
                     f"{why} and no checkpoint exists")
        return RankFailed(f"{error} during step {step + 1}; {where}: continue with "
                          f"`tether train --resume {run_dir}`", error.intact)

    def _teardown(self) -> None:
        """Close in order what the loop handed in, the ranks, the log; each one even if an
        earlier one fails."""
        errors = []
        for close in self._close:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - closing the rest comes first
                errors.append(e)
        self._close = []
        if errors:
            raise errors[0]


def _diagnostics(run: Run) -> DiagnosticsConfig:
    """`diagnostics.*`, with the MoE routing comparison and the current-model monitor off
    under train.sharding=fsdp, saying so once: both read a whole trainer model at a version,
    which no rank holds."""
    d = run.cfg.diagnostics
    if run.ranks is None or not (d.routing or d.monitor_every):
        return d
    log.warning("tether: diagnostics.routing and diagnostics.monitor_every are off under "
                "train.sharding=fsdp (they read a whole trainer model, which no rank holds); "
                "set them to false and 0 to silence this")
    return d.model_copy(update={"routing": False, "monitor_every": 0})


def _progress(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's postfix: reward, accuracy when evaluated, version, and under the
    async loop mean staleness and samples per second."""
    out = {"reward": f"{row['reward/mean']:.3f}", "acc": str(row.get("eval/accuracy", "-")),
           "v": str(row["version"])}
    if "staleness/versions/mean" in row:
        out |= {"stale": f"{row['staleness/versions/mean']:.1f}",
                "sps": f"{row['async/samples_per_s']:.1f}"}
    return out


class Clock:
    """Wall time by phase of one step: `lap(name)` adds the time since the last lap to
    `time/<name>` (no name: not counted); `row()` adds `time/step`, start to last lap."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str | None = None) -> float:
        now = time.perf_counter()
        if name is not None:
            key = f"time/{name}"
            self.laps[key] = self.laps.get(key, 0.0) + now - self.last
        self.last = now
        return now

    def row(self) -> dict[str, float]:
        return {**self.laps, "time/step": self.last - self.start}
