"""The asynchronous RL loop: rollout workers generate while the trainer trains. One screen.

Workers (tether.rollout.worker, one engine each: processes on this machine, or Ray actors,
`loop.backend`, tether.rollout.backend) take work items, sample with the newest weights
published to them, reward, and send the batch back stamped with the version(s) that
sampled it. The trainer takes batches in issue order, scores pi_old per token at its
version, trains (the same step as the synchronous loop, tether.step) and publishes weights
(shared memory, or the Ray object store). `Scheduler` admits work only within the
staleness bound, decides when to publish and keeps the ledger. docs/async.md,
docs/distributed.md.
"""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from tether.checkpoint import RunState, checkpoint_due, save_checkpoint
from tether.config import Config
from tether.distributed import RankFailed, start_ranks
from tether.guards import STOP
from tether.ledger import Ledger
from tether.logger import read_jsonl
from tether.loops.scheduler import Scheduler
from tether.rollout.backend import RolloutBackend, build_backend
from tether.rollout.hf import HFGenerator
from tether.rollout.worker import BatchResult
from tether.run import Run, RunResult, build_run
from tether.step import Diagnostics, score_old, train_step
from tether.trainer import RolloutTensors, collate
from tether.weights import SnapshotStore, parse_sync_policy
from tether.weights.policy import staleness_ess, trained_ess


def train_async(cfg: Config, resume: bool = False) -> RunResult:
    run = build_run(cfg, resume)
    model, trainer, tokenizer, eta = run.model, run.trainer, run.tokenizer, cfg.loop.max_staleness
    policy = parse_sync_policy(cfg.sync.policy, cfg.train.estimator)
    snapshots, ledger = SnapshotStore(model), Ledger(run.run_dir / "ledger.jsonl")
    # The workers start building their engines now, in parallel with the evaluation below.
    backend = build_backend(cfg, str(run.model_path), run.run_dir.name)
    sched = Scheduler(cfg, policy, backend, snapshots, ledger, run.sampling_seed)
    state = RunState(trainer, sched)  # a checkpoint holds the ledger's length and what to re-issue
    start, log = run.start(state, resume)
    ranks = start_ranks(trainer, cfg, run.model_path)  # train.world_size > 1: ranks 1..N-1
    diagnose = Diagnostics(cfg.diagnostics, model, run.sampling, run.probe, tokenizer.eos_token_id,
                           tokenizer.pad_token_id, cfg.train.micro_batch, cfg.train.routing_replay,
                           cfg.train.precision)
    mirror = _Mirror(run, snapshots)  # the generator's numerics in this process, for diagnostics
    sched.publish(trainer.version, model.state_dict())

    def model_at(v: int):  # the fp32 weights of version v: the trainer's own when current
        return model if v == trainer.version else snapshots.model_at(v)

    if start == 0:
        log.log({"step": 0, **run.evaluate()})
    done = read_jsonl(log.path)
    before, rewards = done[0], [row["reward/mean"] for row in done[1:]]
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not cfg.run.progress, desc="train",
               unit="step")
    t_first, samples, tokens, step = None, 0, 0, start  # throughput counts from the first batch
    try:
        while step < cfg.train.steps:
            # 1. Admit: issue every rollout batch the staleness bound allows.
            sched.admit(trainer.version)
            # 2. The next batch in issue order; waiting for it is the trainer's idle time.
            t0 = time.perf_counter()
            result = _next_batch(sched, backend, trainer.version)
            t1 = time.perf_counter()
            batch = collate(result.rollouts, tokenizer.pad_token_id, model.device)
            V = trainer.version
            behind = _behind(batch, V)  # (B, T) versions between the trainer and each token
            if int(behind.max()) > eta:  # a safety net: admission makes this impossible
                sched.drop(result.item, "over_staleness_bound")
                continue

            # 3. Score old log-probs at the weights that sampled each token (kept snapshots).
            logp_old, topk_logp_old, batch = score_old(trainer, batch, model_at)
            t2 = time.perf_counter()

            # 4. ESS policy with on_trip=regenerate: a batch too stale to learn from is dropped
            #    and its prompts issued again with the current weights.
            ess_row = {}
            if policy.measures_ess and cfg.sync.on_trip == "regenerate" and int(behind.max()) > 0:
                ess = staleness_ess(trainer.score_old(batch, model)[0], logp_old, batch.response_mask)
                if policy.trips(ess):
                    sched.drop(result.item, "ess_trip_regenerated")
                    if V > backend.version:
                        sched.publish(V, model.state_dict())
                    continue
                ess_row = {"sync/ess/token": ess, "sync/tripped": 0.0}

            # 5. Loss and optimizer step(s) at the current weights (data-parallel: on every
            #    rank). A rank that died stops the run: what is in flight is dropped, and the
            #    weights after `step` steps are checkpointed.
            try:
                out = train_step(trainer, batch, result.rollouts, logp_old, topk_logp_old,
                                 cfg.train.adv_std_norm)
            except RankFailed as e:
                sched.stop()
                raise e.checkpointed(run.run_dir, step, state, cfg.run.keep_checkpoints) from None
            tripped = False
            if policy.measures_ess and not ess_row:  # on_trip=train: off the training forward
                ess = trained_ess(out.logp, logp_old, batch.response_mask, cfg.train.minibatches,
                                  lambda b=batch: trainer.score_old(b, model)[0])
                tripped = policy.trips(ess)
                ess_row = {"sync/ess/token": ess, "sync/tripped": float(tripped)}
            t3 = time.perf_counter()

            # 6. Diagnostics: numerical / staleness / total split, MoE routing, monitor.
            diag = diagnose(step, run.sampling_seed(result.item.slot), batch, logp_old, out.logp,
                            snapshots.model_at, mirror, backend.version)
            t4 = time.perf_counter()

            # 7. Ledger; publish per policy; free snapshots nothing queued needs.
            sched.done(result.item, V, _per_prompt(behind, batch))
            sync_metrics = sched.after_step(trainer.version, model.state_dict(), tripped)
            t5 = time.perf_counter()
            step += 1
            if t_first is None:
                t_first = t1  # the workers' start-up (engine load) is not throughput
            else:
                samples += len(result.rollouts)
                tokens += int(batch.response_mask.sum())
            valid = batch.response_mask.bool()
            row = {"step": step, "version": trainer.version,
                   "generator_version": int(batch.versions.min()),  # the oldest that sampled it
                   **out.metrics, **diag, **ess_row, **sync_metrics,
                   "staleness/versions/mean": float(behind[valid].float().mean()),
                   "staleness/versions/max": float(behind[valid].max()),
                   "async/partial_frac": sum(ro.token_versions is not None
                                             for ro in result.rollouts) / len(result.rollouts),
                   "async/queue_depth": float(len(sched.ready)),
                   "async/in_flight": float(len(sched.outstanding) - len(sched.ready)),
                   "async/generator_idle": result.idle_s, "async/worker": float(result.worker),
                   "async/samples_per_s": samples / max(t5 - t_first, 1e-9),
                   "async/tokens_per_s": tokens / max(t5 - t_first, 1e-9),
                   "time/wait_data": t1 - t0, "time/generate": result.generate_s,
                   "time/old_logprob": t2 - t1, "time/diagnostics": t4 - t3, "time/sync": t5 - t4,
                   "time/step": t5 - t0}

            # 8. Log, evaluate every E steps; checkpoint; on repeated bad steps or a signal, stop.
            if run.eval_due(step):
                row |= run.evaluate()
            log.log(row)
            rewards.append(row["reward/mean"])
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward/mean']:.3f}",
                            stale=f"{row['staleness/versions/mean']:.1f}",
                            sps=f"{row['async/samples_per_s']:.1f}")
            stop = trainer.guard.stop_reason(step, run.run_dir) or STOP.stop_reason(step, run.run_dir)
            if stop:
                sched.stop()  # in flight: dropped now, issued again on resume
            if stop or checkpoint_due(step, cfg.run.checkpoint_every, cfg.train.steps):
                save_checkpoint(run.run_dir, step, state, keep=cfg.run.keep_checkpoints)
            if stop:
                raise stop
    finally:
        backend.stop()
        ranks.stop()
        ledger.close()
    after = run.evaluate() if start == cfg.train.steps else row
    log.close()
    return run.finish(before, after, rewards)


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

    def __init__(self, run: Run, snapshots: SnapshotStore):
        self.run, self.snapshots = run, snapshots
        self.generator: HFGenerator | None = None  # built on first use: a second copy of the model

    def __call__(self, version: int) -> torch.nn.Module | None:
        r, tok = self.run.cfg.rollout, self.run.tokenizer
        if r.engine != "hf":
            return None
        if self.generator is None:
            self.generator = HFGenerator(self.run.model, tok.eos_token_id, tok.pad_token_id,
                                         r.precision, r.router_noise)
        if self.generator.version != version:
            self.generator.load_weights(self.snapshots.state(version), version)
        return self.generator.model
