"""tether.advice: a cause is corrected only when it is material; otherwise "nothing to correct"."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.advice import (
    ESS_MARGIN,
    ESS_TAU,
    ROUNDING_K3,
    Evidence,
    advise_run,
    batch_of,
    evidence_from_rows,
    numerical_finding,
    recommend,
    staleness_finding,
)

N = 256  # 32 prompts x 8 samples, one optimizer step per batch


def ev(k3: float = 1e-13, chi2: float = 0.0, **kw) -> Evidence:
    return Evidence(numerical_k3=k3, numerical_chi2_seq=chi2, batch=N, **kw)


def test_numerical_levels():
    # fp32 engine: rounding, named as such, whatever the chi2 estimate's sampling noise says.
    assert numerical_finding(ev(1.2e-13, 3e-12)).level == "rounding"
    assert "float rounding" in numerical_finding(ev(1.2e-13)).line
    # bf16 on the tiny model: k3 2.7e-5 over ~7 tokens, chi2 3.7e-4 < 1/256: negligible.
    assert numerical_finding(ev(2.7e-5, 3.7e-4)).level == "negligible"
    # Just over one batch's noise (1/N = 3.9e-3): material.
    assert numerical_finding(ev(2.7e-4, 4.0e-3)).level == "material"
    # The same mismatch in a batch 8x smaller hides under its noise.
    small = Evidence(numerical_k3=2.7e-4, numerical_chi2_seq=4.0e-3, batch=N // 8)
    assert numerical_finding(small).level == "negligible"


def test_staleness_levels():
    bar = ESS_TAU + ESS_MARGIN
    assert staleness_finding(ev()).level == "absent"
    assert staleness_finding(ev(staleness_k3=0.0, ess=1.0)).level == "rounding"
    assert staleness_finding(ev(staleness_k3=1.2e-2, ess=0.977)).level == "negligible"
    assert staleness_finding(ev(staleness_k3=0.1, ess=bar + 1e-3)).level == "negligible"
    assert staleness_finding(ev(staleness_k3=0.2, ess=bar - 1e-3)).level == "material"
    assert staleness_finding(ev(staleness_k3=0.3, ess=0.3)).level == "material"


@pytest.mark.parametrize("current", [("grpo", "every:1"), ("dlc", "ess:0.5"), ("tis", "every:2")])
def test_negligible_causes_keep_the_current_estimator(current):
    # The 10-step async run: numerical k3 8e-14, staleness ESS never below 0.977.
    rec = recommend(ev(8e-14, staleness_k3=1.1e-2, ess=0.977), *current)
    assert rec.cause == "none" and not rec.change
    assert (rec.estimator, rec.sync_policy) == current
    assert rec.headline == f"nothing to correct: keep train.estimator={current[0]} sync.policy={current[1]}"


def test_moderate_causes():
    # Staleness between tau and tau + margin: the re-sync is advised before the drift.
    rec = recommend(ev(2e-5, 2e-4, staleness_k3=0.15, ess=0.62))
    assert (rec.cause, rec.estimator, rec.sync_policy, rec.change) == (
        "staleness", "dlc", "ess:0.5", True)
    assert rec.headline == "correct staleness: change to train.estimator=dlc sync.policy=ess:0.5"
    # Numerical just over 1/N, light tail, no routing: calibrated IS.
    rec = recommend(ev(3e-4, 5e-3, tail_share=0.0))
    assert (rec.cause, rec.estimator, rec.sync_policy) == ("numerical", "cis", "every:1")
    assert "cap that loosens" in rec.why


def test_strong_causes():
    heavy = recommend(ev(2e-3, 0.2, tail_share=0.01, heavy=True))
    assert (heavy.cause, heavy.estimator) == ("numerical", "icepop")  # mask, not truncate
    routed = recommend(ev(2.4e-3, 0.03, tail_share=9e-4, routing_any=0.29))
    assert routed.estimator == "icepop" and "routing replay" in routed.why.lower()
    both = recommend(ev(1e-3, 0.05, staleness_k3=0.3, ess=0.3), "dlc", "ess:0.5")
    assert (both.cause, both.estimator, both.sync_policy) == ("both", "dlc", "ess:0.5")
    assert not both.change and both.headline.startswith("correct both: keep (it corrects this)")


levels = st.floats(1e-15, 1.0)


@given(k3=levels, chi2=st.floats(0.0, 10.0), ess=st.none() | st.floats(0.01, 1.0),
       batch=st.integers(1, 4096))
def test_a_correction_only_for_a_material_cause(k3, chi2, ess, batch):
    e = Evidence(numerical_k3=k3, numerical_chi2_seq=chi2, batch=batch,
                 staleness_k3=None if ess is None else -math.log(ess) / 2, ess=ess)
    material = {f.cause for f in (numerical_finding(e), staleness_finding(e)) if f.level == "material"}
    rec = recommend(e)
    assert rec.cause == {0: "none", 2: "both"}.get(len(material), next(iter(material or {""})))
    assert rec.change == (rec.cause != "none")  # the default current is on-policy grpo
    # More mismatch never turns a material cause negligible.
    worse = Evidence(numerical_k3=max(k3, ROUNDING_K3) * 2, numerical_chi2_seq=chi2 * 2 + 1e-9,
                     batch=batch, staleness_k3=e.staleness_k3, ess=None if ess is None else ess / 2)
    for f, g in ((numerical_finding(e), numerical_finding(worse)),
                 (staleness_finding(e), staleness_finding(worse))):
        assert f.level != "material" or g.level == "material"


def test_evidence_from_a_runs_rows():
    rows = [{"numerical/k3_kl/mean": 8e-14, "numerical/ess/seq": 1 - 1e-12,
             "numerical/abs_log_ratio/max": 1e-6, "staleness/k3_kl/mean": k3,
             "staleness/ess/token": ess} for k3, ess in ((0.0, 1.0), (0.011, 0.977), (0.004, 0.99))]
    cfg = {"rollout": {"prompts_per_step": 32, "group_size": 8}, "train": {"minibatches": 2,
           "estimator": "grpo"}, "sync": {"policy": "bounded:2"}}
    e = evidence_from_rows(rows, batch_of(cfg))
    assert e.batch == 128 and e.ess == 0.977 and e.staleness_k3 == pytest.approx(0.005)
    text = advise_run(rows, cfg)
    assert "numerical  k3 8.0e-14/token: float rounding" in text
    assert "staleness  k3 5.0e-03/token, lowest token ESS 0.977 >= 0.7" in text
    assert "advice: nothing to correct: keep train.estimator=grpo sync.policy=bounded:2" in text
    assert evidence_from_rows([{"step": 0}], 128) is None
