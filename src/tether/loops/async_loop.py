"""The asynchronous RL loop: rollout workers generate while the trainer trains.

Workers (tether.rollout.worker, one engine each: processes on this machine, or Ray actors,
`loop.backend`, tether.rollout.backend) take work items, sample with the newest weights
published to them, reward, and send the batch back stamped with the version(s) that
sampled it. The trainer takes batches in issue order, scores pi_old per token at its
version, trains (the same step as the synchronous loop, tether.step) and publishes weights
(shared memory, or the Ray object store). `Scheduler` admits work only within the
staleness bound, decides when to publish and keeps the ledger. docs/async.md,
docs/distributed.md. Start, end-of-step tail and teardown:
tether.loops.skeleton; the step: tether.step.
"""

from __future__ import annotations

import torch

from tether.config import Config
from tether.ledger import Ledger
from tether.loops.autocorrect import Correction
from tether.loops.scheduler import Scheduler
from tether.loops.skeleton import Clock, Session
from tether.rollout.backend import RolloutBackend, build_backend
from tether.rollout.hf import HFGenerator
from tether.rollout.worker import BatchResult
from tether.run import Run, RunResult, build_run
from tether.scoring import RolloutTensors, collate
from tether.step import old_logprobs, train_step
from tether.trainer.spmd import ShardedSnapshots
from tether.weights.gate import StalenessGate
from tether.weights.snapshots import SnapshotStore


def train_async(cfg: Config, resume: bool = False) -> RunResult:
    run = build_run(cfg, resume)
    model, trainer, tokenizer = run.model, run.trainer, run.tokenizer
    gate = StalenessGate.of(cfg)  # the sync policy, and what it does to a stale batch
    snapshots, ledger = run.snapshots(), Ledger(run.run_dir / "ledger.jsonl")
    # The workers start building their engines now, in parallel with the evaluation at step 0.
    backend = build_backend(cfg, str(run.model_path), run.run_dir.name)
    sched = Scheduler(cfg, gate.policy, backend, snapshots, ledger, run.sampling_seed)
    correction = Correction.of(run, gate, sched)  # train.correction=auto: chosen per step
    mirror = _Mirror(run, snapshots)  # the generator's numerics in this process, for diagnostics
    rate = _Throughput()

    # On a stop, what is in flight is dropped (sched.stop), to be issued again on resume.
    with Session(run, run.state(sched), resume, close=[backend.stop, ledger.close],
                 on_stop=sched.stop, correction=correction) as s:
        sched.publish(trainer.version, run.weights())
        for step in s.steps():
            # 1. Admit: issue every rollout batch the staleness bound allows.
            sched.admit(trainer.version)
            clock = Clock()
            # 2. The next batch in issue order; waiting for it is the trainer's idle time.
            result = _next_batch(sched, backend, trainer.version)
            arrived = clock.lap("wait_data")
            batch = collate(result.rollouts, tokenizer.pad_token_id, model.device)
            clock.lap("collate")
            V, bounds = trainer.version, sched.bounds()  # the window and re-sync at its turn
            behind = _behind(batch, V)  # (B, T) versions between the trainer and each token
            stale = int(behind.max())
            # Beyond the window (an ESS trip shrank it), or sampled before a re-sync under
            # loop.after_trip=regenerate: dropped, its prompts issued again at once.
            if reason := sched.out_of_bounds(int(batch.versions.min()), stale):
                sched.drop(result.item, reason)
                continue
            # 3. pi_old per token at the weights that sampled it: as the worker scored it, or
            #    from kept snapshots, or the training forward when those are the current weights.
            old, batch = old_logprobs(trainer, batch, snapshots)
            clock.lap("old_logprob")
            # 4. Staleness gate (ess policy, on_trip=regenerate): a batch too stale to learn
            #    from is dropped and its prompts issued again with the current weights.
            if gate.before(batch, old.logp, trainer):
                sched.drop(result.item, "ess_trip_regenerated")
                sched.resync(V, run.weights(), stale)
                continue
            # 5. Loss and optimizer step(s) at the current weights (data-parallel: on every
            #    rank), with the correction in force (train.correction=auto: chosen per step).
            correction.before(batch)
            out = train_step(trainer, batch, result.rollouts, old, cfg.train.adv_std_norm,
                             cfg.diagnostics.seq_weights)
            tripped = gate.after(out.logp, trainer)  # on_trip=train: off the training forward
            clock.lap()
            # 6. Diagnostics: numerical / staleness / total split, MoE routing, monitor.
            diag = s.diagnose(step, run.sampling_seed(result.item.slot), batch, out.logp_old,
                              out.logp, snapshots.model_at, mirror, backend.version)
            clock.lap("diagnostics")
            # 7. Ledger; the window (ESS-governed: shrinks on a trip, widens without);
            #    publish per policy; free snapshots nothing queued needs.
            sched.done(result.item, V, _per_prompt(behind, batch))
            sync_metrics = sched.after_step(trainer.version, run.weights(), tripped, stale)
            clock.lap("sync")
            # 8. Log, evaluate every E steps; checkpoint; on repeated bad steps or a signal, stop.
            s.end_step({"version": trainer.version, **out.metrics, **diag, **gate.metrics(),
                        **sync_metrics, **bounds, **_async_metrics(result, batch, behind, sched),
                        **rate.add(arrived, result, batch, clock.last), **clock.row()})
        return s.finish()


def _async_metrics(result: BatchResult, batch: RolloutTensors, behind: torch.Tensor,
                   sched: Scheduler) -> dict[str, float]:
    """The batch's staleness, the share of partial rollouts, the queue, the worker's times."""
    valid = batch.response_mask.bool()
    return {"generator_version": int(batch.versions.min()),  # the oldest that sampled it
            "staleness/versions/mean": float(behind[valid].float().mean()),
            "staleness/versions/max": float(behind[valid].max()),
            "async/partial_frac": sum(ro.token_versions is not None
                                      for ro in result.rollouts) / len(result.rollouts),
            "async/queue_depth": float(len(sched.ready)),
            "async/in_flight": float(len(sched.outstanding) - len(sched.ready)),
            "async/generator_idle": result.idle_s, "async/worker": float(result.worker),
            # The worker's side of this batch (its time overlaps the trainer's).
            "worker/generate": result.generate_s, "worker/reward": result.reward_s,
            "worker/old_logprob": result.old_logprob_s, "worker/load_weights": result.load_s,
            "time/generate": result.generate_s + result.reward_s}


class _Throughput:
    """Samples and response tokens trained per second, counted from the first batch's
    arrival (the workers' start-up, engine load, is not throughput) to the end of this step,
    the first batch's samples included: its training is in the window."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.samples = self.tokens = 0

    def add(self, arrived: float, result: BatchResult, batch: RolloutTensors,
            now: float) -> dict[str, float]:
        if self.first is None:
            self.first = arrived
        self.samples += len(result.rollouts)
        self.tokens += int(batch.response_mask.sum())
        elapsed = max(now - self.first, 1e-9)
        return {"async/samples_per_s": self.samples / elapsed,
                "async/tokens_per_s": self.tokens / elapsed}


def _next_batch(sched: Scheduler, backend: RolloutBackend, trainer_version: int) -> BatchResult:
    """Block until the batch whose turn it is has arrived. What a dead worker held is
    dropped and issued again (Ray); the local backend raises instead."""
    while (result := sched.next_ready()) is None:
        for event in backend.receive(timeout=1.0):
            sched.take(event, trainer_version)
    return result


def _behind(batch: RolloutTensors, trainer_version: int) -> torch.Tensor:
    """(B, T) versions between the trainer and the version that sampled each token (0 on padding)."""
    return (trainer_version - batch.token_versions) * batch.response_mask.long()


def _per_prompt(behind: torch.Tensor, batch: RolloutTensors) -> list[tuple[float, int]]:
    """Mean and max staleness over each prompt's tokens (its group's rows), for the ledger."""
    out = []
    for g in batch.group_ids.unique(sorted=True):
        rows = batch.group_ids == g
        valid = batch.response_mask[rows].bool()
        b = behind[rows][valid].float()
        out.append((float(b.mean()) if b.numel() else 0.0, int(b.max()) if b.numel() else 0))
    return out


class _Mirror:
    """The generator's numerics in the trainer's process (hf engine), loaded with a kept
    version on demand: routing disagreement and the current-model monitor need the
    generator's model, which lives in the workers. None for vLLM (its weights live in its
    engine)."""

    def __init__(self, run: Run, snapshots: SnapshotStore | ShardedSnapshots):
        self.run, self.snapshots = run, snapshots
        self.generator: HFGenerator | None = None  # built on first use: a second copy of the model

    def __call__(self, version: int) -> torch.nn.Module | None:
        r, tok = self.run.cfg.rollout, self.run.tokenizer
        if r.engine != "hf":
            return None
        if self.generator is None:
            self.generator = HFGenerator(self.run.generator_model(), tok.eos_token_id,
                                         tok.pad_token_id, r.precision, r.router_noise)
        if self.generator.version != version:
            self.generator.load_weights(self.snapshots.state(version), version)
        return self.generator.model
