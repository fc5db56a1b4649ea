"""Diagnostics by cause, worked by hand, and the current-model monitor."""

from __future__ import annotations

import math

import pytest
import torch

from tether.diagnostics import decompose, divergence_metrics, mismatch_metrics, routing_disagreement
from tether.monitor import current_model_monitor
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.scoring import collate

LN2 = math.log(2.0)


def test_divergence_metrics_by_hand():
    # Valid deltas: ln2, 0 (row 0) and -ln2 (row 1); the NaN is padding and must not count.
    delta = torch.tensor([[LN2, 0.0], [-LN2, float("nan")]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = divergence_metrics(delta, mask, "numerical")
    # k1 = -(ln2 + 0 - ln2) / 3 = 0
    assert m["numerical/k1_kl/mean"] == pytest.approx(0.0, abs=1e-15)
    # k3 terms: (2 - 1 - ln2) + 0 + (1/2 - 1 + ln2) = 1/2, over 3 tokens
    assert m["numerical/k3_kl/mean"] == pytest.approx(1 / 6)
    assert m["numerical/abs_log_ratio/max"] == pytest.approx(LN2)
    # chi2 token: (4 + 1 + 1/4) / 3 - 1 = 0.75; sequence: (2^2 + (1/2)^2) / 2 - 1 = 1.125
    assert m["numerical/chi2/token"] == pytest.approx(0.75)
    assert m["numerical/chi2/seq"] == pytest.approx(1.125)
    # ppl ratio per row: exp(-ln2/2) = 1/sqrt2 and exp(ln2) = 2; mean 1.353553...
    assert m["numerical/ppl_ratio/mean"] == pytest.approx((2 ** -0.5 + 2.0) / 2)


def test_empty_mask_disagrees_nowhere():
    m = divergence_metrics(torch.ones(2, 3), torch.zeros(2, 3), "total")
    assert m == {"total/k1_kl/mean": 0.0, "total/k3_kl/mean": 0.0, "total/abs_log_ratio/max": 0.0,
                 "total/chi2/token": 0.0, "total/chi2/seq": 0.0, "total/ppl_ratio/mean": 1.0}


def test_decompose_directions_and_causes():
    logp_rollout = torch.tensor([[-1.0, -2.0]])
    logp_old = torch.tensor([[-1.5, -2.0]])
    logp = torch.tensor([[-1.0, -1.0]])
    d = decompose(logp_rollout, logp_old, logp, torch.ones(1, 2))
    assert d.log_rho.tolist() == [[-0.5, 0.0]]  # log pi_old - log mu
    assert d.log_r.tolist() == [[0.5, 1.0]]  # log pi_theta - log pi_old
    assert d.log_total.tolist() == [[0.0, 1.0]]
    only_numerical = mismatch_metrics(decompose(logp_rollout, logp_old, None, torch.ones(1, 2)))
    assert {k.split("/")[0] for k in only_numerical} == {"numerical"}
    assert {k.split("/")[0] for k in mismatch_metrics(d)} == {"numerical", "staleness", "total"}


def test_routing_disagreement_is_empty_for_dense(random_model, tokenizer):
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, "bf16")
    batch = collate(gen.generate([[2, 3, 4]], ["a"], SamplingParams(n=2, max_new_tokens=4), 0), 0)
    assert routing_disagreement(random_model, gen.model, batch) == {}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_monitor_sees_only_the_generators_numerics(random_model, tokenizer, precision):
    gen = HFGenerator(random_model, tokenizer.eos_token_id, tokenizer.pad_token_id, precision)
    prompts = [[2, 3, 4, 5], [6, 7], [8, 9, 10]]
    rng = torch.get_rng_state()
    m = current_model_monitor(random_model, gen.model, prompts, SamplingParams(n=4, max_new_tokens=8),
                              seed=0, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                              rare_prob=0.05)
    assert torch.equal(rng, torch.get_rng_state())  # the run's RNG stream is untouched
    assert set(m) == {"monitor/k1_kl/mean", "monitor/k3_kl/mean", "monitor/kl_share/rare",
                      "monitor/token_frac/rare"}
    assert 0.0 <= m["monitor/kl_share/rare"] <= 1.0 and 0.0 <= m["monitor/token_frac/rare"] <= 1.0
    if precision == "fp32":  # same weights, same numerics: the samples' own model agrees
        assert m["monitor/k3_kl/mean"] < 1e-10 and abs(m["monitor/k1_kl/mean"]) < 1e-5
    else:
        assert m["monitor/k3_kl/mean"] > 1e-7


def test_diagnostics_do_not_change_the_trajectory(warm_model_dir, tmp_path):
    # The monitor samples with its own torch.Generator and restores the model's mode, so
    # turning it on changes no trained number (resume bit for bit relies on this).
    from tether.config import load_config
    from tether.logger import read_jsonl
    from tether.loops import train

    runs = []
    for every in (0, 1):
        run_dir = tmp_path / f"monitor{every}"
        train(load_config("configs/countdown.yaml", [
            f"model.path={warm_model_dir}", f"run.dir={run_dir}", "train.steps=2",
            "train.lr=3e-3", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "task.eval_size=4", "eval.every=0", "run.progress=false", "sync.lag=1",
            f"diagnostics.monitor_every={every}", "diagnostics.monitor_prompts=2"]))
        runs.append(read_jsonl(run_dir / "metrics.jsonl"))
    off, on = runs
    assert all("monitor/k3_kl/mean" in r for r in on[1:])
    for a, b in zip(off, on, strict=True):
        for key in ("reward/mean", "loss/total", "train/grad_norm", "staleness/k3_kl/mean",
                    "eval/accuracy"):
            assert a.get(key) == b.get(key), key
