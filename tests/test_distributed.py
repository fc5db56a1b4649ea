"""The data-parallel trainer: 2 gloo ranks, each on half of every mini-batch, make the same
update as one process on the whole batch (to 1e-6), for a token-mean preset (tis) and a
sequence-mean one (gspo); and the mean of the ranks' own token-means would not."""

from __future__ import annotations

import copy
import multiprocessing

import pytest
import torch

from tests.race_gates import kill_rank_1_before
from tether.checkpoint import list_checkpoints, resume_config
from tether.config import ConfigError, load_config
from tether.distributed import RankFailed, start_ranks
from tether.errors import EnvironmentFault
from tether.estimators import TokenBatch
from tether.ledger import audit
from tether.logger import read_jsonl
from tether.loops import train
from tether.models import load_model
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import HFGenerator
from tether.scoring import collate, token_logprobs
from tether.setup import sampling_params
from tether.tasks import build_task
from tether.trainer import Trainer, group_advantages

SETTINGS = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=12",
            "train.micro_batch=3", "train.lr=1e-4", "run.threads=1"]


def _batch(model, tokenizer, sampling):
    """16 sampled responses of varied length, with a numerical mismatch (noisy logp_rollout)
    so that tis's weights matter, and rewards that give non-zero advantages."""
    task = build_task("countdown")
    problems = [task.train_problem(i) for i in range(4)]
    gen = HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
    # The first sampling seed whose two rank shards differ in tokens: which seed that is
    # depends on the CPU's vector kernels (seed 3 on AVX-512, not on AVX2).
    for seed in range(3, 23):
        rollouts = gen.generate([encode_exact(tokenizer, p.prompt) for p in problems],
                                [p.id for p in problems], sampling, seed=seed)
        batch = collate(rollouts, tokenizer.pad_token_id)
        lengths = batch.response_mask.sum(1)
        if lengths[:8].sum() != lengths[8:].sum():
            break
    assert lengths[:8].sum() != lengths[8:].sum()  # the two ranks' shards differ in tokens
    g = torch.Generator().manual_seed(0)
    for ro in rollouts:
        ro.reward = float(torch.rand((), generator=g))
    batch = collate(rollouts, tokenizer.pad_token_id)
    batch.logp_rollout += 0.2 * torch.randn(batch.logp_rollout.shape, generator=g) * batch.response_mask
    return batch


@pytest.mark.parametrize("estimator,minibatches", [("tis", 1), ("gspo", 1), ("gspo", 2)])
def test_two_gloo_ranks_make_the_whole_batch_update(warm_model_dir, estimator, minibatches):
    cfg = load_config("configs/countdown.yaml",
                      [f"model.path={warm_model_dir}", f"train.estimator={estimator}",
                       f"train.minibatches={minibatches}", "train.world_size=2", *SETTINGS])
    model, tokenizer = load_model(warm_model_dir)
    sampling = sampling_params(cfg, model.config.vocab_size)
    batch = _batch(model, tokenizer, sampling)
    adv = group_advantages(batch.rewards, batch.group_ids, True)
    copy_of = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference = Trainer(copy.deepcopy(model), cfg.train, sampling)  # one process, world_size ignored
    logp_old, _ = reference.score_old(batch, model)
    ref_rows, ref_logp = reference.train_on(batch, adv, logp_old, None)

    trainer = Trainer(model, cfg.train, sampling)
    ranks = start_ranks(trainer, cfg, warm_model_dir)
    try:
        rows, logp = trainer.train_on(batch, adv, logp_old, None)
    finally:
        ranks.stop()
    assert trainer.version == reference.version == minibatches
    # The gradient (the last mini-batch's, clipped): equal up to float summation order,
    # 1e-5 of its scale (a second mini-batch starts from weights already 1e-7 apart). The
    # parameters after AdamW's steps: its first step is about lr * g / (|g| + 1e-8) per
    # element, so an element whose gradient is within 10x the measured order noise of the
    # two sums (a few of the 2.4 M) can take another step, bounded by Adam's 2 lr a step;
    # every other element agrees to 1e-6.
    lr = cfg.train.lr
    for (name, p), q in zip(model.named_parameters(), reference.model.parameters()):
        err = (p.grad - q.grad).abs().max()
        assert err <= 1e-5 * q.grad.abs().max(), name
        noise = q.grad.abs() < 10 * err + 1e-8
        assert ((p - q).abs() <= 2 * lr * minibatches + 1e-7).all(), name
        if minibatches == 1:
            assert torch.allclose(p[~noise], q[~noise], atol=1e-6, rtol=0), name
        else:  # the first step's noise elements (gradients unseen here) carry into the second
            assert ((p - q).abs() > 1e-6).float().mean() < 1e-4, name
        assert not torch.equal(p, copy_of[name]), name  # and it did move
    # Each micro-batch cuts its own padding columns, so a row's log-probs come from kernels
    # of other shapes than in one process: float rounding, about 1 ulp of |log p| < 16.
    assert torch.allclose(logp, ref_logp, atol=1e-5, rtol=0)
    for row, ref in zip(rows, ref_rows):
        assert row["loss/total"] == pytest.approx(ref["loss/total"], abs=1e-6)
        assert row["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-5)


def test_mean_of_rank_token_means_is_not_the_batch_token_mean(warm_model_dir):
    """Why the denominators are global: averaging each half's own token-mean gradient
    weights the tokens of the half with fewer tokens more."""
    cfg = load_config("configs/countdown.yaml",
                      [f"model.path={warm_model_dir}", "train.estimator=tis", *SETTINGS])
    model, tokenizer = load_model(warm_model_dir)
    sampling = sampling_params(cfg, model.config.vocab_size)
    batch = _batch(model, tokenizer, sampling)
    adv = group_advantages(batch.rewards, batch.group_ids, True)
    estimator = Trainer(model, cfg.train, sampling).estimator

    def grad(rows: slice) -> torch.Tensor:
        model.zero_grad()
        part = batch.select(rows)
        logp, _ = token_logprobs(model, part, sampling)
        estimator(TokenBatch(logp=logp, logp_old=logp.detach(), logp_rollout=part.logp_rollout,
                             advantages=adv[rows], mask=part.response_mask)).loss.backward()
        return torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])

    whole = grad(slice(0, 16))
    averaged = (grad(slice(0, 8)) + grad(slice(8, 16))) / 2
    assert (whole - averaged).abs().max() > 1e-4


def test_config_refuses_shards_that_do_not_divide():
    with pytest.raises(ConfigError, match="train.world_size"):
        load_config("configs/countdown.yaml", ["rollout.prompts_per_step=3",
                                               "rollout.group_size=3", "train.world_size=2"])


def _two_rank_run(model_dir, run_dir, steps: int, *extra: str):
    """A short run with 2 trainer ranks, no evaluation or monitor."""
    return load_config("configs/countdown.yaml",
                       [f"model.path={model_dir}", f"run.dir={run_dir}", "run.progress=false",
                        "train.world_size=2", f"train.steps={steps}", "task.eval_size=16",
                        "eval.every=0", "eval.samples=0", "diagnostics.monitor_every=0",
                        *extra, *SETTINGS])


def test_async_loop_with_two_ranks_accounts_for_every_prompt(warm_model_dir, tmp_path):
    steps = 3
    cfg = _two_rank_run(warm_model_dir, tmp_path, steps, "loop.mode=async")
    train(cfg)
    a = audit(tmp_path / "ledger.jsonl")
    assert a.ok and a.open == [] and a.trained == steps * 4, a.problems
    rows = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert rows[-1]["version"] == steps and all(r["guard/skipped"] == 0 for r in rows)


def test_dead_rank_stops_the_run_with_a_checkpoint_and_resume_continues(warm_model_dir,
                                                                         tmp_path, monkeypatch):
    steps, straight, broken = 4, tmp_path / "straight", tmp_path / "broken"
    train(_two_rank_run(warm_model_dir, straight, steps, "run.checkpoint_every=100"))

    # Rank 1 dies between steps, at a known point: after steps 1 and 2, as step 3's
    # training starts (killed and reaped first, so rank 0 finds it gone).
    kill_rank_1_before(monkeypatch, 3)
    with pytest.raises(RankFailed, match="trainer rank 1 .* died during step 3") as failure:
        train(_two_rank_run(warm_model_dir, broken, steps, "run.checkpoint_every=100"))
    monkeypatch.undo()
    assert failure.value.intact and "--resume" in str(failure.value)
    (step, _), = list_checkpoints(broken)  # the only checkpoint: the one saved at the fault
    assert step == 2
    train(resume_config(broken), resume=True)  # a fresh rank 1; the run completes
    # Bit for bit the uninterrupted run (as tests/test_resume.py checks for one process):
    # the checkpoint at the fault holds rank 0's weights, optimizer and RNG after step 2,
    # and the new rank 1 starts from a copy of them (sharing rank 0's Adam moments through
    # the queue instead, both ranks stepped them: step 4 differed).
    a, b = (read_jsonl(d / "metrics.jsonl") for d in (straight, broken))
    assert [r["step"] for r in b] == list(range(steps + 1))
    for row_a, row_b in zip(a, b, strict=True):
        row_a, row_b = ({k: v for k, v in r.items() if not k.startswith("time/")}
                        for r in (row_a, row_b))
        assert row_a == row_b, f"step {row_a['step']} differs"


def test_a_rank_that_does_not_join_in_time_fails_naming_it(warm_model_dir, tmp_path):
    """A rank's process needs seconds to start (spawn, imports): 0.2 s is too short, and the
    run fails then, not after the process group's own minutes; it leaves no rank and no
    run directory behind."""
    run_dir = tmp_path / "run"
    with pytest.raises(EnvironmentFault, match=r"trainer rank\(s\) \[1\] did not start within "
                                                r"0.2 s \(run.start_timeout\)"):
        train(_two_rank_run(warm_model_dir, run_dir, 2, "run.start_timeout=0.2"))
    assert [p.name for p in multiprocessing.active_children() if p.name.startswith("tether-rank")] == []
    assert not run_dir.exists()
