"""`tether probe`: each generator/trainer disagreement gets the correction for its cause."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tether.config import load_config
from tether.probe import epsilon_bins, numerical_summary, probe

SMALL = ["rollout.prompts_per_step=8", "rollout.group_size=4", "rollout.max_new_tokens=12",
         "run.threads=1"]


def test_on_policy_fp32_has_nothing_to_correct(warm_model_dir, capsys):
    overrides = [f"model.path={warm_model_dir}", "train.estimator=tis", *SMALL]
    result = probe(load_config(None, overrides))
    assert result.numerical["k3"] < 1e-9 and result.staleness is None
    rec = result.recommendation
    assert (rec.cause, rec.estimator, rec.change) == ("none", "tis", False)  # keep the user's own
    text = result.format()
    assert "numerical  k3" in text and "float rounding" in text
    assert "advice: nothing to correct: keep train.estimator=tis sync.policy=every:1" in text


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_low_precision_generator_on_the_tiny_model_is_negligible(warm_model_dir, precision):
    # Measurable (k3 > 1e-5, far above rounding) but, over ~7-token responses, a sequence
    # chi2 well under 1/N: the bias cannot exceed one batch's noise.
    overrides = [f"model.path={warm_model_dir}", f"rollout.precision={precision}", *SMALL]
    result = probe(load_config(None, overrides))
    assert result.numerical["k3"] > 1e-5 and result.staleness is None
    assert 0 < result.evidence.numerical_chi2_seq < 1 / result.evidence.batch
    assert result.recommendation.cause == "none"
    assert "negligible" in result.format()
    # Every valid token falls in one confidence bin.
    assert sum(b.tokens for b in result.epsilon) == result.settings["tokens"] > 0
    if precision == "bf16":
        # `tether probe --json` prints the same numbers the library returns (seeded sampling).
        out = subprocess.run([sys.executable, "-m", "tether.cli", "probe", "--json", *overrides],
                             capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == json.loads(json.dumps(result.to_json()))
        assert json.loads(out.stdout)["findings"]["numerical"]["level"] == "negligible"


def test_injected_logit_noise_is_material_numerical(warm_model_dir):
    result = probe(load_config(None, [f"model.path={warm_model_dir}", "rollout.logit_noise=0.3",
                                      "rollout.logit_noise_dof=30", *SMALL]))
    assert result.evidence.numerical_chi2_seq > 1 / result.evidence.batch
    assert result.recommendation.cause == "numerical"
    assert result.recommendation.estimator in ("cis", "icepop")  # icepop if the tail is heavy


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
    # chi2 over whole responses, self-normalised: log rho sums to -0.7 and 1.0 per row.
    w = [math.exp(-0.7), math.exp(1.0)]
    assert s["chi2_seq"] == pytest.approx(2 * (w[0] ** 2 + w[1] ** 2) / sum(w) ** 2 - 1)
    assert s["tail_share"] == pytest.approx(2 / 4)  # |log rho| > log 2: -0.8 and 1.0
    assert s["outside_support"] == 0.0  # the -40 token is masked; -30 / 2 is the line
    mask[1, 2] = 1
    assert numerical_summary(logp_old, logp_mu, mask, floor=-30.0)["outside_support"] == 1 / 5


def test_moe_router_noise_is_numerical_through_routing(random_moe_dir):
    # A random MoE's near-uniform logits barely move when 77% of tokens change experts: its
    # chi2 (~6e-3) hides under the noise of 32 responses but not of 256.
    keys = [f"model.path={random_moe_dir}", "rollout.precision=bf16", "rollout.router_noise=0.1",
            *SMALL]
    assert probe(load_config(None, keys)).recommendation.cause == "none"
    result = probe(load_config(None, [*keys, "rollout.prompts_per_step=32", "rollout.group_size=8"]))
    assert result.routing is not None and result.routing["any_layer"] > 0.05
    assert result.evidence.numerical_chi2_seq > 1 / 256
    assert result.recommendation.cause == "numerical"
    assert result.recommendation.estimator == "icepop"
    assert "routing" in result.recommendation.why


def test_fp8_and_lag_8_at_lr_5e_4_needs_a_correction(warm_model_dir):
    # docs/probe.md's fp8 + lag 8 probe: the staleness ESS falls under tau + margin.
    result = probe(load_config(None, [f"model.path={warm_model_dir}", "rollout.precision=fp8",
                                      "sync.lag=8", "train.lr=5e-4", *SMALL]))
    assert result.numerical["k3"] > 1e-5  # fp8
    assert result.staleness is not None and result.staleness["steps"] == 8
    assert result.staleness["ess"] < 0.7
    rec = result.recommendation
    assert rec.cause in ("staleness", "both") and rec.sync_policy == "ess:0.5" and rec.change
    assert "advice: correct " in result.format()
    assert json.loads(json.dumps(result.to_json(), allow_nan=False))  # --json: plain JSON


def test_epsilon_is_logit_difference_per_confidence_bin():
    p_old, p_mu = torch.tensor([[0.3, 0.9]]), torch.tensor([[0.25, 0.92]])
    bins = epsilon_bins(p_old.log(), p_mu.log(), torch.ones(1, 2), edges=(0.0, 0.5, 1.0))
    logit = lambda p: math.log(p / (1 - p))
    assert [b.tokens for b in bins] == [1, 1]
    assert bins[0].q05 == pytest.approx(logit(0.3) - logit(0.25), rel=1e-5)
    assert bins[1].q95 == pytest.approx(logit(0.9) - logit(0.92), rel=1e-5)
