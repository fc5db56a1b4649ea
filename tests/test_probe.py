"""`tether probe`: each generator/trainer disagreement gets the correction for its cause."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tether.config import load_config
from tether.probe import (
    ESS_TAU,
    epsilon_bins,
    numerical_summary,
    probe,
    recommend,
    recommend_from_rows,
)

SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=12",
         "run.threads=1"]


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_generator_is_numerical(warm_model_dir, precision):
    overrides = [f"model.path={warm_model_dir}", f"rollout.precision={precision}", *SMALL]
    result = probe(load_config(None, overrides))
    assert result.numerical["k3"] > 1e-5 and result.staleness is None
    assert result.recommendation.cause == "numerical"
    assert result.recommendation.estimator == "cis"
    # Every valid token falls in one confidence bin.
    assert sum(b.tokens for b in result.epsilon) == result.settings["tokens"] > 0
    if precision == "bf16":
        # `tether probe --json` prints the same numbers the library returns (seeded sampling).
        out = subprocess.run([sys.executable, "-m", "tether.cli", "probe", "--json", *overrides],
                             capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == json.loads(json.dumps(result.to_json()))


def test_numerical_summary_by_hand():
    # Two rows, the second token of row 1 masked. log rho = log pi_old - log mu per valid token:
    # 0.1, -0.8, 0.0 (row 0), 1.0 (row 1); the masked one (log rho = 5) must not count.
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -40.0]])
    logp_mu = torch.tensor([[-1.1, -1.2, -0.5], [-1.2, -8.0, -40.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    d = [0.1, -0.8, 0.0, 1.0]
    s = numerical_summary(logp_old, logp_mu, mask, floor=-30.0)
    assert s["k1"] == pytest.approx(-sum(d) / 4)
    assert s["k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    assert s["max_abs_log_rho"] == pytest.approx(1.0)
    assert s["tail_share"] == pytest.approx(2 / 4)  # |log rho| > log 2: -0.8 and 1.0
    assert s["outside_support"] == 0.0  # the -40 token is masked; -30 / 2 is the line
    mask[1, 2] = 1
    assert numerical_summary(logp_old, logp_mu, mask, floor=-30.0)["outside_support"] == 1 / 5


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
    p_old, p_mu = torch.tensor([[0.3, 0.9]]), torch.tensor([[0.25, 0.92]])
    bins = epsilon_bins(p_old.log(), p_mu.log(), torch.ones(1, 2), edges=(0.0, 0.5, 1.0))
    logit = lambda p: math.log(p / (1 - p))
    assert [b.tokens for b in bins] == [1, 1]
    assert bins[0].q05 == pytest.approx(logit(0.3) - logit(0.25), rel=1e-5)
    assert bins[1].q95 == pytest.approx(logit(0.9) - logit(0.92), rel=1e-5)
