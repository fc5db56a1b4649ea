"""`tether probe`: each generator/trainer disagreement gets the correction for its cause."""

from __future__ import annotations

import json

import pytest

from tether.config import load_config
from tether.probe import ESS_TAU, epsilon_bins, probe, recommend, recommend_from_rows

SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=12",
         "run.threads=1"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_generator_is_numerical(warm_model_dir, precision):
    result = probe(load_config(None, [f"model.path={warm_model_dir}",
                                      f"rollout.precision={precision}", *SMALL]))
    assert result.numerical["k3"] > 1e-5 and result.staleness is None
    assert result.recommendation.cause == "numerical"
    assert result.recommendation.estimator == "cis"
    assert sum(b.tokens for b in result.epsilon) > 0


def test_moe_router_noise_is_numerical_through_routing(random_moe_dir):
    result = probe(load_config(None, [f"model.path={random_moe_dir}", "rollout.precision=bf16",
                                      "rollout.router_noise=0.1", *SMALL]))
    assert result.routing is not None and result.routing["any_layer"] > 0.05
    assert result.recommendation.cause == "numerical"
    assert result.recommendation.estimator == "icepop"
    assert "routing" in result.recommendation.why


def test_lag_8_at_lr_5e_4_is_staleness(warm_model_dir):
    result = probe(load_config(None, [f"model.path={warm_model_dir}", "sync.lag=8",
                                      "train.lr=5e-4", *SMALL]))
    assert result.numerical["k3"] < 1e-8  # fp32 generator: the same numerics
    assert result.staleness is not None and result.staleness["steps"] == 8
    assert result.staleness["k3"] > 1e-3
    assert result.recommendation.cause == "staleness"
    assert result.recommendation.sync_policy == "ess:0.5"
    assert json.loads(json.dumps(result.to_json(), allow_nan=False))  # --json: plain JSON


def test_recommendation_rules():
    assert recommend(1e-13, 0.0).cause == "none"
    assert recommend(1e-4, 0.0).estimator == "cis"
    assert recommend(1e-4, 0.01).estimator == "icepop"  # heavy tail: mask, not truncate
    both = recommend(1e-4, 0.0, staleness_k3=0.05, ess=0.3)
    assert (both.cause, both.estimator, both.sync_policy) == ("both", "dlc", "ess:0.5")
    assert recommend(1e-13, 0.0, staleness_k3=1e-5, ess=ESS_TAU / 2).cause == "staleness"
    rows = [{"numerical/k3_kl/mean": 2e-5, "staleness/k3_kl/mean": 0.06,
             "staleness/ess/token": 0.4, "numerical/abs_log_ratio/max": 0.1}] * 3
    assert recommend_from_rows(rows).cause == "both"
    assert recommend_from_rows([{"step": 0}]) is None


def test_epsilon_is_logit_difference_per_confidence_bin():
    import math

    import torch

    p_old, p_mu = torch.tensor([[0.3, 0.9]]), torch.tensor([[0.25, 0.92]])
    bins = epsilon_bins(p_old.log(), p_mu.log(), torch.ones(1, 2), edges=(0.0, 0.5, 1.0))
    logit = lambda p: math.log(p / (1 - p))
    assert [b.tokens for b in bins] == [1, 1]
    assert bins[0].q05 == pytest.approx(logit(0.3) - logit(0.25), rel=1e-5)
    assert bins[1].q95 == pytest.approx(logit(0.9) - logit(0.92), rel=1e-5)
