"""MoE routing replay (issue 14): R3 replays the generator's experts, R2 the logp_old forward's.

On the random tiny models (4 layers; the MoE one 4 experts, top 2): what replay removes
from the numerical mismatch, that gradients still reach the router, that replaying a
model's own routing is exact, the storage cost, the errors, and a resumed r3 run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tether.config import TrainConfig, load_config
from tether.diagnostics import compare_routes, decompose, divergence_metrics
from tether.inspection import inspect_run
from tether.logger import read_jsonl
from tether.loops import train
from tether.models import build_tiny_model
from tether.models.routing import route, routers, routes_dtype
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.run import check_routing_replay
from tether.scoring import collate, score_at_versions, score_tokens, token_logprobs
from tether.testbed import ensure_default_model
from tether.trainer import Trainer, group_advantages

from .conftest import TEST_CACHE

SAMPLING = SamplingParams(n=4, max_new_tokens=16)


@pytest.fixture(scope="module")
def moe():
    return build_tiny_model(21, moe=True, seed=0)


def _batch(model, precision: str = "fp32", noise: float = 0.0, seed: int = 0):
    """32 responses to 8 random prompts of 4-7 tokens, with the generator's routing recorded."""
    gen = HFGenerator(model, 1, 0, precision, noise, record_routes=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 21, (4 + i % 4,), generator=g).tolist() for i in range(8)]
    return collate(gen.generate(prompts, [str(i) for i in range(8)], SAMPLING, seed=seed), 0)


def _numerical(model, batch) -> dict[str, float]:
    with torch.no_grad():
        logp_old, _ = token_logprobs(model, batch, SAMPLING)
    return divergence_metrics(decompose(batch.logp_rollout, logp_old, None, batch.response_mask)
                              .log_rho, batch.response_mask, "numerical")


def test_r3_with_an_fp32_generator_agrees_as_tightly_as_the_dense_model(moe):
    dense = build_tiny_model(21, moe=False, seed=0)
    gen = HFGenerator(dense, 1, 0, "fp32")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 21, (4 + i % 4,), generator=g).tolist() for i in range(8)]
    dense_batch = collate(gen.generate(prompts, [str(i) for i in range(8)], SAMPLING, seed=0), 0)
    d = _numerical(dense, dense_batch)
    m = _numerical(moe, _batch(moe))  # replays the generator's experts (batch.routed_experts)
    print("dense", d["numerical/abs_log_ratio/max"], "moe r3", m["numerical/abs_log_ratio/max"])
    # Kernel order only (KV cache against a full forward): the bounds of the dense tests.
    for x in (d, m):
        assert x["numerical/abs_log_ratio/max"] < 1e-5 and x["numerical/k3_kl/mean"] < 1e-10


def test_r3_removes_the_rerouting_of_a_bf16_generator_with_router_noise(moe):
    batch = _batch(moe, "bf16", noise=0.1)
    on = _numerical(moe, batch)
    off = _numerical(moe, replace(batch, routed_experts=None))
    with torch.no_grad():
        own = score_tokens(moe, replace(batch, routed_experts=None), SAMPLING, record=True).experts
    rate = compare_routes(own, batch.routed_experts, batch)
    print("routing", rate, "k3 r3", on["numerical/k3_kl/mean"], "none", off["numerical/k3_kl/mean"])
    assert rate["numerical/routing_disagreement/mean"] > 0.01
    # What is left with r3 is bf16 arithmetic in the experts chosen alike.
    assert on["numerical/k3_kl/mean"] < 0.5 * off["numerical/k3_kl/mean"]
    assert on["numerical/abs_log_ratio/max"] < off["numerical/abs_log_ratio/max"]


def _router_grads(model, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, batch, SAMPLING)
    (-logp.sum()).backward()
    return [r.weight.grad.clone() for _, r in routers(model)]


@pytest.mark.parametrize("replay", ["r2", "r3"])
def test_gradients_reach_the_router_under_replay(moe, replay):
    batch = _batch(moe, "bf16", noise=0.1)
    trainer = Trainer(moe, TrainConfig(routing_replay=replay), SAMPLING)
    if replay == "r2":
        batch = replace(batch, routed_experts=None)
    _, _, replayed = score_at_versions(trainer, batch, lambda v: moe)
    assert replayed.routed_experts is not None  # r3: the generator's; r2: logp_old's
    grads = _router_grads(moe, replayed)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    if replay == "r2":  # its own routing at the same weights: the very gradient of no replay
        plain = _router_grads(moe, batch)  # (up to float order: it runs each prompt once)
        for a, b in zip(grads, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_r2_at_the_same_weights_changes_no_logprob(moe):
    batch = replace(_batch(moe, "bf16"), routed_experts=None)
    base = token_logprobs(moe, batch, SAMPLING)[0]
    trainer = Trainer(moe, TrainConfig(routing_replay="r2", lr=1e-3), SAMPLING)
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    logp_old, _, replayed = score_at_versions(trainer, batch, lambda v: moe)
    _, logp = trainer.train_on(replayed, group_advantages(batch.rewards, batch.group_ids, True),
                               logp_old, None)
    moe.load_state_dict(state)
    assert torch.equal(logp, logp_old)  # bit for bit: both forwards replay the same experts
    torch.testing.assert_close(logp, base, rtol=0, atol=1e-6)  # base: each prompt run once


def test_routes_cost_one_byte_per_token_layer_and_expert(moe):
    batch = _batch(moe)
    ro_bytes = batch.routed_experts.element_size()
    B, L = batch.input_ids.shape
    assert batch.routed_experts.dtype == torch.uint8 and ro_bytes == 1
    assert batch.routed_experts.shape == (B, L, 4, 2)  # (rows, positions, layers, top-k)
    assert routes_dtype(256) == torch.uint8 and routes_dtype(257) == torch.int16
    # The docs' figure: a Qwen3-MoE-sized router (128 experts, 48 layers, top-8) records
    # 8192 tokens at 1 byte each, 3 MiB per response.
    assert torch.empty((8192, 48, 8), dtype=routes_dtype(128)).nbytes == 3 * 2**20


def test_routing_replay_needs_a_moe_model_tether_can_patch():
    dense = build_tiny_model(21, moe=False, seed=0)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM is not a mixture-of-experts"):
        check_routing_replay("r3", dense)
    check_routing_replay("none", dense)
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    granite = GraniteMoeForCausalLM(GraniteMoeConfig(
        vocab_size=21, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="GraniteMoeForCausalLM routes with GraniteMoe"):
        check_routing_replay("r2", granite)


def test_mixtral_replays_its_own_routing_exactly():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=21, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)).eval()
    ids = torch.randint(2, 21, (3, 7))
    with torch.no_grad(), route(model, record=True) as routes:
        a = model(input_ids=ids).logits
        experts = routes.pop(tuple(ids.shape))
    with torch.no_grad(), route(model, replay=experts):
        b = model(input_ids=ids).logits
    assert experts.shape == (3, 7, 2, 2) and torch.equal(a, b)


def test_r3_run_resumed_from_a_checkpoint_is_bit_identical(tmp_path):
    """bf16 + router noise + a generator lagging one version, r3: the resumed run continues
    the same trajectory. Checkpoints hold no rollouts: a batch after the resume is sampled
    again by the generator restored from the kept snapshot, and its routes with it."""
    model_dir = ensure_default_model(TEST_CACHE, moe=True, seed=0, warmstart_steps=20,
                                     task_kwargs={"use_all": True}, verbose=False)
    common = [f"model.path={model_dir}", "run.progress=false", "run.threads=1",
              "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
              "rollout.precision=bf16", "rollout.router_noise=0.1", "sync.lag=1",
              "train.routing_replay=r3", "train.lr=1e-3", "task.format_weight=0.5",
              "task.eval_size=8", "eval.every=0",
              "eval.samples=0", "diagnostics.monitor_every=2", "diagnostics.monitor_prompts=2",
              "run.checkpoint_every=2"]

    def rows(run_dir):  # (the 2-step run also evaluated after step 2, as its last)
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/"))}
                for r in read_jsonl(run_dir / "metrics.jsonl")]

    train(load_config(None, [*common, f"run.dir={tmp_path / 'straight'}", "train.steps=4"]))
    train(load_config(None, [*common, f"run.dir={tmp_path / 'split'}", "train.steps=2"]))
    from tether.checkpoint import resume_config

    train(resume_config(tmp_path / "split", ["train.steps=4"]), resume=True)
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "split")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4] and a == b
    assert all(r["train/grad_norm"] > 0 for r in a[1:])  # it learns: a trajectory to follow
    assert a[2]["numerical/replay_off/k3_kl/mean"] > a[2]["numerical/k3_kl/mean"]
    assert a[-1]["numerical/routing_disagreement/mean"] > 0
    text, _ = inspect_run(tmp_path / "straight", plots=False)
    assert "routing replay (r3), steps 2, 4: numerical k3 KL" in text


def test_r2_on_a_partial_rollout_takes_each_position_from_its_token_version(moe):
    """A row whose first 3 tokens were sampled at version 0 and the rest at version 1: the
    replayed experts are version 0's up to the position predicting token 2 (the prompt's
    included), version 1's after; rows of one version are that version's throughout."""
    v1 = build_tiny_model(21, moe=True, seed=1)
    gen = HFGenerator(moe, 1, 0, "fp32")
    rollouts = gen.generate([[3, 4, 5, 6], [7, 8, 9]], ["a", "b"],
                            SamplingParams(n=2, max_new_tokens=10), seed=0)
    for ro in rollouts[:2]:
        ro.token_versions = [0] * 3 + [1] * (len(ro.response_ids) - 3)
    batch = collate(rollouts, 0)
    trainer = Trainer(v1, TrainConfig(routing_replay="r2"), SAMPLING)
    _, _, replayed = score_at_versions(trainer, batch, {0: moe, 1: v1}.__getitem__)
    e, P = replayed.routed_experts, batch.prompt_len
    own0, own1 = (trainer.score(batch, m, record=True).experts for m in (moe, v1))
    n = len(rollouts[0].response_ids)
    assert torch.equal(e[2:], own0[2:])
    assert torch.equal(e[0, :P + 2], own0[0, :P + 2])
    assert torch.equal(e[0, P + 2:P + n - 1], own1[0, P + 2:P + n - 1])
