"""Shared loss helpers: KL estimators, safe division, aggregation and count checks."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.loss._common import (
    aggregate,
    global_count,
    global_token_mean,
    global_token_means,
    kl_estimate,
    safe_divide,
)
from nemo_rl.algorithms.loss.interfaces import LossType


def test_kl_estimators_are_unbiased_or_exact() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    exact = float((p * (p / q).log()).sum())
    for kl_type in ("k1", "k3"):
        expectation = float((p * kl_estimate(p.log(), q.log(), kl_type)).sum())
        assert expectation == pytest.approx(exact, rel=1e-12)
    d = math.log(0.5 / 0.2)
    assert float(kl_estimate(p.log(), q.log(), "k2")[0]) == pytest.approx(d * d / 2)
    clamped = kl_estimate(torch.tensor([0.0]), torch.tensor([-50.0]), "k3", clamp=2.0)
    assert float(clamped) == pytest.approx(math.exp(-2.0) - 1 + 2.0)
    with pytest.raises(ValueError, match="kl_type"):
        kl_estimate(p, q, "k5")


def test_safe_divide_and_aggregate() -> None:
    assert float(safe_divide(torch.tensor(0.0), torch.tensor(0))) == 0.0
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    token = aggregate(values, mask, LossType.TOKEN_LEVEL, torch.tensor(2), torch.tensor(6))
    assert float(token) == pytest.approx(7.0 / 6)
    seq = aggregate(values, mask, LossType.SEQUENCE_LEVEL, torch.tensor(4), torch.tensor(6))
    assert float(seq) == pytest.approx((1.5 + 4.0) / 4)


def test_global_token_means_equal_each_token_mean() -> None:
    """The stacked reduction gives each tensor's own token mean: float, bool and broadcast
    inputs, NaN outside the mask ignored, and 0 for an empty global count."""
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 6, generator=gen) > 0.4).float()
    values = torch.randn(4, 6, generator=gen)
    values[mask == 0] = float("nan")
    flags = torch.rand(4, 6, generator=gen) > 0.5
    per_row = torch.randn(4, 1, generator=gen)
    toks = torch.tensor(37.0)
    means = global_token_means([values, flags, per_row], mask, toks)
    expected = [global_token_mean(v.to(mask.dtype).expand_as(mask), mask, toks) for v in (values, flags, per_row)]
    torch.testing.assert_close(means, torch.stack(expected), rtol=1e-6, atol=0.0)
    assert global_token_means([values], mask, torch.tensor(0.0)).tolist() == [0.0]


def test_count_checks() -> None:
    with pytest.raises(ValueError, match="global_valid_seqs"):
        global_count(torch.tensor(-1), "global_valid_seqs")
