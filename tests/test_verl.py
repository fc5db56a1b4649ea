"""tether's losses through verl's own registry and rollout weights (runs in .venv-verl:
`make install-verl`; `make test` runs it there). Skipped where verl is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

import tether.integrations.verl as tether_verl
from tether import api


def tensors(seed: int = 0, B: int = 6, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, 5, generator=g)
    ids = torch.randint(0, 5, (B, T), generator=g)
    pick = lambda x: torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    mu = pick(logits)
    old = pick(logits + 0.3 * torch.randn(B, T, 5, generator=g))  # numerical mismatch
    new = pick(logits + 0.6 * torch.randn(B, T, 5, generator=g))  # a few updates later
    mask = (torch.arange(T)[None] < torch.randint(3, T + 1, (B, 1), generator=g)).float()
    adv = torch.randn(B, generator=g)[:, None].expand(B, T).contiguous()
    return mu, old, new, mask, adv


@pytest.mark.parametrize("name", ["tether_dlc", "tether_cis", "tether_vespo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_verl_calls_tethers_loss_with_mu_from_its_rollout_weights(name, agg):
    mu, old, new, mask, adv = tensors()
    # verl's own weights (token level, a threshold that never binds) carry mu.
    weights, _ = compute_rollout_correction_weights(old - mu, mask, rollout_is="token",
                                                    rollout_is_threshold=1e30)
    theta = new.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=theta, advantages=adv, response_mask=mask,
        loss_agg_mode=agg, config=None, rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, theta)
    ref_theta = new.clone().requires_grad_(True)
    ref = api.loss(tether_verl.PRESETS[name], logp=ref_theta, logp_old=old, logp_rollout=mu,
                   advantages=adv, mask=mask, agg=agg)
    (ref_grad,) = torch.autograd.grad(ref.loss, ref_theta)
    assert float(loss) == pytest.approx(float(ref.loss), abs=1e-6)
    assert float((grad - ref_grad).abs().max()) < 1e-6 and float(ref_grad.abs().max()) > 1e-3
    assert metrics["tether/loss/total"] == pytest.approx(float(ref.loss), abs=1e-6)


def test_the_numerical_correction_needs_verls_weights():
    # cis without rollout weights: mu = pi_old, the numerical weight is 1 (staleness only).
    _, old, new, mask, adv = tensors(1)
    loss, _ = core_algos.get_policy_loss_fn("tether_cis")(old, new, adv, mask, "token-mean", None, None)
    assert float(loss) == pytest.approx(float(api.loss(
        "cis", logp=new, logp_old=old, logp_rollout=old, advantages=adv, mask=mask).loss), abs=1e-7)
    with pytest.raises(ValueError, match="aggregates by"):
        core_algos.get_policy_loss_fn("tether_cis")(old, new, adv, mask, "token-sum", None, None)


def test_the_global_batch_normalisation_is_verls():
    # Two data-parallel ranks, each half the tokens: verl divides by the global count.
    mu, old, new, mask, adv = tensors(2)

    class Config:
        def __init__(self):
            self.global_batch_info = {"dp_size": 2, "batch_num_tokens": float(mask.sum()) * 2}

    loss, _ = core_algos.get_policy_loss_fn("tether_vespo")(old, new, adv, mask, "token-mean",
                                                            Config(), torch.exp(old - mu))
    local = api.loss("vespo", logp=new, logp_old=old, logp_rollout=mu, advantages=adv, mask=mask)
    assert float(loss) == pytest.approx(float(local.loss), abs=1e-6)  # 2 x half = the same
    tether_verl.register("tether_tis_cap3", "tis", cap=3.0)
    assert "tether_tis_cap3" in core_algos.POLICY_LOSS_REGISTRY
