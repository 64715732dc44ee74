"""PreferenceLossFn (Bradley-Terry) against a float64 loop, micro-batch invariance, gradient and
errors."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl.algorithms.loss import PreferenceLossFn

# Three (chosen, rejected) pairs; the second is dropped by sample_mask; the third is a loss.
REWARDS = torch.tensor([1.5, -0.5, 9.0, 9.0, -0.25, 0.75], dtype=torch.float64)
MASK = torch.tensor([1, 1, 0, 0, 1, 1])


def reference() -> dict[str, float]:
    """The metrics derived pair by pair by hand."""
    pairs = [(1.5, -0.5), (-0.25, 0.75)]
    loss = sum(-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in pairs) / 2
    return {
        "loss": loss,
        "accuracy": 0.5,
        "rewards_chosen_mean": (1.5 - 0.25) / 2,
        "rewards_rejected_mean": (-0.5 + 0.75) / 2,
        "num_valid_samples": 4.0,
    }


def test_matches_hand_derivation() -> None:
    loss, metrics = PreferenceLossFn()(
        {"sample_mask": MASK}, torch.tensor(4.0), torch.tensor(0.0), rewards=REWARDS
    )
    assert metrics == pytest.approx(reference(), abs=1e-12)
    assert float(loss) == pytest.approx(reference()["loss"], abs=1e-12)


def test_micro_batches_sum_to_the_global_loss_and_gradient() -> None:
    fn = PreferenceLossFn()
    whole = REWARDS.clone().requires_grad_()
    loss, _ = fn({"sample_mask": MASK}, torch.tensor(4.0), torch.tensor(0.0), rewards=whole)
    loss.backward()
    split = REWARDS.clone().requires_grad_()
    total, summed = torch.zeros((), dtype=torch.float64), {}
    for rows in (slice(0, 2), slice(2, 6)):
        part, metrics = fn(
            {"sample_mask": MASK[rows]}, torch.tensor(4.0), torch.tensor(0.0), rewards=split[rows]
        )
        total = total + part
        for key, value in metrics.items():
            summed[key] = summed.get(key, 0.0) + value
    total.backward()
    assert float(total) == pytest.approx(float(loss), abs=1e-12)
    assert summed == pytest.approx(reference(), abs=1e-12)
    assert torch.allclose(whole.grad, split.grad, atol=1e-12)
    # d/dr_c of -log sigmoid(r_c - r_r) is -sigmoid(r_r - r_c), over 2 valid pairs
    assert float(whole.grad[0]) == pytest.approx(-torch.sigmoid(torch.tensor(-2.0)).item() / 2)
    assert float(whole.grad[2]) == 0.0


def test_errors() -> None:
    fn = PreferenceLossFn()
    one = torch.tensor(2.0)
    with pytest.raises(ValueError, match="even batch"):
        fn({"sample_mask": torch.ones(3)}, one, one, rewards=torch.zeros(3))
    with pytest.raises(ValueError, match="sample_mask"):
        fn({"sample_mask": torch.tensor([1, 0])}, one, one, rewards=torch.zeros(2))
    with pytest.raises(ValueError, match=r"'rewards' must be a tensor of shape \[batch\]"):
        fn({"sample_mask": torch.ones(2)}, one, one, rewards=torch.zeros(2, 1))
    with pytest.raises(TypeError, match="rewards"):
        fn({"sample_mask": torch.ones(2)}, one, one, next_token_logprobs=torch.zeros(2, 3))
