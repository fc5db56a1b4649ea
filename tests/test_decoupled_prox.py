"""Decoupled PPO gets a real pi_prox: the trainer's weights before the batch's first optimizer
step, scored without grad, and only when some token was sampled at an older version."""

from __future__ import annotations

import torch

import tether.scoring.logprobs
import tether.trainer.core
from tether.config import TrainConfig, load_config
from tether.logger import read_jsonl
from tether.loops import train
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import collate, score_batch
from tether.trainer import Trainer, group_advantages

SHORT = ["train.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=8", "eval.every=0", "eval.samples=0", "eval.batch_size=8",
         "task.eval_size=8", "diagnostics.monitor_every=0", "run.progress=false",
         "run.checkpoint_every=0", "train.lr=3e-3", "train.estimator=decoupled"]


class Recording:
    """An estimator that keeps every TokenBatch it is called on."""

    def __init__(self, estimator) -> None:
        self.estimator, self.seen = estimator, []

    def __getattr__(self, name: str):
        return getattr(self.estimator, name)

    def __call__(self, batch):
        self.seen.append(batch)
        return self.estimator(batch)


def test_lagged_decoupled_run_scores_pi_prox_at_the_current_weights(
        warm_model_dir, tmp_path, monkeypatch):
    # sync.lag=2: step 0 trains on version 0 at version 0 (no pi_prox forward: pi_prox =
    # pi_old), steps 1 and 2 on version 0 at versions 1 and 2 (pi_prox scored, != pi_old).
    recorders: list[Recording] = []
    build = tether.trainer.core.build_estimator
    monkeypatch.setattr(tether.trainer.core, "build_estimator",
                        lambda *a, **k: recorders.append(Recording(build(*a, **k))) or recorders[-1])
    forwards = []  # no-grad forwards inside each train_on
    monkeypatch.setattr(tether.scoring.logprobs, "score_batch",
                        lambda *a, **k: forwards.append(1) or score_batch(*a, **k))
    steps = []  # per train_on: (trainer version, batch, a manual no-grad score now, forwards)
    train_on = Trainer.train_on

    def recorded_train_on(self, batch, advantages, logp_old, topk_logp_old):
        manual = score_batch(self.model, batch, self.sampling, self.cfg.micro_batch).logp
        seen, before = len(recorders[0].seen), len(forwards)
        out = train_on(self, batch, advantages, logp_old, topk_logp_old)
        steps.append((self.version - 1, batch, manual, logp_old, recorders[0].seen[seen:],
                      len(forwards) - before))
        return out

    monkeypatch.setattr(Trainer, "train_on", recorded_train_on)
    train(load_config(None, [f"model.path={warm_model_dir}", f"run.dir={tmp_path}", "sync.lag=2",
                             *SHORT]))
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 4  # step 0's evaluation + 3 steps
    assert [v - int(b.versions.max()) for v, b, *_ in steps] == [0, 1, 2]  # the lag ramps up

    version, batch, _, logp_old, seen, n = steps[0]
    assert version == 0 and logp_old is None  # current: pi_old from the training forward
    assert n == 0 and all(b.logp_prox is None for b in seen)  # and no pi_prox forward
    for _, batch, manual, logp_old, seen, n in steps[1:]:
        prox = torch.cat([b.logp_prox for b in seen])
        valid = batch.response_mask.bool()
        assert n == 1  # one no-grad forward (micro-batched) for the whole batch
        torch.testing.assert_close(prox[valid], manual[valid], rtol=0, atol=1e-6)
        assert (prox[valid] - logp_old[valid]).abs().max() > 1e-3  # the weights moved


def test_pi_prox_is_the_weights_before_the_first_minibatch_step(random_model):
    # Two mini-batches: the second trains after one optimizer step, yet its pi_prox is the
    # step's start weights, as the first's (AReaL: one recompute per training step).
    trainer = Trainer(random_model, TrainConfig(estimator="decoupled", minibatches=2, lr=1e-2),
                      SamplingParams(n=2, max_new_tokens=3))
    trainer.estimator = recording = Recording(trainer.estimator)
    rollouts = [_rollout(version=0, group=i // 2, ids=[3 + i, 4, 1]) for i in range(4)]
    batch = collate(rollouts, pad_id=0)
    logp_old = trainer.score_old(batch, trainer.model)[0]  # pi_old: version 0's weights
    trainer.version = 1  # the trainer is a version ahead (its weights: version 0's here)
    start = trainer.score(batch, trainer.model).logp
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), batch.group_ids, True)
    trainer.train_on(batch, advantages, logp_old, None)
    assert trainer.version == 3
    prox = torch.cat([b.logp_prox for b in recording.seen])
    # Each mini-batch scores its own 2 rows, `start` all 4: kernels of other shapes may round
    # differently (2.4e-7 seen on an AVX-512 machine), far below the 1e-4 a step moves them.
    torch.testing.assert_close(prox, start, rtol=0, atol=1e-6)
    after = trainer.score(batch, trainer.model).logp
    assert (after - start)[2:].abs().max() > 1e-4  # mini-batch 2 trained at moved weights


def test_current_batch_needs_no_pi_prox_forward(random_model, monkeypatch):
    trainer = Trainer(random_model, TrainConfig(estimator="decoupled"),
                      SamplingParams(n=2, max_new_tokens=3))
    trainer.estimator = recording = Recording(trainer.estimator)
    batch = collate([_rollout(version=0, group=0, ids=[3, 4, 1]),
                     _rollout(version=0, group=0, ids=[5, 1, 1])], pad_id=0)
    forwards = []
    monkeypatch.setattr(tether.scoring.logprobs, "score_batch",
                        lambda *a, **k: forwards.append(1) or score_batch(*a, **k))
    trainer.train_on(batch, torch.tensor([1.0, -1.0]), None, None)
    assert forwards == [] and recording.seen[0].logp_prox is None


def _rollout(version: int, group: int, ids: list[int]) -> Rollout:
    return Rollout(prompt_id=f"p{group}", group_id=group, prompt_ids=[5, 6, 7], response_ids=ids,
                   logp_rollout=[-1.0] * len(ids), version=version, engine="hf", precision="fp32",
                   finish_reason="length")
