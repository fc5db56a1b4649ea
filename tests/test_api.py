"""tether.api: the split, the losses, the re-sync test and the advice on bare tensors, equal
to what `tether train` computes on the same tensors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tether import api
from tether.diagnostics import decompose, mismatch_metrics
from tether.estimators import TokenBatch, build_estimator, ess_token

B, T, K = 4, 5, 3


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(B, T, generator=g) * 3
    old = mu + 0.05 * torch.randn(B, T, generator=g)  # numerics
    new = old + 0.2 * torch.randn(B, T, generator=g)  # weights moved
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    adv = torch.randn(B, generator=g)
    return mu, old, new, mask, adv


def test_split_with_all_three_is_tethers_own_split(tensors):
    mu, old, new, mask, _ = tensors
    full = api.split(mask, logp_rollout=mu, logp_old=old, logp=new)
    assert full == mismatch_metrics(decompose(mu, old, new, mask))
    # k3 by hand for the staleness part: mean over valid tokens of e^d - 1 - d.
    d = (new - old).double()[mask]
    assert full["staleness/k3_kl/mean"] == pytest.approx(float((d.exp() - 1 - d).mean()))


def test_split_from_two_log_probs_names_only_what_they_identify(tensors):
    mu, old, new, mask, _ = tensors
    full = api.split(mask, logp_rollout=mu, logp_old=old, logp=new)
    for cause, given in (("numerical", {"logp_rollout": mu, "logp_old": old}),
                         ("staleness", {"logp_old": old, "logp": new}),
                         ("total", {"logp_rollout": mu, "logp": new})):
        part = api.split(mask, **given)
        assert {k.split("/")[0] for k in part} == {cause}
        assert part == pytest.approx({k: v for k, v in full.items() if k.startswith(cause + "/")})
    with pytest.raises(ValueError, match="two of"):
        api.split(mask, logp=new)
    with pytest.raises(ValueError, match="shape"):
        api.split(mask, logp_rollout=mu, logp_old=old[:, :2])


@pytest.mark.parametrize("name", ["tis", "cis", "vespo", "dlc"])
def test_loss_is_the_estimators_loss_and_gradient(tensors, name):
    mu, old, new, mask, adv = tensors
    g = torch.Generator().manual_seed(1)
    topk = {}
    if name == "dlc":  # centering reads the generator's top-K head
        ids = torch.randint(0, 20, (B, T, K), generator=g)
        top_mu = -torch.rand(B, T, K, generator=g) * 3
        topk = {"topk_ids": ids, "topk_logp_rollout": top_mu, "topk_logp_old": top_mu + 0.01,
                "topk_logp": (top_mu + 0.02).requires_grad_()}
    a, b = new.clone().requires_grad_(), new.clone().requires_grad_()
    out = api.loss(name, logp=a, logp_old=old, logp_rollout=mu, advantages=adv, mask=mask, **topk)
    ref_topk = {k: (v.detach().clone().requires_grad_() if k == "topk_logp" else v) for k, v in topk.items()}
    ref = build_estimator(name)(TokenBatch(logp=b, logp_old=old, logp_rollout=mu, advantages=adv,
                                           mask=mask, **ref_topk))
    out.loss.backward()
    ref.loss.backward()
    assert out.loss.item() == ref.loss.item() and out.metrics == ref.metrics
    assert torch.equal(a.grad, b.grad) and a.grad.abs().sum() > 0


def test_loss_takes_the_estimators_parameters(tensors):
    mu, old, new, mask, adv = tensors
    args = {"logp": new, "logp_old": old, "logp_rollout": mu, "advantages": adv, "mask": mask}
    assert api.loss("tis", cap=1.0, **args).metrics["correction/weight/max"] <= 1.0
    with pytest.raises(ValueError, match="cap"):
        api.loss("tis", cap=-1.0, **args)


def test_resync_is_the_ess_policys_decision(tensors):
    _, old, new, mask, _ = tensors
    ess, trip = api.resync(new, old, mask, tau=0.5)
    assert ess == pytest.approx(float(ess_token((new - old).double(), mask)))
    assert not trip and api.resync(new, old, mask, tau=math.nextafter(ess, 1.0))[1]
    assert not api.resync(new, old, mask, tau=ess)[1]  # equal to tau does not trip


def test_advise_on_a_batch(tensors):
    mu, old, new, mask, _ = tensors
    calm = api.split(mask, logp_rollout=old, logp_old=old, logp=old + 1e-3)
    rec, text = api.advise(calm, batch=B)
    assert rec.cause == "none" and "nothing to correct" in text
    rec, _ = api.advise(api.split(mask, logp_rollout=mu, logp_old=old, logp=old + 5.0 * (new - old)),
                        batch=B)
    assert rec.cause == "staleness" and rec.sync_policy == "ess:0.5"
    with pytest.raises(ValueError, match="numerical"):
        api.advise(api.split(mask, logp_old=old, logp=new), batch=B)


def test_the_example_runs_a_foreign_loop_through_the_api(warm_model_dir):
    out = subprocess.run([sys.executable, "examples/tensor_api.py", "--model", str(warm_model_dir)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "epoch 1: loss" in out and "staleness  k3" in out and "\nadvice: " in out
