"""Properties every preset keeps on any batch: finite, mask-respecting, validated."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.hypothesis_budget import examples
from tether.estimators import AGGREGATIONS, PRESETS, TokenBatch, build_estimator

K = 3
FEW = examples(20)  # x 14 presets per example


def _random_batch(seed: int, b: int, t: int, scale: float, spread: float) -> dict:
    """Tensors as a dict (so tests can edit them); log-probs in [-scale, 0].

    `spread` sets how far apart the three policies are: log-ratios up to +-scale when
    spread = 1, i.e. ratios up to e^10000, far beyond any cap.
    """
    gen = torch.Generator().manual_seed(seed)

    def logp(*shape: int) -> torch.Tensor:
        return -scale * torch.rand(*shape, generator=gen, dtype=torch.float64) ** 2

    base = logp(b, t)
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[0, 0] = True  # at least one valid token
    head = logp(b, t, K)
    return {
        "logp": (base + spread * (logp(b, t) - base)).requires_grad_(True),
        "logp_old": base,
        "logp_rollout": base + spread * (logp(b, t) - base),
        "advantages": 5 * torch.randn(b, generator=gen, dtype=torch.float64),
        "mask": mask,
        "topk_ids": torch.randint(0, 50, (b, t, K), generator=gen),
        "topk_logp": (head + spread * (logp(b, t, K) - head)).requires_grad_(True),
        "topk_logp_old": head,
        "topk_logp_rollout": head + spread * (logp(b, t, K) - head),
    }


def _run(preset: str, tensors: dict, agg: str = "token-mean"):
    out = build_estimator(preset, agg=agg)(TokenBatch(**tensors))
    grads = torch.autograd.grad(
        out.loss, [tensors["logp"], tensors["topk_logp"]], allow_unused=True
    )
    return out, [torch.zeros(()) if g is None else g for g in grads]


batches = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**31 - 1),
        "b": st.integers(1, 4),
        "t": st.integers(1, 6),
        "scale": st.sampled_from([0.5, 30.0, 1e4]),
        "spread": st.sampled_from([0.0, 0.05, 1.0]),
    }
)


@FEW
@given(params=batches)
def test_loss_and_gradients_are_finite_for_extreme_inputs(params: dict) -> None:
    for preset in PRESETS:
        out, grads = _run(preset, _random_batch(**params))
        assert torch.isfinite(out.loss), preset
        assert all(torch.isfinite(g).all() for g in grads), preset
        assert torch.isfinite(out.weights).all(), preset
        assert all(math.isfinite(v) for v in out.metrics.values()), (preset, out.metrics)


@FEW
@given(params=batches, junk=st.sampled_from([math.nan, math.inf, -math.inf, 1e4, -1e4]))
def test_values_under_mask_zero_change_nothing(params: dict, junk: float) -> None:
    for preset in PRESETS:
        _check_masked_values_ignored(preset, _random_batch(**params), junk)


def _check_masked_values_ignored(preset: str, tensors: dict, junk: float) -> None:
    out, grads = _run(preset, tensors)
    edited = dict(tensors)
    hidden = ~tensors["mask"]
    for name in (
        "logp",
        "logp_old",
        "logp_rollout",
        "topk_logp",
        "topk_logp_old",
        "topk_logp_rollout",
    ):
        where = hidden if tensors[name].dim() == 2 else hidden.unsqueeze(-1)
        value = tensors[name].detach().masked_fill(where, junk)
        edited[name] = value.requires_grad_(tensors[name].requires_grad)
    edited["advantages"] = (
        tensors["advantages"][:, None].expand_as(hidden).masked_fill(hidden, junk)
    )
    out2, grads2 = _run(preset, edited)
    torch.testing.assert_close(out2.loss, out.loss)
    torch.testing.assert_close(out2.weights, out.weights)
    for g, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g2, g)
    assert out2.metrics == pytest.approx(out.metrics)


@FEW
@given(params=batches, agg=st.sampled_from(AGGREGATIONS))
def test_an_all_masked_row_contributes_nothing(params: dict, agg: str) -> None:
    extra = _random_batch(params["seed"] + 1, 1, params["t"], params["scale"], params["spread"])
    extra["mask"][:] = False
    for preset in PRESETS:
        _check_empty_row_ignored(preset, _random_batch(**params), extra, agg)


def _check_empty_row_ignored(preset: str, tensors: dict, extra: dict, agg: str) -> None:
    out, grads = _run(preset, tensors, agg)
    joined = {
        name: torch.cat([tensors[name].detach(), extra[name].detach()]).requires_grad_(
            tensors[name].requires_grad
        )
        for name in tensors
    }
    out2, grads2 = _run(preset, joined, agg)
    torch.testing.assert_close(out2.loss, out.loss)
    torch.testing.assert_close(grads2[0][:-1], grads[0])
    assert (grads2[0][-1] == 0).all()
    assert out2.metrics == pytest.approx(out.metrics)


@FEW
@given(params=batches)
# Rows of 2, 2, 2 and 0 tokens: the lengths differ, the gradients do not. Hypothesis found it
# against the old premise ("lengths differ => sapo differs from token-mean").
@example(params={"seed": 232, "b": 4, "t": 2, "scale": 0.5, "spread": 0.0})
def test_on_policy_the_vespo_objectives_are_two_gradients(params: dict) -> None:
    # E-VESPO at N = 1 (experiments/vespo.py N1_TWIN): pi_old is the training forward itself,
    # so r = W = 1 exactly. grpo and vespo with any length_norm (phi(1) = 1) give the
    # token-mean policy gradient; gspo (s = 1) and sapo (gate weight 1) its per-sequence mean.
    tensors = _random_batch(**params)
    tensors["logp_old"] = tensors["logp"].detach().clone()

    def grad(preset: str, **kw) -> torch.Tensor:
        loss = build_estimator(preset, **kw)(TokenBatch(**tensors)).loss
        return torch.autograd.grad(loss, tensors["logp"])[0]

    token_mean = grad("grpo")
    for norm in ("none", "T", "sqrtT"):
        torch.testing.assert_close(grad("vespo", length_norm=norm), token_mean)
    torch.testing.assert_close(grad("gspo"), grad("sapo"))
    torch.testing.assert_close(grad("grpo", agg="seq-mean-token-mean"), grad("sapo"))
    # The two differ exactly where a row that carries an advantage has a weight other than
    # the token mean's: 1 / (rows * T_i) against 1 / N. Lengths differing is not enough (the
    # row of the other length may be empty, or carry no advantage).
    lengths = tensors["mask"].sum(-1)
    rows = lengths > 0
    differs = rows & (tensors["advantages"] != 0) & (lengths * rows.sum() != lengths.sum())
    if differs.any():
        assert not torch.allclose(grad("sapo"), token_mean)
    else:
        torch.testing.assert_close(grad("sapo"), token_mean)


def _valid() -> dict:
    return _random_batch(0, 2, 3, 1.0, 0.1)


@pytest.mark.parametrize(
    "name", ["logp_old", "logp_rollout", "advantages", "mask", "logp_prox", "topk_logp"]
)
def test_shape_mismatch_raises_naming_the_tensor(name: str) -> None:
    tensors = _valid()
    tensors[name] = torch.zeros(2, 4) if name != "topk_logp" else torch.zeros(2, 3, K + 1)
    with pytest.raises(ValueError, match=f"TokenBatch.{name} has shape"):
        TokenBatch(**tensors)


def test_empty_batch_raises() -> None:
    tensors = {k: v[:0] for k, v in _valid().items()}
    with pytest.raises(ValueError, match="TokenBatch.logp must be a non-empty"):
        TokenBatch(**tensors)


def test_partial_topk_raises_naming_the_missing_tensors() -> None:
    tensors = _valid()
    del tensors["topk_logp_old"]
    with pytest.raises(ValueError, match="not topk_logp_old"):
        TokenBatch(**tensors)


def test_centering_without_topk_raises() -> None:
    tensors = {k: v for k, v in _valid().items() if not k.startswith("topk")}
    with pytest.raises(ValueError, match="needs topk_ids"):
        build_estimator("dlc")(TokenBatch(**tensors))
