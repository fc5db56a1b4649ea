"""pi_old scored in the rollout worker that made the batch (`loop.score_old=worker`) is the
trainer's own pi_old: the same scoring code at the version that sampled each token.

The worker runs in a real spawned process; the trainer's side in this one. A stale batch
(sampled at version 0, trained at version 1) and a partial batch (weights switched to
version 1 after decode step 4) are scored both ways."""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

import tether.weights.snapshots
from tether.config import load_config
from tether.logger import read_jsonl
from tether.loops import train
from tether.models import load_model
from tether.rollout.worker import RolloutEngine, WorkItem
from tether.scoring import collate
from tether.setup import sampling_params
from tether.step import old_logprobs
from tether.trainer import Trainer
from tether.weights.snapshots import SnapshotStore

ASYNC = ["run.progress=false", "run.threads=1", "rollout.prompts_per_step=3",
         "rollout.group_size=2", "rollout.max_new_tokens=10", "task.eval_size=16",
         "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0", "loop.mode=async"]


def _cfg(model_dir, *extra):
    return load_config("configs/countdown.yaml", [f"model.path={model_dir}", *ASYNC, *extra])


def _worker(cfg, model_dir, weights, out) -> None:
    """In a rollout worker's process: a stale batch at version 0, then a partial batch that
    switches to version 1 after decode step 4; the rollouts carry the worker's pi_old."""
    engine = RolloutEngine(0, cfg, str(model_dir))
    engine.load_weights(weights[0], 0)
    stale = engine.make(WorkItem(0, (0, 1, 2), (0, 0, 0), 0, 11), 0.0)
    calls = []

    def refresh() -> bool:  # what WeightSubscriber.poll does when version 1 has arrived
        calls.append(1)
        if len(calls) == 4:
            engine.load_weights(weights[1], 1)
            return True
        return False

    partial = engine.make(WorkItem(1, (3, 4, 5), (0, 0, 0), 0, 12), 0.0, refresh)
    out.put((stale.rollouts, partial.rollouts, engine.scorer.version))


def _two_versions(model_dir, cfg):
    """A trainer at version 1 (one optimizer step from the warm model) and version 0's state."""
    model, _ = load_model(model_dir)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, cfg.train.model_copy(update={"lr": 1e-2}),
                      sampling_params(cfg, model.config.vocab_size))
    torch.manual_seed(0)
    model(torch.tensor([[3, 4, 5, 6]])).logits.square().mean().backward()
    trainer.optimizer.step()
    trainer.version = 1
    return trainer, v0


@pytest.mark.parametrize("worker_threads", [1, 2])
def test_worker_pi_old_is_the_trainers(warm_model_dir, worker_threads):
    cfg = _cfg(warm_model_dir, f"loop.worker_threads={worker_threads}", "loop.partial=true")
    trainer, v0 = _two_versions(warm_model_dir, cfg)
    v1 = copy.deepcopy(trainer.model.state_dict())
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_worker, args=(cfg, warm_model_dir, {0: v0, 1: v1}, out))
    p.start()
    stale, partial, scorer_version = out.get(timeout=300)
    p.join(timeout=60)
    assert scorer_version == 1  # after the partial batch the scorer moved on to the newest

    snapshots = SnapshotStore(trainer.model)
    snapshots.put(0, v0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's (run.threads=1)
    try:
        for rollouts in (stale, partial):
            carried = collate(rollouts, 0)
            mine = [copy.copy(ro) for ro in rollouts]
            for ro in mine:
                ro.logp_old = None
            batch = collate(mine, 0)
            assert carried.logp_old is not None and batch.logp_old is None
            old, _ = old_logprobs(trainer, batch, snapshots)  # the trainer scores it itself
            mask = batch.response_mask.bool()
            if worker_threads == 1:  # same numerics, same thread count: bit for bit
                assert torch.equal(carried.logp_old[mask], old.logp[mask])
            else:  # another thread count splits the matmul reductions otherwise: rounding
                torch.testing.assert_close(carried.logp_old[mask], old.logp[mask],
                                           rtol=0, atol=1e-6)
            assert torch.equal(old_logprobs(trainer, carried, snapshots)[0].logp,
                               carried.logp_old)  # the trainer takes the worker's
    finally:
        torch.set_num_threads(threads)
    versions = collate(partial, 0).token_versions[collate(partial, 0).response_mask.bool()]
    assert set(versions.tolist()) == {0, 1}  # the partial batch spans both versions
    assert {ro.version for ro in stale} == {0}


@pytest.mark.parametrize("where", ["worker", "trainer"])
def test_trainer_runs_no_pi_old_forward_when_workers_score(warm_model_dir, tmp_path,
                                                           monkeypatch, where):
    scored = []
    score_old = tether.weights.snapshots.score_at_versions
    monkeypatch.setattr(tether.weights.snapshots, "score_at_versions", lambda *a: scored.append(1) or score_old(*a))
    run_dir = tmp_path / "run"
    train(_cfg(warm_model_dir, f"run.dir={run_dir}", "train.steps=4", "loop.max_staleness=2",
               f"loop.score_old={where}"))
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    stale = [r for r in rows if r["staleness/versions/max"] > 0]
    assert stale  # eta = 2 and a single worker that outpaces the trainer: stale batches
    if where == "worker":
        assert not scored and all(r["worker/old_logprob"] > 0 for r in rows)
    else:
        assert len(scored) >= len(stale) and all(r["worker/old_logprob"] == 0 for r in rows)
    for r in rows:
        assert r["worker/generate"] > 0 and r["worker/reward"] > 0
        assert r["time/generate"] == pytest.approx(r["worker/generate"] + r["worker/reward"])
    for r in rows[1:]:  # the first row's also holds the publish of version 0, before step 1
        assert r["time/publish"] + r["time/snapshots"] <= r["time/sync"] + 1e-6


def test_config_refuses_worker_scoring_with_r2(warm_model_dir):
    from tether.config import ConfigError

    with pytest.raises(ConfigError, match="loop.score_old"):
        _cfg(warm_model_dir, "loop.score_old=worker", "train.routing_replay=r2")
