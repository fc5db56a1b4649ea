"""The HF generator's records: exact token ids and log-probs of the distribution sampled from."""

from __future__ import annotations

import copy

import pytest
import torch

from tether.rollout.hf import HFGenerator, process_logits
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import collate, token_logprobs

PROMPTS = [[2, 3, 4], [5, 6], [7, 8, 9, 10, 11]]


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.7, 6, 0.8)]
)
def test_recorded_logprobs_equal_trainer_logp_old(random_model, tokenizer, temperature, top_k, top_p):
    sampling = SamplingParams(n=4, temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=12, logprobs_topk=3)
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
    rollouts = gen.generate(PROMPTS, ["a", "b", "c"], sampling, seed=1)
    batch = collate(rollouts, tokenizer.pad_token_id)
    with torch.no_grad():
        logp_old, topk_old = token_logprobs(random_model, batch, sampling)
    m = batch.response_mask.bool()
    assert m.sum() > 20
    assert (logp_old[m] - batch.logp_rollout[m]).abs().max() < 1e-5
    assert (topk_old[m] - batch.topk_logp_rollout[m]).abs().max() < 1e-5
    # The record is the renormalised truncated distribution, not the raw softmax.
    if top_p < 1.0 or top_k > 0:
        with torch.no_grad():
            raw, _ = token_logprobs(random_model, batch, SamplingParams(temperature=temperature))
        assert (raw[m] < batch.logp_rollout[m] - 1e-4).any()


def test_process_logits_renormalises_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # top_p 0.7: mass before token 2 is 0.8 >= 0.7, so the nucleus is {0, 1}: 0.5/0.8, 0.3/0.8.
    lp = process_logits(logits, 1.0, 0, 0.7)
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    assert torch.isinf(lp[0, 2:]).all()
    # top_k 3 at temperature 1: 0.5/0.95, 0.3/0.95, 0.15/0.95.
    lp = process_logits(logits, 1.0, 3, 1.0)
    assert torch.allclose(lp[0, :3].exp(), torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def test_awkward_tokens_reach_the_trainer_exactly(random_model, tokenizer):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    responses = [
        [pad, 5, pad],  # a sampled pad token is data, not padding
        [eos],  # eos first: a one-token response
        [7, eos],  # eos mid-group: shorter than its siblings
        [3, 4, 5, 6, 7, 8],  # max length, no eos
    ]
    rollouts = [
        Rollout(prompt_id="p", group_id=0, prompt_ids=[2, 3] if i % 2 else [4], response_ids=ids,
                logp_rollout=[-0.5 * (j + 1) for j in range(len(ids))], version=0, engine="hf",
                precision="fp32", finish_reason="stop" if eos in ids else "length")
        for i, ids in enumerate(responses)
    ]
    batch = collate(rollouts, pad)
    for i, ids in enumerate(responses):
        n = len(ids)
        assert batch.response_ids[i, :n].tolist() == ids
        assert batch.response_mask[i].tolist() == [1.0] * n + [0.0] * (6 - n)
        assert batch.logp_rollout[i, :n].tolist() == rollouts[i].logp_rollout
        assert batch.input_ids[i, batch.prompt_len - len(rollouts[i].prompt_ids):batch.prompt_len].tolist() \
            == rollouts[i].prompt_ids


def test_generated_batches_round_trip(random_model, tokenizer):
    # An untrained model samples pads, early eos and max-length rows in one batch.
    sampling = SamplingParams(n=8, temperature=1.5, max_new_tokens=6)
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
    rollouts = gen.generate(PROMPTS, ["a", "b", "c"], sampling, seed=3)
    assert {r.finish_reason for r in rollouts} == {"stop", "length"}
    assert any(tokenizer.pad_token_id in r.response_ids for r in rollouts)
    batch = collate(rollouts, tokenizer.pad_token_id)
    for i, r in enumerate(rollouts):
        assert batch.response_ids[i, : len(r.response_ids)].tolist() == r.response_ids
        assert r.response_ids.count(tokenizer.eos_token_id) <= 1
        assert r.finish_reason == "stop" or len(r.response_ids) == sampling.max_new_tokens
    assert [r.group_id for r in rollouts] == [i // 8 for i in range(24)]


def test_same_seed_same_rollouts(random_model, tokenizer):
    sampling = SamplingParams(n=2, max_new_tokens=8)
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
    a = gen.generate(PROMPTS, ["a", "b", "c"], sampling, seed=7)
    b = gen.generate(PROMPTS, ["a", "b", "c"], sampling, seed=7)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_gives_the_whole_batch_gradient(random_model, tokenizer, agg):
    from tether.config import TrainConfig
    from tether.trainer import Trainer, group_advantages

    sampling = SamplingParams(n=4, max_new_tokens=8)
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
    batch = collate(gen.generate(PROMPTS, ["a", "b", "c"], sampling, seed=5), tokenizer.pad_token_id)
    batch.rewards = torch.arange(12.0) % 3  # varied rewards, so advantages are nonzero
    adv = group_advantages(batch.rewards, batch.group_ids, std_norm=True)
    grads = []
    for micro in (12, 5):  # one micro-batch vs three unequal ones (lengths differ per row)
        model = copy.deepcopy(random_model)
        cfg = TrainConfig(estimator="grpo", estimator_params={"agg": agg}, micro_batch=micro,
                          lr=1e-3)
        trainer = Trainer(model, cfg, sampling)
        logp_old, _ = trainer.score_old(batch, model)
        trainer.train_on(batch, adv, logp_old, None)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_micro_batching_gives_the_whole_batch_metrics(random_model, tokenizer):
    """Means, second moments and peaks of the weights do not depend on `train.micro_batch`."""
    from tether.config import TrainConfig
    from tether.trainer import Trainer, group_advantages

    sampling = SamplingParams(n=4, max_new_tokens=8)
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp8")
    batch = collate(gen.generate(PROMPTS, ["a", "b", "c"], sampling, seed=5), tokenizer.pad_token_id)
    batch.rewards = torch.arange(12.0) % 3
    adv = group_advantages(batch.rewards, batch.group_ids, std_norm=True)
    metrics = []
    for micro in (12, 5):
        trainer = Trainer(copy.deepcopy(random_model), TrainConfig(estimator="tis", micro_batch=micro),
                          sampling)
        logp_old, _ = trainer.score_old(batch, random_model)
        metrics.append(trainer.train_on(batch, adv, logp_old, None)[0][0])
    whole, parts = metrics
    keys = [k for k in whole if k.split("/")[-1] in ("mean", "max", "second_moment")
            or k.startswith("loss/")]
    assert {"numerical/is_weight/max", "correction/weight/max", "loss/total"} <= set(keys)
    assert whole["numerical/is_weight/max"] > 1.0  # fp8 makes the peak a real one
    for k in keys:
        assert parts[k] == pytest.approx(whole[k], rel=1e-5, abs=1e-7), k
