"""Normalised effective sample size: hand values, log-space safety, the seq level."""

from __future__ import annotations

import math

import pytest
import torch

from tether.estimators import ess, ess_seq, ess_token


def test_ess_by_hand() -> None:
    ones = torch.ones(2, 2, dtype=torch.bool)
    assert ess(torch.ones(2, 2), ones).item() == pytest.approx(1.0)
    # one weight carries everything: (1)^2 / (4 * 1) = 1/4
    assert ess(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), ones).item() == pytest.approx(0.25)
    # w = [1, 3]: (4)^2 / (2 * 10) = 0.8; the masked 100 does not count
    w = torch.tensor([[1.0, 3.0, 100.0]])
    assert ess(w, torch.tensor([[1, 1, 0]])).item() == pytest.approx(0.8)


def test_log_forms_match_ess_and_survive_huge_log_ratios() -> None:
    log_ratio = torch.tensor([[0.0, math.log(3.0), 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert ess_token(log_ratio, mask).item() == pytest.approx(0.8)
    # exp(1e4) overflows; in log space one token dominating gives 1/N exactly
    huge = torch.tensor([[1e4, 0.0], [0.0, -1e4]])
    assert ess_token(huge, torch.ones(2, 2)).item() == pytest.approx(0.25)


def test_sequence_ess_multiplies_ratios_within_a_row() -> None:
    # rows: prod = e^(0.5 + 0.5) = e, and e^0 = 1 (second token masked) ->
    # ESS = (e + 1)^2 / (2 (e^2 + 1)) = 0.8147
    log_ratio = torch.tensor([[0.5, 0.5], [0.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    e = math.e
    assert ess_seq(log_ratio, mask).item() == pytest.approx((e + 1) ** 2 / (2 * (e * e + 1)))
    # an all-masked row is left out; an all-masked batch counts as fresh (1)
    padded = torch.cat([log_ratio, torch.tensor([[5.0, 5.0]])])
    assert ess_seq(padded, torch.cat([mask, torch.zeros(1, 2, dtype=mask.dtype)])).item() == (
        pytest.approx(ess_seq(log_ratio, mask).item())
    )
    assert ess_seq(log_ratio, torch.zeros(2, 2)).item() == 1.0
    assert ess_token(log_ratio, torch.zeros(2, 2)).item() == 1.0
