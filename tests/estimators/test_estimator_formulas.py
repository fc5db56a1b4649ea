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


def _close(actual: torch.Tensor, expected) -> None:
    """Equal to a hand-derived float64 reference to 1e-9."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.detach(), expected, rtol=0.0, atol=1e-9)


# Three responses of lengths 2, 3 and 2 (T = 3): the aggregations disagree here.
_GSPO_LOG_R = [[2e-4, 4e-4, 0.0], [1e-4, -2e-4, 4e-4], [-1e-3, -1e-3, 0.0]]
_GSPO_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 0]]


def test_gspo_by_hand_averages_over_responses_not_tokens() -> None:
    # eps = (3e-4, 4e-4): kept s in [0.9997, 1.0004].
    #   row 0: mean log r = 3e-4  -> s0 = e^(3e-4) = 1.00030005,  A = +1: kept, l = -s0
    #   row 1: mean log r = 1e-4  -> s1 = e^(1e-4) = 1.00010000,  A = -1: kept, l = +s1
    #   row 2: mean log r = -1e-3 -> s2 = 0.99900050 < 0.9997, A = -1: clipped, l = +0.9997
    # Default agg seq-mean-token-mean (GSPO eq. 5: (1/G) sum_i):
    #   loss = (-s0 + s1 + 0.9997) / 3 = 0.33316665
    #   d loss / d logp_t = -s_i A_i / (G |y_i|): row 0 -s0/6, row 1 +s1/9, row 2 0
    # token-mean, the default before issue 17, weighs rows by length and gives
    # (2 (-s0) + 3 s1 + 2 (0.9997)) / 7 = 0.42844285 and -s0/7, +s1/7.
    batch = _batch(_GSPO_LOG_R, [1.0, -1.0, -1.0], mask=_GSPO_MASK)
    out = build_estimator("gspo")(batch)
    s0, s1 = math.exp(3e-4), math.exp(1e-4)
    _close(out.loss, (-s0 + s1 + 0.9997) / 3)
    _close(_grad(out.loss, batch), [[-s0 / 6] * 2 + [0], [s1 / 9] * 3, [0] * 3])
    assert out.metrics["objective/frac_clipped"] == pytest.approx(2 / 7)

    token_mean = build_estimator("gspo", agg="token-mean")(batch)
    _close(token_mean.loss, (2 * -s0 + 3 * s1 + 2 * 0.9997) / 7)
    _close(_grad(token_mean.loss, batch), [[-s0 / 7] * 2 + [0], [s1 / 7] * 3, [0] * 3])


def test_gspo_default_gradient_is_the_gradient_of_the_sequence_objective() -> None:
    # GSPO eq. 5 by autograd: J = (1/G) sum_i s_i A_i, s_i = exp(masked mean_t log r), rows
    # of lengths 3 and 1, both kept.
    log_r = [[1e-4, -2e-4, 3e-4], [2e-4, 0.0, 0.0]]
    batch = _batch(log_r, [2.0, -1.0], mask=[[1, 1, 1], [1, 0, 0]])
    out = build_estimator("gspo")(batch)
    maskf = batch.mask.double()
    s = (((batch.logp - batch.logp_old) * maskf).sum(-1) / maskf.sum(-1)).exp()  # (G,)
    objective = -(s * torch.tensor([2.0, -1.0]).double()).mean()
    _close(_grad(out.loss, batch), _grad(objective, batch))


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


def test_sapo_by_hand_normalises_each_response_by_its_length() -> None:
    # Row 0, length 1: r = 1, A = +1 (tau 1):     l = -4 * 0.5 = -2,  weight 4 g (1-g) r = 1
    # Row 1, length 2, A = -1 (tau 1.05):
    #   t0: r = 1:     l = (4/1.05) 0.5 = 1.9047619,  weight 1
    #   t1: r = e^0.5 = 1.6487213: g = sigmoid(1.05 * 0.6487213 = 0.6811573) = 0.6639970
    #       l = (4/1.05) g = 2.5295122,  weight 4 g (1 - g) r = 1.4713518
    # Default agg seq-mean-token-mean (SAPO eq. 5): loss = (-2 + (1.9047619 + 2.5295122)/2)/2
    #   = 0.1085685;  d loss / d logp = -weight A / (G |y_i|): row 0 -1/2, row 1 +1/4, +1.4713518/4
    # (token-mean: (-2 + 1.9047619 + 2.5295122) / 3 = 0.8114247.)
    batch = _batch([[0.0, 0.0], [0.0, 0.5]], [1.0, -1.0], mask=[[1, 0], [1, 1]])
    out = build_estimator("sapo")(batch)
    r = math.exp(0.5)
    g = 1 / (1 + math.exp(-1.05 * (r - 1)))
    weight = 4 * g * (1 - g) * r
    _close(out.loss, (-2 + (2 / 1.05 + 4 / 1.05 * g) / 2) / 2)
    _close(_grad(out.loss, batch), [[-0.5, 0.0], [0.25, weight / 4]])
    _close(out.weights, [[1.0, 0.0], [1.0, weight]])


def test_cispo_by_hand_clips_the_weight_and_keeps_every_gradient() -> None:
    # Defaults (eps_lo, eps_hi) = (1, 4): w = clip(r, 0, 5), l = -w A log pi, token-mean.
    # Row 0, length 3, A = +1, r = [0.5, 1, 6], logp_old = [-2, -1, -3]:
    #   w = [0.5, 1, 5] (6 capped at 5), logp = [-2 + ln 0.5, -1, -3 + ln 6]
    #     = [-2.6931472, -1, -1.2082405] -> l = [1.3465736, 1, 6.0412027]
    # Row 1, length 1, A = -2, r = 0.1, logp_old = -0.5: no lower clip, w = 0.1
    #   logp = -0.5 + ln 0.1 = -2.8025851 -> l = -0.1 * -2 * -2.8025851 = -0.5605170
    # loss = (1.3465736 + 1 + 6.0412027 - 0.5605170) / 4 = 1.9568148
    # d loss / d logp = -w A / 4: [-0.125, -0.25, -1.25] and +0.05. The capped token keeps its
    # gradient (PPO's clip would zero it), and so does r = 0.1 (PPO would clip it at 0.8).
    log_r = [[math.log(0.5), 0.0, math.log(6.0)], [math.log(0.1), 0.0, 0.0]]
    logp_old = [[-2.0, -1.0, -3.0], [-0.5, 0.0, 0.0]]
    batch = _batch(log_r, [1.0, -2.0], mask=[[1, 1, 1], [1, 0, 0]], logp_old=logp_old)
    out = build_estimator("cispo")(batch)
    logp = [-2 + math.log(0.5), -1.0, -3 + math.log(6.0), -0.5 + math.log(0.1)]
    losses = [-0.5 * logp[0], -logp[1], -5 * logp[2], -0.1 * -2 * logp[3]]
    _close(out.loss, sum(losses) / 4)
    _close(_grad(out.loss, batch), [[-0.125, -0.25, -1.25], [0.05, 0.0, 0.0]])
    _close(out.weights, [[0.5, 1.0, 5.0], [0.1, 0.0, 0.0]])
    assert out.metrics["objective/frac_clipped"] == pytest.approx(1 / 4)  # the weight of r = 6


def test_cispo_without_lower_clip_is_stale_is_with_cap_one_plus_eps_high() -> None:
    gen = torch.Generator().manual_seed(3)
    log_r = (0.8 * torch.randn(3, 5, generator=gen)).tolist()
    advantages = torch.randn(3, 5, generator=gen).tolist()
    batch = _batch(log_r, advantages)
    cispo = build_estimator("cispo", clip_high=0.5)(batch)
    stale = build_estimator("stale_is+none", stale_cap=1.5)(batch)
    _close(cispo.loss, stale.loss)
    _close(_grad(cispo.loss, batch), _grad(stale.loss, batch))


def test_cispo_composes_with_a_mismatch_correction() -> None:
    # cispo+tis: w_mm = min(rho, 2) times w = clip(r, 0, 5). rho = [3, 0.5], r = [6, 1].
    batch = _batch([[math.log(6.0), 0.0]], [[1.0, 1.0]], log_rho=[[math.log(3.0), math.log(0.5)]])
    out = build_estimator("cispo+tis")(batch)
    _close(out.weights, [[2.0 * 5.0, 0.5 * 1.0]])
    _close(_grad(out.loss, batch), [[-10.0 / 2, -0.5 / 2]])


def test_vespo_phi_is_one_on_policy() -> None:
    out = build_estimator("vespo")(_batch([[0.0, 0.0], [0.0, 0.0]], [1.0, -1.0]))
    torch.testing.assert_close(out.weights, torch.ones(2, 2).double())


@pytest.mark.parametrize(("include_rho", "log_w"), [(False, 0.3), (True, 0.45)])
def test_vespo_weight_is_a_detached_product_over_tokens(include_rho: bool, log_w: float) -> None:
    # log r = [0.1, 0.2], log rho = [0.05, 0.1]: log W = sum_t log r = 0.3 (a sum, not a
    # mean), as the paper's scripts (W = prod pi_theta / pi_old); with include_rho also
    # sum_t log rho: 0.45 (W = prod pi_theta / mu).
    # A = 1 -> (k, lam) = (2, 3): phi = W^2 e^(3 (1 - W)); at 0.3: 1.8221 * 0.35009 = 0.63792
    # A = -1 -> (k, lam) = (3, 2): phi = W^3 e^(2 (1 - W))
    batch = _batch([[0.1, 0.2], [0.1, 0.2]], [1.0, -1.0], log_rho=[[0.05, 0.1]] * 2)
    out = build_estimator("vespo", include_rho=include_rho)(batch)
    w = math.exp(log_w)
    phi_pos = math.exp(2 * log_w + 3 * (1 - w))
    phi_neg = math.exp(3 * log_w + 2 * (1 - w))
    expected = torch.tensor([[phi_pos] * 2, [phi_neg] * 2]).double()
    torch.testing.assert_close(out.weights, expected)
    # detached: d loss / d logp = -phi A / N, no d phi / d logp term
    grad = torch.tensor([[-phi_pos / 4] * 2, [phi_neg / 4] * 2]).double()
    torch.testing.assert_close(_grad(out.loss, batch), grad)


def test_vespo_without_rho_composes_with_a_mismatch_correction() -> None:
    # log r = 0 (W = 1, phi = 1), rho = [3, 0.5]: vespo+tis weighs by min(rho, 2) * phi.
    batch = _batch([[0.0, 0.0]], [1.0], log_rho=[[math.log(3.0), math.log(0.5)]])
    _close(build_estimator("vespo+tis")(batch).weights, [[2.0, 0.5]])


@pytest.mark.parametrize(("length_norm", "divisor"), [("none", 1.0), ("T", 2.0), ("sqrtT", 2**0.5)])
def test_vespo_length_norm_divides_log_w(length_norm: str, divisor: float) -> None:
    batch = _batch([[0.1, 0.2]], [1.0], log_rho=[[0.05, 0.1]])  # rho: not in W by default
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


def test_decoupled_cis_caps_the_behaviour_weight_by_confidence() -> None:
    # CIS's recipe: pi_prox / mu capped at 1 + 2.3 max(1 - pi_prox, 0.005), not at 5.
    # pi_prox = e^-1 = 0.3679 (low confidence): cap 1 + 2.3 * 0.6321 = 2.4538; rho 6 -> 2.4538
    # pi_prox = e^-0.01 = 0.99005 (confident): cap 1 + 2.3 * 0.00995 = 1.02289; rho 2 -> 1.02289
    batch = _batch([[0.0, 0.0]], [[1.0, -2.0]], log_rho=[[math.log(6.0), math.log(2.0)]],
                   logp_old=[[-1.0, -0.01]])
    out = build_estimator("decoupled_cis")(batch)
    caps = [1 + 2.3 * (1 - math.exp(-1.0)), 1 + 2.3 * (1 - math.exp(-0.01))]
    torch.testing.assert_close(out.weights, torch.tensor([caps]).double())
    assert out.loss.item() == pytest.approx((-caps[0] + 2.0 * caps[1]) / 2)
    # the fixed cap 5 of plain decoupled leaves both
    torch.testing.assert_close(build_estimator("decoupled")(batch).weights,
                               torch.tensor([[5.0, 2.0]]).double())
    with pytest.raises(ValueError, match="behaviour_cap"):
        build_estimator("decoupled", behaviour_cap="clamp")


def test_decoupled_uses_logp_prox_when_given() -> None:
    # prox one version ahead of old: r' = pi / pi_prox = e^0.1 / e^0.1 = 1, w = pi_prox / mu = e^0.3
    base = _batch([[0.1]], [[1.0]], log_rho=[[0.2]])
    batch = TokenBatch(
        logp=base.logp, logp_old=base.logp_old, logp_rollout=base.logp_rollout,
        advantages=base.advantages, mask=base.mask, logp_prox=base.logp_old + 0.1,
    )  # fmt: skip
    out = build_estimator("decoupled")(batch)
    assert out.weights.item() == pytest.approx(math.exp(0.3))


def test_reweight_weighs_by_the_capped_total_ratio() -> None:
    # r = [e^0.5, 1, 2], rho = [e^0.2, 3, 0.25]: pi/mu = r rho = [e^0.7 = 2.0138, 3, 0.5]
    #   capped at C = 2 -> w = [2, 2, 0.5]; no clip: every token keeps its gradient.
    # A = [1, -1, 2], logp_old = -1 -> logp = [-0.5, -1, -1 + ln 2]
    # l = -w A logp = [1, -2, 1 - ln 2] -> loss = (1 - 2 + 0.3068528) / 3 = -0.2310491
    # d loss / d logp = -w A / 3 = [-2/3, 2/3, -1/3]
    log_r = [[0.5, 0.0, math.log(2.0)]]
    batch = _batch(log_r, [[1.0, -1.0, 2.0]], log_rho=[[0.2, math.log(3.0), math.log(0.25)]])
    out = build_estimator("reweight")(batch)
    # (_batch builds log rho through float32: equal to ~1e-8, not 1e-9)
    assert out.loss.item() == pytest.approx((1 - 2 + (1 - math.log(2.0))) / 3, rel=1e-7)
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 2.0, 0.5]]).double())
    torch.testing.assert_close(_grad(out.loss, batch), torch.tensor([[-2 / 3, 2 / 3, -1 / 3]]).double())
    assert out.metrics["objective/frac_clipped"] == pytest.approx(2 / 3)  # the capped two


@pytest.mark.parametrize("preset", [p for p in PRESETS if not PRESETS[p].centering])
def test_weights_are_the_coefficient_on_the_score(preset: str) -> None:
    # LossOutput.weights is c with d loss_t / d logp_t = -c A / N: full rows of equal length,
    # so every aggregation divides by N = 12.
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
