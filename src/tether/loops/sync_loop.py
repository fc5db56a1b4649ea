"""The synchronous RL loop: generate, score old log-probs, loss, step, sync.

What it leaves out, on purpose: no KL penalty to a reference model (the papers under
study train without one), no reward model (rewards parse the answer), no filtering of
batches by reward (which rollouts make a batch never depends on their reward). Staleness
here is made on purpose (`sync.lag`, `train.minibatches`); the asynchronous loop
(tether.loops.async_loop) gets it from the race between generator and trainer. Start,
end-of-step tail and teardown: tether.loops.skeleton; the step: tether.step.
"""

from __future__ import annotations

from tether.config import Config
from tether.loops.autocorrect import Correction
from tether.loops.skeleton import Clock, Session
from tether.rollout.worker import rewarded_rollouts
from tether.run import RunResult, build_run
from tether.scoring import collate
from tether.setup import build_generator
from tether.step import old_logprobs, train_step
from tether.weights.gate import StalenessGate
from tether.weights.publisher import InProcessPublisher
from tether.weights.synchronizer import Synchronizer


def train_sync(cfg: Config, resume: bool = False) -> RunResult:
    run = build_run(cfg, resume)
    model, trainer, tokenizer, r = run.model, run.trainer, run.tokenizer, cfg.rollout
    generator = build_generator(cfg, run.generator_model(), run.model_path, tokenizer)  # one, in this process
    gate, snapshots = StalenessGate.of(cfg), run.snapshots()  # the policy; kept versions
    correction = Correction.of(run, gate)  # train.correction=auto: chosen step by step
    sync = Synchronizer(gate.policy, InProcessPublisher(generator), snapshots, run.weights(),
                        cfg.sync.lag, cfg.sync.lag_from)
    generator_model = lambda v: getattr(generator, "model", None)  # vLLM: None (in its engine)

    def sample(step: int):
        """G rewarded samples per prompt at the generator's weight version, and as tensors."""
        indices = [step * r.prompts_per_step + i for i in range(r.prompts_per_step)]
        rollouts = rewarded_rollouts(generator, tokenizer, run.task, run.reward_fn, indices,
                                     correction.sampling(run.sampling),
                                     seed=run.sampling_seed(step))
        return rollouts, collate(rollouts, tokenizer.pad_token_id, model.device)

    with Session(run, run.state(sync), resume, close=[generator.close],
                 correction=correction) as s:
        for step in s.steps():
            clock = Clock()
            # 1. Generate: G rewarded samples per prompt at the generator's weight version.
            rollouts, batch = sample(step)
            clock.lap("generate")
            # 2. pi_old per token at the weights that sampled it (kept snapshots, or the
            #    training forward when those are the current weights).
            old, batch = old_logprobs(trainer, batch, snapshots)
            clock.lap("old_logprob")
            # 3. Staleness gate (ess policy, on_trip=regenerate): a batch whose ESS at the
            #    current weights is below tau is dropped; the generator re-syncs and the
            #    prompts are sampled again.
            if gate.before(batch, old.logp, trainer):
                sync.resync(trainer.version, run.weights())
                rollouts, batch = sample(step)
                old, batch = old_logprobs(trainer, batch, snapshots)
            clock.lap("sync")
            V = trainer.version
            # 4. Loss and optimizer step(s) at the current weights (data-parallel: on every
            #    rank), with the correction in force (train.correction=auto: chosen per step).
            correction.before(batch)
            out = train_step(trainer, batch, rollouts, old, cfg.train.adv_std_norm,
                             cfg.diagnostics.seq_weights)
            clock.lap()
            # 5. Diagnostics: numerical / staleness / total split, MoE routing, monitor.
            diag = s.diagnose(step, run.sampling_seed(step), batch, out.logp_old, out.logp,
                              snapshots.model_at, generator_model, sync.generator_version)
            clock.lap("diagnostics")
            # 6. Sync: the policy (the gate's trip, interval) and sync.lag decide the
            #    generator's next version.
            tripped = gate.after(out.logp, trainer)
            sync_metrics = sync.after_step(step, trainer.version, run.weights(), tripped)
            clock.lap("sync")
            # 7. Log, evaluate every E steps and at the end; checkpoint every K steps; on
            #    repeated bad steps or SIGINT/SIGTERM, checkpoint and stop.
            s.end_step({"version": trainer.version, "generator_version": sync.generator_version,
                        **out.metrics, **diag, **gate.metrics(), **sync_metrics,
                        "staleness/versions/batch": float(V - int(batch.versions[0])),
                        **clock.row()})
        return s.finish()
