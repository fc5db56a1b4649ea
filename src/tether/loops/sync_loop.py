"""The synchronous RL loop: generate, score old log-probs, loss, step, sync. One screen.

What it leaves out, on purpose: no KL penalty to a reference model (the papers under
study train without one), no reward model (rewards parse the answer), no filtering of
batches by reward (which rollouts make a batch never depends on their reward). Staleness
here is made on purpose (`sync.lag`, `train.minibatches`); the asynchronous loop
(tether.loops.async_loop) gets it from the race between generator and trainer.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from tether.checkpoint import RunState, checkpoint_due, save_checkpoint
from tether.config import Config
from tether.distributed import RankFailed, start_ranks
from tether.guards import STOP
from tether.logger import read_jsonl
from tether.rollout.worker import rewarded_rollouts
from tether.run import RunResult, build_generator, build_run
from tether.step import Diagnostics, reuses_training_forward, score_old, train_step
from tether.trainer import collate
from tether.weights import InProcessPublisher, SnapshotStore, Synchronizer, parse_sync_policy


def train_sync(cfg: Config, resume: bool = False) -> RunResult:
    run = build_run(cfg, resume)
    model, trainer, tokenizer, r = run.model, run.trainer, run.tokenizer, cfg.rollout
    generator = build_generator(cfg, model, run.model_path, tokenizer)
    snapshots = SnapshotStore(model)
    sync = Synchronizer(parse_sync_policy(cfg.sync.policy, cfg.train.estimator),
                        InProcessPublisher(generator), snapshots, model.state_dict(),
                        cfg.sync.lag, cfg.sync.on_trip, minibatches=cfg.train.minibatches)
    state = RunState(trainer, sync)  # what a checkpoint holds (tether.checkpoint)
    start, log = run.start(state, resume)
    ranks = start_ranks(trainer, cfg, run.model_path)  # train.world_size > 1: ranks 1..N-1
    diagnose = Diagnostics(cfg.diagnostics, model, run.sampling, run.probe, tokenizer.eos_token_id,
                           tokenizer.pad_token_id, cfg.train.micro_batch, cfg.train.routing_replay,
                           cfg.train.precision)
    hf_generator = getattr(generator, "model", None)  # vLLM's weights live in its engine

    def model_at(v: int):  # the fp32 weights of version v: the trainer's own when current
        return model if v == trainer.version else snapshots.model_at(v)

    def sample(step: int):
        """G rewarded samples per prompt at the generator's weight version, and as tensors."""
        indices = [step * r.prompts_per_step + i for i in range(r.prompts_per_step)]
        rollouts = rewarded_rollouts(generator, tokenizer, run.task, run.reward_fn, indices,
                                     run.sampling, seed=run.sampling_seed(step))
        return rollouts, collate(rollouts, tokenizer.pad_token_id, model.device)

    if start == 0:
        log.log({"step": 0, **run.evaluate()})
    done = read_jsonl(log.path)  # step 0, and after a resume the steps up to its checkpoint
    before, rewards = done[0], [row["reward/mean"] for row in done[1:]]
    bar = tqdm(range(start, cfg.train.steps), initial=start, total=cfg.train.steps,
               disable=not cfg.run.progress, desc="train", unit="step")
    for step in bar:
        t0 = time.perf_counter()
        # 1. Generate: G rewarded samples per prompt at the generator's weight version.
        rollouts, batch = sample(step)
        t1 = time.perf_counter()

        # 2. Score old log-probs at the weights that sampled each token (kept snapshots); a
        #    batch sampled at the current weights, trained in one step, takes them from the
        #    training forward instead (None until then).
        logp_old = topk_logp_old = None
        if not reuses_training_forward(trainer, batch):
            logp_old, topk_logp_old, batch = score_old(trainer, batch, model_at)
        t2 = time.perf_counter()

        # 3. Staleness check (ess policy, on_trip=regenerate): a batch whose ESS at the current
        #    weights is below tau is dropped; the generator re-syncs and the prompts are resampled.
        if sync.check(batch, logp_old, sync.generator_version, trainer.version,
                      lambda b=batch: trainer.score_old(b, model)[0]):
            sync.resync(trainer.version, model.state_dict())
            rollouts, batch = sample(step)
            logp_old, topk_logp_old, batch = score_old(trainer, batch, model_at)
        t3 = time.perf_counter()

        # 4. Loss and optimizer step(s) at the current weights (data-parallel: on every rank).
        #    A rank that died stops the run; the weights after `step` steps are checkpointed.
        try:
            out = train_step(trainer, batch, rollouts, logp_old, topk_logp_old,
                             cfg.train.adv_std_norm)
        except RankFailed as e:
            raise e.checkpointed(run.run_dir, step, state, cfg.run.keep_checkpoints) from None
        t4 = time.perf_counter()

        # 5. Diagnostics: numerical / staleness / total split, MoE routing, current-model monitor.
        diag = diagnose(step, run.sampling_seed(step), batch, out.logp_old, out.logp, snapshots.model_at,
                        lambda v: hf_generator, sync.generator_version)
        t5 = time.perf_counter()

        # 6. Sync: the policy (ESS trip, interval) and sync.lag decide the generator's next version.
        sync_metrics = sync.after_step(step, trainer.version, model.state_dict(), out.logp)
        t6 = time.perf_counter()

        # 7. Log, and evaluate every E steps and at the end.
        row = {"step": step + 1, "version": trainer.version,
               "generator_version": sync.generator_version, **out.metrics, **diag, **sync_metrics,
               "time/generate": t1 - t0, "time/old_logprob": t2 - t1, "time/diagnostics": t5 - t4, "time/sync": (t3 - t2) + (t6 - t5),
               "time/step": t6 - t0}
        if run.eval_due(step + 1):
            row |= run.evaluate()
        log.log(row)
        rewards.append(row["reward/mean"])
        bar.set_postfix(reward=f"{row['reward/mean']:.3f}", acc=row.get("eval/accuracy", "-"),
                        v=trainer.version)

        # 8. Checkpoint every K steps and at the end; on repeated bad steps or SIGINT/SIGTERM,
        #    checkpoint and stop.
        stop = trainer.guard.stop_reason(step + 1, run.run_dir) or STOP.stop_reason(step + 1, run.run_dir)
        if stop or checkpoint_due(step + 1, cfg.run.checkpoint_every, cfg.train.steps):
            save_checkpoint(run.run_dir, step + 1, state, keep=cfg.run.keep_checkpoints)
        if stop:
            ranks.stop()
            raise stop

    after = run.evaluate() if start == cfg.train.steps else row
    log.close()
    generator.close()
    ranks.stop()
    return run.finish(before, after, rewards)
