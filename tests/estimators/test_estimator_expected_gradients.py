"""Exact expected gradients, by enumerating every sequence of a tabular policy.

Scaling used throughout: each sequence is its own batch (B = 1, T tokens) and the
default token-mean aggregation divides by T, so an estimator that is unbiased for the
policy gradient has E_mu[grad loss] = -(1/T) grad J, J = E_{pi_theta}[A].
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from estimator_testlib import TabularPolicy

from tether.estimators import PRESETS, build_estimator


def _advantages(seed: int):
    """A fixed random outcome advantage per sequence."""
    gen = torch.Generator().manual_seed(seed)
    table: dict[tuple[int, ...], torch.Tensor] = {}

    def advantage_of(y: tuple[int, ...]) -> torch.Tensor:
        if y not in table:
            table[y] = torch.randn((), generator=gen, dtype=torch.float64)
        return table[y]

    return advantage_of


@pytest.mark.parametrize("preset", list(PRESETS))
def test_on_policy_expected_gradient_is_the_policy_gradient(preset: str) -> None:
    # mu = pi_old = pi_theta: every ratio is 1, every clip inactive, phi(1) = 1, the
    # centering coefficients sum to a zero-mean score. Vocab 4, length 2: 16 sequences.
    policy = TabularPolicy(vocab=4, length=2, seed=1)
    advantage_of = _advantages(seed=2)
    k = 2 if PRESETS[preset].centering else 0  # K < V: the tail model is exact here too
    expected = policy.expected_gradient(build_estimator(preset), advantage_of, k=k)
    target = -policy.policy_gradient(advantage_of) / policy.length
    torch.testing.assert_close(expected, target, rtol=1e-9, atol=1e-12)


def _mismatch_only(vocab: int, seed: int) -> TabularPolicy:
    policy = TabularPolicy(vocab=vocab, length=2, seed=seed)
    policy.mu = policy.perturbed(0.5)  # generator numerics differ; weights are the same
    return policy


def _constant(y: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(1.0, dtype=torch.float64)


def test_centering_cancels_numerical_mismatch_when_head_is_whole_vocabulary() -> None:
    # Constant A: the on-policy gradient is 0. Centered over all of V, dlc's expected
    # gradient is A [E_mu grad log pi - sum_v mu(v) grad log pi(v)] = 0 exactly, while
    # naive keeps the drift -(A/T) E_mu[sum_t grad log pi_theta(y_t)].
    policy = _mismatch_only(vocab=4, seed=3)
    dlc = policy.expected_gradient(build_estimator("dlc"), _constant, k=4)
    naive = policy.expected_gradient(build_estimator("naive"), _constant)
    assert dlc.abs().max() < 1e-12
    assert naive.abs().max() > 1e-2


def test_centering_subtracts_the_objectives_own_weighted_score() -> None:
    # Staleness and mismatch together, constant A, K = V: the centering term subtracts
    # sum_v mu(v) w(v) grad log pi(v) with the objective's own w(v) = min(r(v), C_s), which
    # is exactly the mu-mean of the sampled w(y) grad log pi(y): zero again, whatever C_s.
    policy = _mismatch_only(vocab=4, seed=9)
    policy.old = policy.perturbed(0.7)
    for cap in (2.0, 1.1, math.inf):
        dlc = policy.expected_gradient(build_estimator("dlc", stale_cap=cap), _constant, k=4)
        assert dlc.abs().max() < 1e-12, cap
    stale = policy.expected_gradient(build_estimator("stale_is+none"), _constant)
    assert stale.abs().max() > 1e-2


def test_centering_residual_shrinks_as_the_head_grows() -> None:
    # With K < V the tail is modelled as mu ~ rho_tail pi_old. A one-token tail is
    # modelled exactly (K = V - 1); below that the residual falls as K grows.
    policy = _mismatch_only(vocab=6, seed=4)
    dlc = build_estimator("dlc")
    norms = [policy.expected_gradient(dlc, _constant, k=k).norm().item() for k in range(1, 7)]
    naive = policy.expected_gradient(build_estimator("naive"), _constant).norm().item()
    assert norms[0] < naive
    assert all(a > b for a, b in itertools.pairwise(norms[:5])), norms
    assert norms[4] < 1e-12 and norms[5] < 1e-12, norms


def _staleness_only(length: int, seed: int) -> TabularPolicy:
    policy = TabularPolicy(vocab=4, length=length, seed=seed)
    policy.old = policy.perturbed(0.7)  # the generator's weights lag; numerics agree
    policy.mu = policy.old.clone()
    return policy


def test_uncapped_stale_is_is_unbiased_for_the_current_policy_gradient() -> None:
    # One token (a bandit): E_{pi_old}[r A grad log pi_theta] = E_{pi_theta}[A grad log pi].
    policy = _staleness_only(length=1, seed=5)
    advantage_of = _advantages(seed=6)
    target = -policy.policy_gradient(advantage_of)
    stale = policy.expected_gradient(
        build_estimator("stale_is+none", stale_cap=math.inf), advantage_of
    )
    naive = policy.expected_gradient(build_estimator("naive"), advantage_of)
    torch.testing.assert_close(stale, target, rtol=1e-9, atol=1e-12)
    assert (naive - target).abs().max() > 1e-2  # the check has teeth
    capped = policy.expected_gradient(build_estimator("stale_is+none", stale_cap=1.0), advantage_of)
    assert (capped - target).abs().max() > 1e-3  # a binding cap trades bias for variance


def test_uncapped_stale_is_is_unbiased_per_prefix_on_sequences() -> None:
    # Length 2, token advantages a(h, y) of the prefix and token only. Token-level IS
    # reweights the token, not the prefix: its target is
    #   -(1/T) sum_t sum_h pi_old(h) sum_y pi_theta(y | h) a(h, y) grad log pi_theta(y | h),
    # computed here by autograd on the surrogate S = sum pi_old(h) pi_theta(y | h) a(h, y).
    policy = _staleness_only(length=2, seed=7)
    gen = torch.Generator().manual_seed(8)
    a = {
        (h, y): torch.randn((), generator=gen, dtype=torch.float64)
        for h in policy.row
        for y in range(policy.vocab)
    }

    def advantage_of(seq: tuple[int, ...]) -> torch.Tensor:
        return torch.stack([a[(seq[:t], seq[t])] for t in range(policy.length)])

    surrogate = 0.0
    for h, row in policy.row.items():
        prefix_old = policy.seq_prob(policy.old, h) if h else torch.tensor(1.0)
        probs = policy.theta[row].softmax(-1)
        surrogate = surrogate + prefix_old * sum(probs[y] * a[(h, y)] for y in range(policy.vocab))
    (grad,) = torch.autograd.grad(surrogate, policy.theta)
    stale = policy.expected_gradient(
        build_estimator("stale_is+none", stale_cap=math.inf), advantage_of
    )
    torch.testing.assert_close(stale, -grad / policy.length, rtol=1e-9, atol=1e-12)


def _stale_and_mismatched(vocab: int, length: int, seed: int) -> TabularPolicy:
    policy = TabularPolicy(vocab=vocab, length=length, seed=seed)
    policy.old = policy.perturbed(0.7)  # the generator's weights lag ...
    policy.mu = policy.old + (policy.perturbed(0.5) - policy.theta.detach())  # + noise of std 0.5
    return policy  # ... and its numerics differ (mu != pi_old): both causes at once


def test_dlc_clip_subtracts_the_mu_mean_of_its_own_clipped_score() -> None:
    # One token, V = 5, both causes, K = V, token advantage A(y) of either sign. With
    # w_A(v) = r(v), or 0 where PPO clips v under A's sign (A > 0: r > 1.28; A < 0: r < 0.8),
    # and grad_theta log pi(v) = e_v - pi (theta: the logit row), dlc_clip's expected gradient
    # is, written out independently of the estimator code,
    #   -sum_y mu(y) A(y) [ w_A(y)(y) (e_y - pi) - sum_v mu(v) w_A(y)(v) (e_v - pi) ]
    policy = _stale_and_mismatched(vocab=5, length=1, seed=11)
    advantage_of = _advantages(seed=12)
    pi, old, mu = (t.detach()[0].softmax(-1) for t in (policy.theta, policy.old, policy.mu))
    r, eye = pi / old, torch.eye(5, dtype=torch.float64)
    expected = torch.zeros(5, dtype=torch.float64)
    clipped = 0
    for y in range(5):
        a = advantage_of((y,))
        w = torch.where((r > 1.28) if a > 0 else (r < 0.8), torch.zeros_like(r), r)
        clipped += int((w == 0).sum())
        score = eye - pi  # (V, V): row v is grad log pi(v)
        expected -= mu[y] * a * (w[y] * score[y] - (mu * w) @ score)
    assert clipped > 0  # the clip binds on some head tokens: the check has teeth
    got = policy.expected_gradient(build_estimator("dlc_clip"), advantage_of, k=5)
    torch.testing.assert_close(got[0], expected, rtol=1e-9, atol=1e-12)
    # ppo alone (no centering) keeps the mean mismatch term: a different gradient
    grpo = policy.expected_gradient(build_estimator("grpo"), advantage_of)
    assert (grpo[0] - expected).abs().max() > 1e-3


def test_dlc_clip_centering_cancels_both_causes_under_a_constant_advantage() -> None:
    # Constant A (the on-policy gradient is 0), K = V, sequences of length 2: the centering
    # subtracts exactly the mu-mean of the clipped, staleness-weighted score, so the
    # expected gradient is 0; grpo (the same clip, uncentered) drifts.
    policy = _stale_and_mismatched(vocab=4, length=2, seed=13)
    dlc_clip = policy.expected_gradient(build_estimator("dlc_clip"), _constant, k=4)
    assert dlc_clip.abs().max() < 1e-12
    grpo = policy.expected_gradient(build_estimator("grpo"), _constant)
    assert grpo.abs().max() > 1e-2


def test_uncapped_reweight_is_unbiased_under_both_causes() -> None:
    # One token: E_mu[(pi_theta / mu) A grad log pi_theta] = grad J, staleness and numerics
    # together. DLC's plain reweighting is this with a cap, which then biases it.
    policy = _stale_and_mismatched(vocab=4, length=1, seed=14)
    advantage_of = _advantages(seed=15)
    target = -policy.policy_gradient(advantage_of)
    full = policy.expected_gradient(build_estimator("reweight", cap=math.inf), advantage_of)
    torch.testing.assert_close(full, target, rtol=1e-9, atol=1e-12)
    capped = policy.expected_gradient(build_estimator("reweight", cap=1.0), advantage_of)
    assert (capped - target).abs().max() > 1e-3
