"""The asynchronous loop: real worker processes racing the trainer, bounded staleness, the
ledger, partial rollouts scored per token, and a stop by SIGTERM resumed without loss.

The race outcomes the tests assert are forced, not waited for (tests/race_gates.py): a
barrier in the workers' reward makes both workers hold a batch, the trainer waits for
every issued batch before training (generation outpaces training), a worker takes a new
version at a decode step while the trainer holds that version back until it is there
(weights land mid-batch), and a worker holds a batch until the test has sent SIGTERM
(something is in flight at the stop)."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.race_gates import gate, lines, wait_until
from tether.config import ConfigError, TrainConfig, load_config
from tether.ledger import Ledger, audit
from tether.logger import read_jsonl
from tether.loops import async_loop, train
from tether.loops.scheduler import Scheduler
from tether.models import load_model
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.scoring import collate, score_at_versions, token_logprobs
from tether.tasks import build_task
from tether.trainer import Trainer

ASYNC = ["run.progress=false", "run.threads=1", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=12", "task.eval_size=16",
         "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0", "loop.mode=async"]


def _cfg(model_dir, run_dir, *extra):
    return load_config("configs/countdown.yaml",
                       [f"model.path={model_dir}", f"run.dir={run_dir}", *ASYNC, *extra])


def _gated(model_dir, tmp_path, *extra, **rules):
    """`_cfg` for a run in tmp_path/run whose reward passes the gates `rules`
    (tests/race_gates.py, markers in tmp_path/gate)."""
    cfg = _cfg(model_dir, tmp_path / "run", *extra)
    return _cfg(model_dir, tmp_path / "run", *extra, *gate(tmp_path / "gate", cfg, **rules))


def test_two_workers_bounded_staleness_every_prompt_accounted_for(warm_model_dir, tmp_path,
                                                                  monkeypatch):
    steps, eta, run_dir = 10, 2, tmp_path / "run"
    # Both workers make batches: a barrier in the reward lets neither finish its first batch
    # before the other holds one.
    cfg = _gated(warm_model_dir, tmp_path, f"train.steps={steps}", "loop.workers=2",
                 f"loop.max_staleness={eta}", "train.lr=1e-3", "eval.every=5", "eval.samples=2",
                 barrier=2)

    # Generation outpaces training, by construction: the trainer takes its next batch only
    # once every batch issued has arrived, so all of the first window (slots 0..eta, issued
    # at version 0) is sampled at version 0, and slot eta is trained at version eta.
    def next_batch_when_all_arrived(sched, backend, trainer_version):
        while len(sched.ready) < len(sched.outstanding):
            for event in backend.receive(timeout=1.0):
                sched.take(event, trainer_version)
        return real_next_batch(sched, backend, trainer_version)

    real_next_batch = async_loop._next_batch
    monkeypatch.setattr(async_loop, "_next_batch", next_batch_when_all_arrived)
    train(cfg)
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems
    assert a.open == [] and a.trained == steps * 4 and sum(a.dropped.values()) == 0
    assert a.max_staleness == eta  # reached (forced above) and never exceeded
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # The trainer-side probe: held-out accuracy and reward at step 0, every 5 and the last.
    probed = [r["step"] for r in rows if {"eval/accuracy_sampled", "eval/reward_sampled"} <= r.keys()]
    assert probed == [0, 5, 10]
    rows = rows[1:]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert max(r["staleness/versions/max"] for r in rows) == eta
    assert {r["async/worker"] for r in rows} == {0.0, 1.0}  # both workers made batches (barrier)
    assert rows[-1]["version"] == steps and rows[-1]["async/samples_per_s"] > 0
    # The decomposition works unchanged: fp32 generator, so the numerical part is ~0 while
    # the staleness part is what the race made.
    assert max(r["numerical/abs_log_ratio/max"] for r in rows) < 1e-4
    assert max(r["staleness/k3_kl/mean"] for r in rows) > 0


def test_config_refuses_what_async_cannot_mean():
    for overrides, culprit in [
        (["loop.mode=async", "sync.lag=2"], "sync.lag"),
        (["loop.mode=async", "loop.partial=true", "rollout.engine=vllm"], "loop.partial"),
        (["loop.partial=true"], "loop.mode=async"),
        (["loop.mode=async", "loop.max_staleness=2", "sync.policy=bounded:3"], "loop.max_staleness"),
        (["loop.mode=async", "loop.max_staleness=1", "sync.policy=every:3"], "every:K"),
        # eta under N admits one batch at a time: the "race" would never overlap or lag
        (["loop.mode=async", "loop.max_staleness=2", "train.minibatches=4"], "train.minibatches=4"),
    ]:
        with pytest.raises(ConfigError, match=culprit):
            load_config("configs/countdown.yaml", overrides)


# -- pi_old per row and per token --------------------------------------------------------------

SAMPLING = SamplingParams(n=2, max_new_tokens=10)


@pytest.fixture(scope="module")
def two_versions(warm_model_dir):
    """Version 0 (the warm model) and version 1 (one optimizer step later), and a tokenizer."""
    model, tokenizer = load_model(warm_model_dir)
    v0 = copy.deepcopy(model)
    torch.manual_seed(0)
    trainer = Trainer(model, TrainConfig(lr=1e-2, micro_batch=3), SAMPLING)
    trainer.optimizer.zero_grad()
    model(torch.tensor([[3, 4, 5, 6]])).logits.square().mean().backward()
    trainer.optimizer.step()
    trainer.version = 1
    return trainer, v0, tokenizer


def _rollouts(tokenizer, model, version, first_problem, **kw):
    task = build_task("countdown")
    problems = [task.train_problem(first_problem + i) for i in range(3)]
    gen = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
    gen.version = version
    return gen.generate([encode_exact(tokenizer, p.prompt) for p in problems],
                        [p.id for p in problems], SAMPLING, seed=first_problem, **kw)


def test_pi_old_per_row_and_per_token_version(two_versions, tokenizer):
    trainer, v0, tok = two_versions
    models = {0: v0, 1: trainer.model}
    rollouts = _rollouts(tok, v0, 0, 0) + _rollouts(tok, trainer.model, 1, 3)
    # Two responses span both versions, as under partial rollouts: tokens from 3 on at v1.
    for ro in rollouts[:2]:
        ro.token_versions = [0] * 3 + [1] * (len(ro.response_ids) - 3)
    batch = collate(rollouts, tok.pad_token_id)
    logp, _, _ = score_at_versions(trainer, batch, models.__getitem__)
    # Reference: every version's rows scored separately with that version's model.
    for v, model in models.items():
        rows = ((batch.token_versions == v) & batch.response_mask.bool()).any(1).nonzero().squeeze(1)
        expected, _ = trainer.score_old(batch.select(rows), model)
        at_v = (batch.token_versions[rows] == v) & batch.response_mask[rows].bool()
        assert torch.equal(logp[rows][at_v], expected[at_v])  # batched the same way: bit-equal
        # The whole batch at once: other batching, other padding columns cut, so float
        # rounding (about 1 ulp of |log p| < 16).
        whole, _ = trainer.score_old(batch, model)
        sel = (batch.token_versions == v) & batch.response_mask.bool()
        assert torch.allclose(logp[sel], whole[sel], atol=1e-5, rtol=0)
    # A batch of one version is one forward over the whole batch, as before.
    single = collate(rollouts[2:6], tok.pad_token_id)
    assert torch.equal(score_at_versions(trainer, single, models.__getitem__)[0],
                       trainer.score_old(single, v0)[0])


def test_partial_rollout_samples_each_token_from_its_version(two_versions):
    """Weights switch after decode step 4: later tokens are drawn from version 1 over their
    whole prefix (the KV cache is recomputed), and each token records its version."""
    trainer, v0, tok = two_versions
    gen = HFGenerator(v0, tok.eos_token_id, tok.pad_token_id, "fp32")
    calls = []

    def refresh() -> bool:
        calls.append(1)
        if len(calls) == 4:
            gen.load_weights(trainer.model.state_dict(), 1)
            return True
        return False

    rollouts = _rollouts(tok, v0, 0, 0)  # same prompts, unswitched, for the prefix check
    task = build_task("countdown")
    problems = [task.train_problem(i) for i in range(3)]
    switched = gen.generate([encode_exact(tok, p.prompt) for p in problems],
                            [p.id for p in problems], SAMPLING, seed=0, refresh=refresh)
    long = [ro for ro in switched if len(ro.response_ids) > 4]
    assert long and all(ro.token_versions[:4] == [0] * 4 and set(ro.token_versions[4:]) == {1}
                        for ro in long)
    for a, b in zip(rollouts, switched):  # same seed: identical until the switch
        assert a.response_ids[:4] == b.response_ids[:4]
    batch = collate(long, tok.pad_token_id)
    logp, _, _ = score_at_versions(trainer, batch, {0: v0, 1: trainer.model}.__getitem__)
    mask = batch.response_mask.bool()
    assert torch.allclose(logp[mask], batch.logp_rollout[mask], atol=1e-5, rtol=0)
    wrong, _ = token_logprobs(v0, batch, SAMPLING)  # scored at one version: a visible error
    assert (wrong[:, 4:] - batch.logp_rollout[:, 4:]).abs()[mask[:, 4:]].max() > 1e-3


def test_async_partial_rollouts_train(warm_model_dir, tmp_path, monkeypatch):
    # Weights land mid-batch by construction: the worker making slot 1 (at version 0) stops
    # at its first decode-step boundary and waits there for a newer version; the trainer
    # publishes version 1 (after training slot 0) only once the worker is waiting. So every
    # response of slot 1 still sampling at decode step 1 spans versions 0 and 1.
    steps, run_dir = 12, tmp_path / "run"
    cfg = _gated(warm_model_dir, tmp_path, f"train.steps={steps}", "loop.partial=true",
                 "loop.max_staleness=1", "rollout.max_new_tokens=48", "rollout.temperature=10",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "train.lr=1e-3",
                 switch_slot=1)
    real_publish = Scheduler.publish

    def publish_1_once_slot_1_is_mid_batch(sched, version, weights):
        if version == 1:
            assert wait_until((tmp_path / "gate" / "mid-batch").exists,
                              lambda: all(w.is_alive() for w in sched.backend.workers))
        real_publish(sched, version, weights)

    monkeypatch.setattr(Scheduler, "publish", publish_1_once_slot_1_is_mid_batch)
    train(cfg)
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok and a.trained == 2 * steps and a.max_staleness <= 1
    rows = read_jsonl(run_dir / "metrics.jsonl")[1:]
    partial = [r["async/partial_frac"] for r in rows]
    print("share of responses spanning two versions, per step:", partial)
    # Step 2 trains slot 1. Near-uniform sampling (temperature 10) rarely ends a response at
    # its first token, and which ones do is fixed by the seed, not by timing.
    assert partial[1] > 0
    # fp32 generator: pi_old per token is exact, so the numerical part stays at kernel noise
    # on the batches that spanned two versions too.
    assert max(r["numerical/abs_log_ratio/max"] for r in rows) < 1e-4


# -- stop and resume -----------------------------------------------------------------------------


def test_sigterm_mid_run_resumes_with_nothing_lost_or_trained_twice(warm_model_dir, tmp_path):
    steps, run_dir, gate_dir = 12, tmp_path / "run", tmp_path / "gate"
    args = [f"model.path={warm_model_dir}", *ASYNC, f"train.steps={steps}", "loop.workers=2",
            "loop.max_staleness=2", "run.checkpoint_every=0", "rollout.precision=bf16"]
    # A worker holds slot 3 (problems 12..15; every:1 publishing, no drops: slot k holds
    # problems 4k..4k+3) until the SIGTERM has been sent.
    args += gate(gate_dir, load_config(None, args), hold="countdown-train-12")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def tether(*a):
        return subprocess.Popen([sys.executable, "-m", "tether.cli", "train", *a], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    run = tether(*args, f"run.dir={run_dir}")
    metrics = run_dir / "metrics.jsonl"
    # Slot 3 held and steps 0..3 logged: the trainer waits for slot 3, or is about to check
    # for a stop after step 3, and slot 3 is released only after the signal. So the run
    # stops after step 3 or 4, and either way admission has more issued than trained
    # (slots 3, 4 or 4, 5 at eta = 2): something is in flight at the stop.
    started = wait_until(lambda: (gate_dir / "held").exists() and lines(metrics) >= 4,
                         lambda: run.poll() is None)
    assert started, run.communicate()[1][-2000:]
    run.send_signal(signal.SIGTERM)
    (gate_dir / "release").touch()
    _, err = run.communicate(timeout=120)
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
    # Quiet output: one line per worker start, no third-party progress bars.
    assert sorted(re.findall(r"^tether: rollout worker (\d) ready", err, re.MULTILINE)) == ["0", "1"]
    assert "Loading weights" not in err and "it/s]" not in err, err[-2000:]
    stopped = audit(run_dir / "ledger.jsonl")
    assert stopped.ok and stopped.open == []  # everything in flight was dropped, with its reason
    in_flight = stopped.dropped["in_flight_at_stop"]
    assert in_flight > 0 and stopped.trained in (3 * 4, 4 * 4)
    assert len(stopped.awaiting_reissue) == in_flight  # issued again only on resume

    resumed = tether("--resume", str(run_dir))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    a = audit(run_dir / "ledger.jsonl")
    assert a.ok, a.problems  # no prompt trained twice, no outcome without an issue
    assert a.open == [] and a.trained == steps * 4 and a.awaiting_reissue == []
    assert a.dropped == stopped.dropped  # nothing else dropped
    assert a.issued == steps * 4 + in_flight  # the dropped ones issued once more
    assert [r["step"] for r in read_jsonl(metrics)] == list(range(steps + 1))


def test_audit_refuses_an_attempt_issued_before_the_previous_was_dropped(tmp_path):
    ledger = Ledger(tmp_path / "ledger.jsonl")
    ledger.issued(0, [(7, 0)], 0)
    ledger.issued(1, [(7, 1)], 0)  # attempt 1 while attempt 0 is still in flight
    ledger.dropped(0, [(7, 0)], "worker_died")
    ledger.issued(2, [(8, 0)], 0)
    ledger.dropped(2, [(8, 0)], "worker_died")  # never issued again
    ledger.close()
    a = audit(tmp_path / "ledger.jsonl")
    assert a.problems == ["prompt 7 attempt 1 issued before attempt 0 was dropped"]
    assert a.open == [(7, 1)] and a.awaiting_reissue == [(8, 0)]


STOP_WITH_UNREAD_WEIGHTS = """
import sys
from tether.config import load_config
from tether.rollout.backend import LocalBackend

if __name__ == "__main__":
    cfg = load_config("configs/countdown.yaml", [f"model.path={sys.argv[1]}", "loop.mode=async",
                                                 "loop.workers=1", "run.threads=1"])
    backend = LocalBackend(cfg, sys.argv[1])
    # A version the idle worker never reads, larger than a pipe holds: the feeder thread blocks.
    backend.publisher.queues[0].put(b"x" * (1 << 20))
    backend.stop()
"""


def test_trainer_process_exits_after_stop_with_unread_weights(warm_model_dir, tmp_path):
    # Seen in an experiment: an async cell wrote done.json, then hung at exit waiting for a
    # queue's feeder thread to write versions its stopped worker would never read.
    script = tmp_path / "stop.py"
    script.write_text(STOP_WITH_UNREAD_WEIGHTS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), str(warm_model_dir)], env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
