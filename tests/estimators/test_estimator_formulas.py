"""Each estimator against its published formula, on cases worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tether.estimators import PRESETS, TokenBatch, build_estimator
from tether.estimators.cis import cis_cap


def _batch(log_r, advantages, log_rho=None, mask=None, logp_old=None, **extra) -> TokenBatch:
    """A batch with given log r = logp - logp_old and log rho = logp_old - logp_rollout."""
    log_r = torch.tensor(log_r, dtype=torch.float64)
    old = torch.full_like(log_r, -1.0) if logp_old is None else torch.tensor(logp_old).double()
    rho = torch.zeros_like(log_r) if log_rho is None else torch.tensor(log_rho).double()
    logp = (old + log_r).requires_grad_(True)
    return TokenBatch(
        logp=logp,
        logp_old=old,
        logp_rollout=old - rho,
        advantages=torch.tensor(advantages, dtype=torch.float64),
        mask=torch.ones_like(log_r) if mask is None else torch.tensor(mask),
        **extra,
    )


def _grad(loss: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, batch.logp)
    return grad


def test_grpo_clipped_surrogate_by_hand() -> None:
    # r = [0.5, 1.1, 1.5, 0.5], A = [1, 1, 1, -1], eps = (0.2, 0.28):
    #   t0: min(0.5, clip 0.8) = 0.5       -> l = -0.5,  grad coef r = 0.5
    #   t1: min(1.1, 1.1)       = 1.1       -> l = -1.1,  coef 1.1
    #   t2: min(1.5, clip 1.28) = 1.28      -> l = -1.28, clipped, coef 0
    #   t3: min(-0.5, -0.8)     = -0.8      -> l = 0.8,   clipped, coef 0
    # token mean: (-0.5 - 1.1 - 1.28 + 0.8) / 4 = -0.52
    batch = _batch([[math.log(0.5), math.log(1.1), math.log(1.5), math.log(0.5)]], [[1, 1, 1, -1]])
    out = build_estimator("grpo")(batch)
    assert out.loss.item() == pytest.approx(-0.52)
    torch.testing.assert_close(out.weights, torch.tensor([[0.5, 1.1, 0.0, 0.0]]).double())
    # d loss / d logp_t = -coef_t A_t / 4
    torch.testing.assert_close(
        _grad(out.loss, batch), torch.tensor([[-0.125, -0.275, 0, 0]]).double()
    )
    assert out.metrics["objective/frac_clipped"] == pytest.approx(0.5)


def test_gspo_sequence_ratio_and_clip_by_hand() -> None:
    # Row 0: log r = [2e-4, 4e-4] -> s = e^(3e-4) = 1.00030005 < 1 + 4e-4: kept, l = -s.
    # Row 1: log r = 1e-3 (x3)     -> s = e^(1e-3) = 1.0010005 > 1.0004, A = +1: l = -1.0004.
    # Row 2: log r = -1e-3 (x2)    -> s = 0.9990005 < 1 - 3e-4, A = -1: l = +0.9997.
    # token mean over 7 tokens: (2 (-1.00030005) + 3 (-1.0004) + 2 (0.9997)) / 7
    pad = 0.0
    batch = _batch(
        [[2e-4, 4e-4, pad], [1e-3, 1e-3, 1e-3], [-1e-3, -1e-3, pad]],
        [1.0, 1.0, -1.0],
        mask=[[1, 1, 0], [1, 1, 1], [1, 1, 0]],
    )
    out = build_estimator("gspo")(batch)
    s0 = math.exp(3e-4)
    assert out.loss.item() == pytest.approx((2 * -s0 + 3 * -1.0004 + 2 * 0.9997) / 7, rel=1e-9)
    # token form: each kept token's gradient is -s_i A / N, the clipped rows give 0
    expected = torch.tensor([[-s0 / 7, -s0 / 7, 0], [0, 0, 0], [0, 0, 0]]).double()
    torch.testing.assert_close(_grad(out.loss, batch), expected)


def test_gspo_sequence_mean_aggregation_gives_the_gradient_of_s() -> None:
    # GSPO's own objective: grad of -A s_i, s_i = exp(mean_t log r_t), for one kept row.
    batch = _batch([[1e-4, -2e-4, 3e-4]], [2.0])
    out = build_estimator("gspo", agg="seq-mean-token-mean")(batch)
    s = (batch.logp - batch.logp_old).mean().exp()
    torch.testing.assert_close(_grad(out.loss, batch), _grad(-2.0 * s, batch))


def test_sapo_soft_gate_by_hand() -> None:
    # l = -(4/tau) sigmoid(tau (r - 1)) A, tau = 1 for A > 0, 1.05 for A < 0
    #   t0: r = 1, A = 1:        -(4/1) * 0.5              = -2
    #   t1: r = 1, A = -1:       (4/1.05) * 0.5            = 1.9047619
    #   t2: r = e^0.5, A = 1:    -4 sigmoid(0.6487213)     = -4 * 0.6567... = -2.62690
    g2 = 1 / (1 + math.exp(-(math.exp(0.5) - 1)))
    batch = _batch([[0.0, 0.0, 0.5]], [[1.0, -1.0, 1.0]])
    out = build_estimator("sapo")(batch)
    assert out.loss.item() == pytest.approx((-2 + 4 / 1.05 * 0.5 - 4 * g2) / 3, rel=1e-9)
    # weight on the score: 4 g (1 - g) r, which is exactly 1 at r = 1
    coef = torch.tensor([[1.0, 1.0, 4 * g2 * (1 - g2) * math.exp(0.5)]]).double()
    torch.testing.assert_close(out.weights, coef)


def test_vespo_phi_is_one_on_policy() -> None:
    out = build_estimator("vespo")(_batch([[0.0, 0.0], [0.0, 0.0]], [1.0, -1.0]))
    torch.testing.assert_close(out.weights, torch.ones(2, 2).double())


def test_vespo_weight_is_a_detached_product_over_tokens() -> None:
    # log r = [0.1, 0.2], log rho = [0.05, -0.05]: log W = 0.3 (a sum, not a mean).
    # A = 1 -> (k, lam) = (2, 3): phi = e^0.6 * e^(3 (1 - e^0.3)) = 1.8221 * 0.35009 = 0.63792
    # A = -1 -> (k, lam) = (3, 2): phi = e^0.9 * e^(2 (1 - e^0.3))
    batch = _batch([[0.1, 0.2], [0.1, 0.2]], [1.0, -1.0], log_rho=[[0.05, -0.05]] * 2)
    out = build_estimator("vespo")(batch)
    w = math.exp(0.3)
    phi_pos = math.exp(2 * 0.3 + 3 * (1 - w))
    phi_neg = math.exp(3 * 0.3 + 2 * (1 - w))
    expected = torch.tensor([[phi_pos] * 2, [phi_neg] * 2]).double()
    torch.testing.assert_close(out.weights, expected)
    # detached: d loss / d logp = -phi A / N, no d phi / d logp term
    grad = torch.tensor([[-phi_pos / 4] * 2, [phi_neg / 4] * 2]).double()
    torch.testing.assert_close(_grad(out.loss, batch), grad)


@pytest.mark.parametrize(("length_norm", "divisor"), [("none", 1.0), ("T", 2.0), ("sqrtT", 2**0.5)])
def test_vespo_length_norm_divides_log_w(length_norm: str, divisor: float) -> None:
    batch = _batch([[0.1, 0.2]], [1.0], log_rho=[[0.05, -0.05]])
    out = build_estimator("vespo", length_norm=length_norm)(batch)
    log_w = 0.3 / divisor
    assert out.weights[0, 0].item() == pytest.approx(
        math.exp(2 * log_w + 3 * (1 - math.exp(log_w)))
    )


def test_cis_with_lam_zero_is_tis_with_cap_one() -> None:
    gen = torch.Generator().manual_seed(0)
    log_r = (0.3 * torch.randn(3, 5, generator=gen)).tolist()
    log_rho = (0.8 * torch.randn(3, 5, generator=gen)).tolist()
    advantages = torch.randn(3, 5, generator=gen).tolist()
    cis = build_estimator("cis", lam=0.0)(_batch(log_r, advantages, log_rho=log_rho))
    tis = build_estimator("tis", cap=1.0)(_batch(log_r, advantages, log_rho=log_rho))
    assert cis.loss.item() == pytest.approx(tis.loss.item(), rel=1e-12)
    torch.testing.assert_close(cis.weights, tis.weights)


def test_cis_cap_tightens_as_the_token_becomes_confident() -> None:
    # cap = 1 + 2.3 max(1 - p, 5e-3):
    #   p = 0.5 -> 2.15,  p = 0.9 -> 1.23,  p = 0.999 -> 1 + 2.3 * 5e-3 = 1.0115 (floor)
    p = torch.tensor([0.5, 0.9, 0.99, 0.999, 0.99999], dtype=torch.float64)
    caps = cis_cap(p.log())
    torch.testing.assert_close(caps[:2], torch.tensor([2.15, 1.23]).double())
    assert caps[3].item() == pytest.approx(1.0115)
    assert caps[4].item() == pytest.approx(1.0115)
    assert (caps[:-1] >= caps[1:]).all() and caps[0] > caps[3]
    # applied with rho = 3, above every cap: the weight is the cap
    batch = _batch(
        [[0.0] * 5], [[1.0] * 5], log_rho=[[math.log(3.0)] * 5], logp_old=[p.log().tolist()]
    )
    out = build_estimator("cis")(batch)
    torch.testing.assert_close(out.weights[0], caps)


def test_cis_non_finite_ratio_gets_weight_one() -> None:
    batch = _batch([[0.0, 0.0]], [[1.0, 1.0]], log_rho=[[math.inf, 0.5]])
    out = build_estimator("cis")(batch)
    assert out.weights[0, 0].item() == 1.0
    assert out.weights[0, 1].item() == pytest.approx(math.exp(0.5))  # 1.6487 < cap 1+2.3(1-e^-1)


def test_tis_truncates_and_metrics_see_raw_ratios() -> None:
    # rho = [0.5, 3] -> w = [0.5, 2]; raw max 3, ESS = 3.5^2 / (2 (0.25 + 9)) = 0.662162
    batch = _batch([[0.0, 0.0]], [[1.0, 1.0]], log_rho=[[math.log(0.5), math.log(3.0)]])
    out = build_estimator("tis")(batch)
    torch.testing.assert_close(out.weights, torch.tensor([[0.5, 2.0]]).double())
    assert out.metrics["numerical/is_weight/max"] == pytest.approx(3.0)
    assert out.metrics["numerical/is_weight/second_moment"] == pytest.approx(4.625)
    assert out.metrics["numerical/ess/token"] == pytest.approx(12.25 / 18.5)
    assert out.metrics["correction/weight/max"] == pytest.approx(2.0)
    assert out.metrics["correction/frac_truncated"] == pytest.approx(0.5)


def test_seq_tis_caps_the_product() -> None:
    # row 0: prod rho = e^(0.2 + 0.3) = 1.6487 < 2 kept; row 1: e^(0.5 + 0.5) = 2.718 -> 2
    batch = _batch([[0.0, 0.0]] * 2, [1.0, 1.0], log_rho=[[0.2, 0.3], [0.5, 0.5]])
    out = build_estimator("seq_tis")(batch)
    torch.testing.assert_close(out.weights, torch.tensor([[math.exp(0.5)] * 2, [2.0] * 2]).double())


def test_mis_masks_outside_the_band() -> None:
    # rho = [0.4, 1.5, 2.5], band [0.5, 2] -> w = [0, 1.5, 0]
    for name in ("mis", "icepop"):
        batch = _batch([[0.0] * 3], [[1.0] * 3], log_rho=[[math.log(v) for v in (0.4, 1.5, 2.5)]])
        out = build_estimator(name)(batch)
        torch.testing.assert_close(out.weights, torch.tensor([[0.0, 1.5, 0.0]]).double())
        assert out.metrics["correction/frac_masked"] == pytest.approx(2 / 3)


def test_seq_mis_and_geo_mis_test_whole_responses() -> None:
    # seq_mis: row 0 prod = e^0.6 = 1.822 in [0.5, 2] -> weight 1.822; row 1 e^0.8 = 2.23 -> 0
    # geo_mis: row 0 mean log rho 0.005 -> 1.005 in [0.99, 1.01] -> 1; row 1 0.015 -> 0
    seq = build_estimator("seq_mis")(
        _batch([[0.0] * 2] * 2, [1.0, 1.0], log_rho=[[0.3, 0.3], [0.4, 0.4]])
    )
    torch.testing.assert_close(seq.weights, torch.tensor([[math.exp(0.6)] * 2, [0.0] * 2]).double())
    geo = build_estimator("geo_mis")(
        _batch([[0.0] * 2] * 2, [1.0, 1.0], log_rho=[[0.02, -0.01], [0.03, 0.0]])
    )
    torch.testing.assert_close(geo.weights, torch.tensor([[1.0, 1.0], [0.0, 0.0]]).double())


def test_decoupled_caps_the_behaviour_weight() -> None:
    # pi_prox / mu = 6 -> min(6, 5) = 5; r' = pi / pi_prox = 1: l = -5 A; pi_prox defaults
    # to pi_old, so the behaviour weight is rho here.
    batch = _batch([[0.0, 0.0]], [[1.0, -2.0]], log_rho=[[math.log(6.0), math.log(2.0)]])
    out = build_estimator("decoupled")(batch)
    assert out.loss.item() == pytest.approx((-5.0 + 2.0 * 2.0) / 2)
    torch.testing.assert_close(out.weights, torch.tensor([[5.0, 2.0]]).double())


def test_decoupled_uses_logp_prox_when_given() -> None:
    # prox one version ahead of old: r' = pi / pi_prox = e^0.1 / e^0.1 = 1, w = pi_prox / mu = e^0.3
    base = _batch([[0.1]], [[1.0]], log_rho=[[0.2]])
    batch = TokenBatch(
        logp=base.logp, logp_old=base.logp_old, logp_rollout=base.logp_rollout,
        advantages=base.advantages, mask=base.mask, logp_prox=base.logp_old + 0.1,
    )  # fmt: skip
    out = build_estimator("decoupled")(batch)
    assert out.weights.item() == pytest.approx(math.exp(0.3))


@pytest.mark.parametrize("preset", [p for p in PRESETS if not PRESETS[p].centering])
def test_weights_are_the_coefficient_on_the_score(preset: str) -> None:
    # LossOutput.weights is c with d loss_t / d logp_t = -c A (token-mean: divided by N).
    gen = torch.Generator().manual_seed(1)
    log_r = (0.1 * torch.randn(3, 4, generator=gen)).tolist()
    log_rho = (0.3 * torch.randn(3, 4, generator=gen)).tolist()
    advantages = torch.randn(3, 4, generator=gen)
    advantages[:, :] = advantages[:, :1]  # outcome advantages, constant per response
    batch = _batch(log_r, advantages.tolist(), log_rho=log_rho)
    out = build_estimator(preset)(batch)
    torch.testing.assert_close(_grad(out.loss, batch), -out.weights * batch.advantages / 12)


def test_aggregations_by_hand() -> None:
    # pg with A = 1, logp = [[-1, -2, pad], [-3, pad, pad]] -> l = -logp = [[1, 2], [3]]
    #   token-mean: (1 + 2 + 3) / 3 = 2;  seq-mean-token-mean: (1.5 + 3) / 2 = 2.25
    #   seq-mean-token-sum: (3 + 3) / 2 = 3
    logp_old = [[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]]
    mask = [[1, 1, 0], [1, 0, 0]]
    for agg, value in (
        ("token-mean", 2.0),
        ("seq-mean-token-mean", 2.25),
        ("seq-mean-token-sum", 3.0),
    ):
        out = build_estimator("naive", agg=agg)(
            _batch([[0.0] * 3] * 2, [1.0, 1.0], mask=mask, logp_old=logp_old)
        )
        assert out.loss.item() == pytest.approx(value)
