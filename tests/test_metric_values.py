"""Every logged estimator, diagnostic and monitor metric against a value worked out by hand.

The inputs are chosen so that a wrong reduction shows: rows of different lengths (token
sum != token mean, token mean != row mean), a masked token whose value would move every
statistic if the mask were ignored, an all-masked row, mean != max != second moment, and
advantages that are not constant. Expected values are plain arithmetic over literals.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tether.diagnostics import compare_routes, decompose, divergence_metrics, mismatch_metrics
from tether.estimators import TokenBatch, build_estimator, ess_seq, ess_token
from tether.estimators.base import CorrectionTerms, ObjectiveTerms
from tether.estimators.metrics import (
    applied_metrics,
    centering_metrics,
    ratio_metrics,
    sequence_weight_metrics,
    to_floats,
)
from tether.monitor import monitor_metrics

LN2 = math.log(2.0)


def _log(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).log()


def _t(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _assert_values(got: dict[str, float], expected: dict[str, float], rel: float = 1e-9) -> None:
    """Exactly the expected keys, each to `rel` relative."""
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=rel, abs=1e-12), key


# Rows of lengths 2 and 3 (T = 3); the masked token (0, 2) holds rho = r = 8, so any
# statistic that reads it moves (its max alone would be 8 and 64).
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
RHO = [[2.0, 1.0, 8.0], [1 / 4, 1.0, 2.0]]  # pi_old / mu
R = [[1.0, 2.0, 8.0], [4.0, 1 / 4, 1.0]]  # pi_theta / pi_old
# so pi_theta / mu = [[2, 2, (64)], [1, 1/4, 2]]; row products: rho 2 and 1/2, r 2 and 1,
# total 4 and 1/2.
ADV = [[1.0, -1.0, 5.0], [2.0, 0.0, -1.0]]  # A^2 on valid tokens: 1, 1, 4, 0, 1 (sum 7)

RATIO_EXPECTED = {
    "numerical/is_weight/mean": (2 + 1 + 1 / 4 + 1 + 2) / 5,  # 1.25
    "numerical/is_weight/max": 2.0,
    "numerical/is_weight/second_moment": (4 + 1 + 1 / 16 + 1 + 4) / 5,  # 2.0125
    # ESS = (sum w)^2 / (N sum w^2)
    "numerical/ess/token": (2 + 1 + 1 / 4 + 1 + 2) ** 2 / (5 * (4 + 1 + 1 / 16 + 1 + 4)),
    "numerical/ess/seq": (2 + 1 / 2) ** 2 / (2 * (4 + 1 / 4)),  # on row products 2, 1/2
    "staleness/ratio/mean": (1 + 2 + 4 + 1 / 4 + 1) / 5,  # 1.65
    "staleness/ratio/max": 4.0,
    "staleness/ratio/second_moment": (1 + 4 + 16 + 1 / 16 + 1) / 5,  # 4.4125
    "staleness/ess/token": (1 + 2 + 4 + 1 / 4 + 1) ** 2 / (5 * (1 + 4 + 16 + 1 / 16 + 1)),
    "staleness/ess/seq": (2 + 1) ** 2 / (2 * (4 + 1)),  # 0.9
    "total/is_weight/mean": (2 + 2 + 1 + 1 / 4 + 2) / 5,  # 1.45
    "total/is_weight/max": 2.0,
    "total/is_weight/second_moment": (4 + 4 + 1 + 1 / 16 + 4) / 5,  # 2.6125
    "total/ess/token": (2 + 2 + 1 + 1 / 4 + 2) ** 2 / (5 * (4 + 4 + 1 + 1 / 16 + 4)),
    "total/ess/seq": (4 + 1 / 2) ** 2 / (2 * (16 + 1 / 4)),
}


def test_ratio_metrics_by_hand() -> None:
    # A third, all-masked row of 8s counts nowhere: not in N, not as a sequence.
    log_rho = torch.cat([_log(RHO), _log([[8.0, 8.0, 8.0]])])
    log_r = torch.cat([_log(R), _log([[8.0, 8.0, 8.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    _assert_values(to_floats(ratio_metrics(log_rho, log_r, mask)), RATIO_EXPECTED)
    # the stand-alone ESS functions agree (the seq level multiplies within a row)
    assert ess_token(log_rho, mask).item() == pytest.approx(RATIO_EXPECTED["numerical/ess/token"])
    assert ess_seq(log_rho, mask).item() == pytest.approx(RATIO_EXPECTED["numerical/ess/seq"])
    assert ess_seq(log_r, mask).item() == pytest.approx(RATIO_EXPECTED["staleness/ess/seq"])


# A correction's weight (a TIS-like cap at 1.5 on RHO) and flags on valid tokens only, as
# corrections and objectives report them; the masked token's weight 9 and coef 7 must not count.
CORR = CorrectionTerms(
    weight=_t([[1.5, 1.0, 9.0], [1 / 4, 1.0, 1.5]]),
    truncated=torch.tensor([[True, False, False], [False, False, True]]),
    masked=torch.tensor([[False, False, False], [True, False, False]]),
)
OBJ = ObjectiveTerms(
    loss=torch.zeros(2, 3, dtype=torch.float64),
    coef=_t([[1.0, 2.0, 7.0], [0.0, 1 / 4, 1.0]]),
    clipped=torch.tensor([[False, False, False], [True, True, True]]),
)
NUMERICAL_ADV = (4 * 1 + 1 * 1 + 1 / 16 * 4 + 1 * 0 + 4 * 1) / 7  # rho^2 A^2 / A^2: 9.25 / 7
APPLIED_EXPECTED = {
    "numerical/is_weight/adv_second_moment": NUMERICAL_ADV,
    "correction/weight/mean": (1.5 + 1 + 1 / 4 + 1 + 1.5) / 5,  # 1.05
    "correction/weight/max": 1.5,
    "correction/weight/second_moment": (2.25 + 1 + 1 / 16 + 1 + 2.25) / 5,  # 1.3125
    "correction/weight/adv_second_moment": (2.25 * 1 + 1 * 1 + 1 / 16 * 4 + 1 * 0 + 2.25 * 1) / 7,
    "correction/frac_truncated": 2 / 5,
    "correction/frac_masked": 1 / 5,
    "objective/frac_clipped": 3 / 5,
    "objective/coef/mean": (1 + 2 + 0 + 1 / 4 + 1) / 5,  # 0.85
    "objective/coef/max": 2.0,
}


def test_applied_metrics_by_hand() -> None:
    got = to_floats(applied_metrics(_log(RHO), _t(ADV), MASK, CORR, OBJ))
    _assert_values(got, APPLIED_EXPECTED)


def test_applied_metrics_report_an_objectives_own_mismatch_weight() -> None:
    # decoupled weighs by pi_prox/mu itself: that weight, not the correction's, is reported.
    obj = ObjectiveTerms(
        loss=OBJ.loss, coef=OBJ.coef, clipped=OBJ.clipped,
        mismatch_weight=_t([[3.0, 0.5, 9.0], [1.0, 2.0, 1.0]]),
    )
    got = to_floats(applied_metrics(_log(RHO), _t(ADV), MASK, CORR, obj))
    _assert_values(got, APPLIED_EXPECTED | {
        "correction/weight/mean": (3 + 0.5 + 1 + 2 + 1) / 5,  # 1.5
        "correction/weight/max": 3.0,
        "correction/weight/second_moment": (9 + 0.25 + 1 + 4 + 1) / 5,  # 3.05
        "correction/weight/adv_second_moment": (9 * 1 + 0.25 * 1 + 1 * 4 + 4 * 0 + 1 * 1) / 7,
    })


def test_adv_second_moment_is_one_without_advantages() -> None:
    got = to_floats(applied_metrics(_log(RHO), torch.zeros(2, 3), MASK, CORR, OBJ))
    assert got["numerical/is_weight/adv_second_moment"] == 1.0
    assert got["correction/weight/adv_second_moment"] == 1.0


def test_centering_metrics_by_hand() -> None:
    rho_tail = _t([[0.5, 2.0, 100.0], [1.0, 0.25, 1.5]])
    head_mu = _t([[0.9, 0.6, 5.0], [0.8, 1.0, 0.7]])
    _assert_values(to_floats(centering_metrics(rho_tail, head_mu, MASK)), {
        "centering/rho_tail/mean": (0.5 + 2 + 1 + 0.25 + 1.5) / 5,  # 1.05
        "centering/head_mass/rollout": (0.9 + 0.6 + 0.8 + 1.0 + 0.7) / 5,  # 0.8
    })


def _batch(rho, r, advantages, mask, logp_old=None, **topk) -> TokenBatch:
    old = torch.full(mask.shape, -1.0, dtype=torch.float64) if logp_old is None else logp_old
    return TokenBatch(
        logp=(old + _log(r)).requires_grad_(True), logp_old=old, logp_rollout=old - _log(rho),
        advantages=torch.as_tensor(advantages, dtype=torch.float64), mask=mask, **topk,
    )


def test_tis_estimator_logs_every_metric_by_hand() -> None:
    # ppo + tis with cap 1.5 on RHO, R, ADV: w_mm = min(rho, 1.5) = [1.5, 1 | 1/4, 1, 1.5],
    # rho = 2 truncated twice. PPO (eps 0.2, 0.28), l = max(-A r, -A clip(r)), coef r or 0:
    #   (0,0) A=1,  r=1:   l = -1,                        coef 1
    #   (0,1) A=-1, r=2:   l = max(2, 1.28) = 2,          coef 2
    #   (1,0) A=2,  r=4:   l = max(-8, -2.56) = -2.56,    clipped, coef 0
    #   (1,1) A=0,  r=1/4: l = 0,                         coef 1/4
    #   (1,2) A=-1, r=1:   l = 1,                         coef 1
    # loss = (1.5 (-1) + 1 (2) + 1/4 (-2.56) + 0 + 1.5 (1)) / 5 = 1.36 / 5 = 0.272
    out = build_estimator("tis", cap=1.5)(_batch(RHO, R, ADV, MASK))
    _assert_values(out.metrics, RATIO_EXPECTED | APPLIED_EXPECTED | {
        "correction/frac_masked": 0.0,
        "objective/frac_clipped": 1 / 5,
        "loss/total": (-1.5 + 2 - 0.64 + 0 + 1.5) / 5,
        "loss/objective": (-1.5 + 2 - 0.64 + 0 + 1.5) / 5,
    })


def test_dlc_estimator_logs_centering_metrics_by_hand() -> None:
    # No mismatch on the sampled tokens (rho = r = 1), one head token per position (K = 1)
    # with pi_theta = pi_old there (w(v) = 1); rows of lengths 2 and 1, A = [1, -2].
    #   rho_tail = (1 - mu_H) / (1 - pi_old_H), center = A (mu_H w - rho_tail pi_H) log pi_H
    #   (0,0) mu .5, pi .75: rho_tail .5/.25 = 2,   center = 1 (.5 - 1.5) ln .75  = -ln .75
    #   (0,1) mu .8, pi .6:  rho_tail .2/.4 = .5,   center = 1 (.8 - .3) ln .6    = .5 ln .6
    #   (1,0) mu .6, pi .5:  rho_tail .4/.5 = .8,   center = -2 (.6 - .4) ln .5   = -.4 ln .5
    # stale_is on the sampled tokens, logp = ln [.5, .25 | .5]: -A logp sums to
    #   -ln .5 - ln .25 + 2 ln .5 = ln 2
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    ones = [[1.0, 1.0], [1.0, 1.0]]
    head_old = _log([[0.75, 0.6], [0.5, 0.3]]).unsqueeze(-1)
    batch = _batch(
        ones, ones, [1.0, -2.0], mask, logp_old=_log([[0.5, 0.25], [0.5, 0.9]]),
        topk_ids=torch.zeros(2, 2, 1, dtype=torch.long),
        topk_logp_rollout=_log([[0.5, 0.8], [0.6, 0.1]]).unsqueeze(-1),
        topk_logp=head_old.clone(), topk_logp_old=head_old,
    )
    out = build_estimator("dlc")(batch)
    centering = (-math.log(0.75) + 0.5 * math.log(0.6) - 0.4 * math.log(0.5)) / 3
    # every ratio and weight is 1 and A != 0, so every ESS and second moment is 1 too
    unit = {k: 1.0 for k in RATIO_EXPECTED | APPLIED_EXPECTED if "frac" not in k}
    _assert_values(out.metrics, unit | {
        "correction/frac_truncated": 0.0,
        "correction/frac_masked": 0.0,
        "objective/frac_clipped": 0.0,
        "loss/objective": LN2 / 3,
        "loss/centering": centering,
        "loss/total": LN2 / 3 + centering,
        "centering/rho_tail/mean": (2 + 0.5 + 0.8) / 3,  # the masked token's tail does not count
        "centering/head_mass/rollout": (0.5 + 0.8 + 0.6) / 3,
    })


def test_divergence_metrics_by_hand_on_rows_of_different_lengths() -> None:
    # Valid deltas: row 0 [ln2, 0], row 1 [-ln2, ln2, 2 ln2]; the masked 3.0, NaN and the
    # all-masked row 2 must not count (3.0 would be the largest |delta|).
    nan = float("nan")
    delta = _t([[LN2, 0.0, 3.0], [-LN2, LN2, 2 * LN2], [3.0, -3.0, nan]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    _assert_values(divergence_metrics(delta, mask, "staleness"), {
        "staleness/k1_kl/mean": -(LN2 + 0 - LN2 + LN2 + 2 * LN2) / 5,
        # e^d - 1 - d per token
        "staleness/k3_kl/mean": (
            (2 - 1 - LN2) + 0 + (1 / 2 - 1 + LN2) + (2 - 1 - LN2) + (4 - 1 - 2 * LN2)
        ) / 5,
        "staleness/abs_log_ratio/max": 2 * LN2,
        # e^{2d}: 4, 1, 1/4, 4, 16
        "staleness/chi2/token": (4 + 1 + 1 / 4 + 4 + 16) / 5 - 1,
        # row ratios e^{ln2} = 2 and e^{-ln2 + ln2 + 2 ln2} = 4, averaged over the 2 rows
        "staleness/chi2/seq": (2**2 + 4**2) / 2 - 1,
        # row means ln2 / 2 and 2 ln2 / 3
        "staleness/ppl_ratio/mean": (2**-0.5 + 2 ** (-2 / 3)) / 2,
    })


def test_mismatch_metrics_by_hand() -> None:
    # Log-ratios of RHO and R through decompose; a NaN logp on the masked token.
    rollout = _t([[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]])
    old = rollout + _log(RHO)
    logp = torch.where(MASK, old + _log(R), float("nan"))
    # per-cause valid deltas, in units of ln2, and row ratios:
    #   numerical [1, 0 | -2, 0, 1]    rows 2, 1/2   row means ln2/2, -ln2/3
    #   staleness [0, 1 | 2, -2, 0]    rows 2, 1     row means ln2/2, 0
    #   total     [1, 1 | 0, -2, 1]    rows 4, 1/2   row means ln2,   -ln2/3
    # k3 = sum(w - 1 - delta) / 5; chi2/token = E[w^2] - 1, the weight second moment - 1
    expected = {
        "numerical/k1_kl/mean": 0.0,
        "numerical/k3_kl/mean": ((2 - 1 - LN2) + 0 + (1 / 4 - 1 + 2 * LN2) + 0 + (2 - 1 - LN2)) / 5,
        "numerical/abs_log_ratio/max": 2 * LN2,
        "numerical/chi2/token": (4 + 1 + 1 / 16 + 1 + 4) / 5 - 1,
        "numerical/chi2/seq": (2**2 + (1 / 2) ** 2) / 2 - 1,
        "numerical/ppl_ratio/mean": (2**-0.5 + 2 ** (1 / 3)) / 2,
        "staleness/k1_kl/mean": -LN2 / 5,
        "staleness/k3_kl/mean": ((2 - 1 - LN2) + (4 - 1 - 2 * LN2) + (1 / 4 - 1 + 2 * LN2)) / 5,
        "staleness/abs_log_ratio/max": 2 * LN2,
        "staleness/chi2/token": (1 + 4 + 16 + 1 / 16 + 1) / 5 - 1,
        "staleness/chi2/seq": (2**2 + 1**2) / 2 - 1,
        "staleness/ppl_ratio/mean": (2**-0.5 + 1) / 2,
        "total/k1_kl/mean": -LN2 / 5,
        "total/k3_kl/mean": ((2 - 1 - LN2) * 3 + 0 + (1 / 4 - 1 + 2 * LN2)) / 5,
        "total/abs_log_ratio/max": 2 * LN2,
        "total/chi2/token": (4 + 4 + 1 + 1 / 16 + 4) / 5 - 1,
        "total/chi2/seq": (4**2 + (1 / 2) ** 2) / 2 - 1,
        "total/ppl_ratio/mean": (2**-1 + 2 ** (1 / 3)) / 2,
    }
    _assert_values(mismatch_metrics(decompose(rollout, old, logp, MASK)), expected | RATIO_EXPECTED)
    # without logp only the numerical cause is known
    numerical_only = {k: v for k, v in (expected | RATIO_EXPECTED).items() if k.startswith("num")}
    _assert_values(mismatch_metrics(decompose(rollout, old, None, MASK)), numerical_only)


def test_compare_routes_by_hand() -> None:
    # B = 2, prompt P = 2, response T = 3, 2 layers, top-2. Response token t is predicted at
    # position P - 1 + t = 1 + t. Row 0 has 2 valid tokens, row 1 has 3: 5 tokens, 10 pairs.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = SimpleNamespace(prompt_len=2, response_ids=torch.zeros(2, 3), response_mask=mask)
    trainer = torch.tensor([0, 1]).repeat(2, 5, 2, 1)  # (B, P+T, layers, k)
    generator = trainer.clone()
    generator[0, 1, 0] = torch.tensor([1, 0])  # row 0 token 0: same set, other order: agrees
    generator[0, 2, :] = torch.tensor([0, 2])  # row 0 token 1: both layers differ
    generator[0, 3, 0] = torch.tensor([2, 3])  # row 0 token 2: masked
    generator[1, 1, 1] = torch.tensor([0, 3])  # row 1 token 0: layer 1 differs
    generator[1, 0] = torch.tensor([2, 3])  # position 0 predicts a prompt token
    generator[1, 4] = torch.tensor([2, 3])  # the last position predicts past the response
    # rel 1e-7: the shares are integer counts divided in float32 (torch's int / int)
    _assert_values(compare_routes(trainer, generator, batch), {
        "numerical/routing_disagreement/mean": (2 + 1) / (5 * 2),
        "numerical/routing_disagreement/any_layer": 2 / 5,  # row 0 token 1, row 1 token 0
    }, rel=1e-7)


def test_monitor_metrics_by_hand() -> None:
    # delta = log mu - log pi_theta on y ~ pi_theta; rare: mu < 0.05.
    #   (0,0) mu .5,   pi .25: delta  ln2,   k3 = 2 - 1 - ln2
    #   (0,1) mu .01,  pi .08: delta -3 ln2, k3 = 1/8 - 1 + 3 ln2     rare
    #   (0,2) mu .001, pi .5:  masked (rare, large k3: must not count)
    #   (1,0) mu .02,  pi .01: delta  ln2,   k3 = 2 - 1 - ln2         rare
    #   (1,1) mu .9,   pi .9:  delta  0,     k3 = 0
    #   (1,2) mu .2,   pi .4:  delta -ln2,   k3 = 1/2 - 1 + ln2
    # Rare is read off mu: by pi_theta, only (1,0) would be rare.
    logp_gen = _log([[0.5, 0.01, 0.001], [0.02, 0.9, 0.2]])
    logp_sampler = _log([[0.25, 0.08, 0.5], [0.01, 0.9, 0.4]])
    k3 = [2 - 1 - LN2, 1 / 8 - 1 + 3 * LN2, 2 - 1 - LN2, 0.0, 1 / 2 - 1 + LN2]
    _assert_values(monitor_metrics(logp_gen, logp_sampler, MASK, rare_prob=0.05), {
        "monitor/k1_kl/mean": -(LN2 - 3 * LN2 + LN2 + 0 - LN2) / 5,
        "monitor/k3_kl/mean": sum(k3) / 5,
        "monitor/kl_share/rare": (k3[1] + k3[2]) / sum(k3),
        "monitor/token_frac/rare": 2 / 5,
    }, rel=1e-7)  # token_frac is an integer count divided in float32 (torch's int / int)
    # mu = pi_theta: no divergence, and a share of nothing is 0
    _assert_values(monitor_metrics(logp_gen, logp_gen, MASK, rare_prob=0.05), {
        "monitor/k1_kl/mean": 0.0, "monitor/k3_kl/mean": 0.0,
        "monitor/kl_share/rare": 0.0, "monitor/token_frac/rare": 2 / 5,
    }, rel=1e-7)


def test_sequence_weight_metrics_by_hand() -> None:
    # Four responses (one all-masked, left out); a masked token whose log-ratio of 5 would
    # move every sum. Staleness log W per row: 0.1 + 0.2 = 0.3, -0.4, 1.0; rho adds -0.1,
    # 0, +0.5. The coefficient's per-row mean: (1 + 3) / 2 = 2, 1, 5.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    log_r = _t([[0.1, 0.2, 5.0], [-0.4, 5.0, 5.0], [0.5, 0.25, 0.25], [5.0, 5.0, 5.0]])
    log_rho = _t([[-0.1, 0.0, 5.0], [0.0, 5.0, 5.0], [0.5, 0.0, 0.0], [5.0, 5.0, 5.0]])
    coef = _t([[1.0, 3.0, 99.0], [1.0, 99.0, 99.0], [5.0, 5.0, 5.0], [99.0, 99.0, 99.0]])
    got = to_floats(sequence_weight_metrics(log_r, log_rho, coef, mask))

    def q(values: list[float], p: float) -> float:  # linear interpolation, as torch.quantile
        values = sorted(values)
        pos = p * (len(values) - 1)
        lo = int(pos)
        return values[lo] + (pos - lo) * (values[min(lo + 1, len(values) - 1)] - values[lo])

    expected = {"objective/coef_seq/max": 5.0, "objective/coef_seq/top_share": 5.0 / 8.0}
    for name, values in (("staleness/seq_log_ratio", [0.3, -0.4, 1.0]),
                         ("total/seq_log_ratio", [0.2, -0.4, 1.5]),
                         ("objective/coef_seq", [2.0, 1.0, 5.0])):
        for stat, p in (("q05", 0.05), ("q50", 0.5), ("q95", 0.95)):
            expected[f"{name}/{stat}"] = q(values, p)
    _assert_values(got, expected)
    assert sequence_weight_metrics(log_r, log_rho, coef, torch.zeros_like(mask)) == {}


def test_estimator_coefficients_are_the_objectives_own_weight() -> None:
    # vespo: phi(W) = W^k exp(lam (1 - W)) per row, (k, lam) by the advantage's sign.
    logp_old = _log([[0.5, 0.5], [0.5, 0.5]])
    logp = logp_old + _t([[math.log(2.0), 0.0], [0.0, 0.0]])  # W = 2 for row 0, 1 for row 1
    batch = TokenBatch(logp=logp, logp_old=logp_old, logp_rollout=logp_old,
                       advantages=torch.tensor([1.0, -1.0], dtype=torch.float64),
                       mask=torch.ones(2, 2, dtype=torch.bool))
    phi = build_estimator("vespo").coefficients(batch)
    assert phi[0].tolist() == pytest.approx([4.0 * math.exp(-3.0)] * 2)  # k 2, lam 3, W 2
    assert phi[1].tolist() == pytest.approx([1.0, 1.0])  # W = 1: phi(1) = 1
    # grpo (PPO's clip): the ratio where the clip passes the gradient, 0 where it cuts it
    # (row 0's first token: r = 2 above 1 + eps with A > 0).
    assert build_estimator("grpo").coefficients(batch).tolist() == [[0.0, 1.0], [1.0, 1.0]]
