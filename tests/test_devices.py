"""The device bugs a GPU would hit at its first step (issue 36), caught on a CPU.

No GPU here: "meta" tensors stand in for a device other than the CPU where a test needs
one (torch refuses to mix them with CPU tensors, as it refuses CUDA with CPU). What only a
GPU can show runs in benchmarks/gpu_check.sh; docs/performance.md says what has run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tether.config import ConfigError, load_config
from tether.distributed import rank_device
from tether.errors import InputError
from tether.models import build_tiny_model
from tether.models.routing import add_router_noise, pad_routes, route, routers
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import collate, decode, process_logits, score_tokens
from tether.setup import actor_config, configure_numerics, vllm_memory
from tether.trainer import Trainer, group_advantages
from tether.trainer.channel import on_device

REPO = Path(__file__).resolve().parents[1]


def test_pad_routes_are_built_where_asked():
    """R2 records routes on the model's device; their padding buffer must be there too (a
    CPU buffer would hand the next forward CPU indices into GPU probabilities)."""
    routes = pad_routes(2, 5, 3, 2, torch.uint8, torch.device("meta"))
    assert routes.device.type == "meta" and routes.shape == (2, 5, 3, 2)
    assert pad_routes(1, 1, 1, 2, torch.uint8).tolist() == [[[[0, 1]]]]  # CPU by default


def test_router_noise_is_drawn_where_its_generator_lives_and_added_on_the_logits_device():
    """A generator draws only on its own device (a CUDA generator refuses a CPU draw); the
    noise then joins logits on theirs. Before: drawn on the CPU whatever the generator, then
    added to the logits (CPU + meta fails here as CPU + CUDA fails on a GPU)."""
    model = build_tiny_model(21, moe=True, seed=0)
    add_router_noise(model, 0.5, torch.Generator().manual_seed(0))
    _, router = routers(model)[0]
    router.to("meta")
    logits, top, idx = router(torch.zeros(4, router.weight.shape[1], device="meta"))
    assert logits.device.type == top.device.type == idx.device.type == "meta"


def test_replayed_experts_follow_the_router_to_its_device():
    model = build_tiny_model(21, moe=True, seed=0)
    n_moe = len(routers(model))
    ids = torch.randint(0, 21, (2, 5), generator=torch.Generator().manual_seed(0))
    with route(model, record=True) as routes:
        model(ids)
        recorded = routes.pop(tuple(ids.shape))
    assert recorded.shape[2] == n_moe
    _, router = routers(model)[0]
    with route(model, replay=recorded):
        router.to("meta")
        _, _, idx = router(torch.zeros(10, router.weight.shape[1], device="meta"))
    assert idx.device.type == "meta"


def test_each_trainer_rank_gets_a_gpu_of_its_own_or_a_named_error():
    cpu, cuda0, cuda1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert rank_device(cpu, 3, gpus=0) == cpu
    assert rank_device(torch.device("cuda"), 1, gpus=2) == cuda1
    assert rank_device(cuda1, 2, gpus=4) == torch.device("cuda", 3)
    assert rank_device(cuda0, 0, gpus=1) == cuda0
    with pytest.raises(InputError, match=r"rank 1 needs cuda:2 .* torch sees 2 GPU"):
        rank_device(cuda1, 1, gpus=2)


def test_what_rank_0_sends_reaches_a_rank_on_its_own_device():
    """Each step's (batch, advantages, logp_old, topk) and the start state go through host
    memory and are moved to the rank's device; None and plain values pass as they are."""
    batch = collate([_rollout([3, 4], prompt=[5, 6]) for _ in range(2)], pad_id=0)
    work = (batch, torch.zeros(2), None, None)
    moved = on_device(work, "meta")
    assert isinstance(moved, tuple) and moved[2] is None and moved[3] is None
    assert moved[0].input_ids.device.type == moved[1].device.type == "meta"
    assert moved[0].topk_ids is None and moved[0].response_ids.shape == (2, 2)
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                                                          "param_groups": [{"lr": 1e-3}]},
             "version": 4}
    out = on_device(state, "meta")
    assert out["model"]["w"].is_meta and out["optimizer"]["state"][0]["step"].is_meta
    assert out["optimizer"]["param_groups"] == [{"lr": 1e-3}] and out["version"] == 4
    assert on_device(work, "cpu")[1] is work[1]  # already there: not copied


def test_data_parallel_ranks_with_the_in_process_vllm_engine_are_refused_at_load():
    """vLLM in the trainer's process takes torch.distributed's default group for itself."""
    with pytest.raises(ConfigError, match="train.world_size.*rollout.engine.*loop.mode"):
        load_config(None, ["train.world_size=2", "rollout.engine=vllm"])
    # async: the engines live in rollout workers, the trainer's process group is its own
    load_config(None, ["train.world_size=2", "rollout.engine=vllm", "loop.mode=async"])


def test_vllm_memory_settings_come_from_the_config():
    r = load_config(None, ["rollout.engine=vllm"]).rollout
    on_cpu = vllm_memory(r, on_cpu=True)
    assert on_cpu == {"max_model_len": None, "kv_cache_bytes": 2**28,
                      "gpu_memory_utilization": 0.3, "enforce_eager": True}
    assert vllm_memory(r, on_cpu=False)["kv_cache_bytes"] is None  # vLLM sizes it on a GPU
    r = load_config(None, ["rollout.vllm_max_model_len=4096", "rollout.vllm_kv_cache_gib=2",
                           "rollout.vllm_gpu_memory_utilization=0.5",
                           "rollout.vllm_enforce_eager=false"]).rollout
    assert vllm_memory(r, on_cpu=False) == {"max_model_len": 4096, "kv_cache_bytes": 2 * 2**30,
                                            "gpu_memory_utilization": 0.5,
                                            "enforce_eager": False}
    with pytest.raises(ConfigError, match="rollout.vllm_gpu_memory_utilization"):
        load_config(None, ["rollout.vllm_gpu_memory_utilization=1.5"])


def test_a_ray_actor_places_its_engine_on_what_ray_gave_it_not_the_drivers_device():
    """Ray hides every GPU from an actor without one, and shows an actor's GPU as cuda:0."""
    base = ["loop.mode=async", "loop.backend=ray", "run.device=cuda:1"]
    assert actor_config(load_config(None, base)).run.device == "cpu"
    gpu = actor_config(load_config(None, [*base, "loop.worker_gpus=0.5"]))
    assert gpu.run.device == "cuda" and gpu.loop.worker_gpus == 0.5


def test_bf16_training_scores_with_an_fp32_output_embedding():
    """bf16 autocast stops before the LM head: log-probs are the fp32 head's on the bf16
    forward's hidden states, not those of bf16-rounded logits (off by ~1e-2 here). The
    hidden states come from the same forward as score_tokens' (shared prompts): a plain
    forward sums in another order, which in bf16 moves log-probs by ~1e-3 on some CPUs."""
    model = build_tiny_model(21, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    batch = collate([_rollout(torch.randint(2, 21, (6,), generator=g).tolist())
                     for _ in range(3)], pad_id=0)
    sampling = SamplingParams(n=3, max_new_tokens=6)
    with torch.no_grad():
        got = score_tokens(model, batch, sampling, precision="bf16").logp
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden, _ = decode(model, batch.input_ids, batch.attention_mask, prompt_len=batch.prompt_len)
            rounded_logits = model.get_output_embeddings()(hidden)
        logits = model.get_output_embeddings()(hidden.float())
    P = batch.prompt_len

    def logp_of(z: torch.Tensor) -> torch.Tensor:
        lp = process_logits(z.float()[:, P - 1:-1], 1.0, 0, 1.0)
        return lp.gather(-1, batch.response_ids[..., None]).squeeze(-1)

    assert rounded_logits.dtype == torch.bfloat16
    torch.testing.assert_close(got, logp_of(logits), rtol=0, atol=1e-5)
    assert (got - logp_of(rounded_logits)).abs().max() > 1e-3


def test_deterministic_mode_trains_on_cpu_kernels(tmp_path):
    """run.deterministic=true turns on torch's deterministic algorithms; every op of a
    training step has a deterministic CPU kernel (an op without one would raise)."""
    cfg = load_config(None, ["run.deterministic=true"])
    was = torch.are_deterministic_algorithms_enabled()
    try:
        configure_numerics(cfg)
        assert torch.are_deterministic_algorithms_enabled()
        model = build_tiny_model(21, seed=0)
        g = torch.Generator().manual_seed(1)
        batch = collate([_rollout(torch.randint(2, 21, (4,), generator=g).tolist(), group=i // 2,
                                  reward=float(i % 2)) for i in range(4)], pad_id=0)
        trainer = Trainer(model, cfg.train, SamplingParams(n=2, max_new_tokens=4))
        adv = group_advantages(batch.rewards, batch.group_ids, True)
        metrics, _ = trainer.train_on(batch, adv, None, None)
        assert trainer.version == 1 and metrics[0]["guard/skipped"] == 0
        assert metrics[0]["train/grad_norm"] > 0
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_shipped_gpu_config_loads_and_says_what_a_real_model_needs():
    cfg = load_config(REPO / "configs" / "gpu.yaml")
    r = cfg.rollout
    assert (r.engine, r.precision, cfg.train.precision) == ("vllm", "bf16", "bf16")
    assert r.vllm_max_model_len >= r.max_new_tokens and cfg.train.world_size == 1


def _rollout(response: list[int], prompt: list[int] | None = None, group: int = 0,
             reward: float | None = None) -> Rollout:
    """A finished hf rollout of `response` after `prompt` (default 5 6 7), log-prob -1 each."""
    return Rollout(prompt_id=f"p{group}", group_id=group, prompt_ids=prompt or [5, 6, 7],
                   response_ids=response, logp_rollout=[-1.0] * len(response), version=0,
                   engine="hf", precision="fp32", finish_reason="length", reward=reward)
