"""Advantage estimators against hand-computed small cases."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from nemo_rl.algorithms.advantage_estimators import (
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)

# Groups: prompt 7 -> rewards [1, 0, 0, 1]; prompt 3 -> [0.5, 0.5, 0.5] (all equal); prompt 9 -> [2] (alone).
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.5, 1.0, 0.5, 2.0], dtype=torch.float64)
GROUPS = torch.tensor([7, 7, 3, 7, 3, 7, 3, 9])
MASK = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1], [0, 1, 1], [1, 1, 0], [0, 1, 1], [0, 1, 1]])


def per_sample(advantages: torch.Tensor) -> list[float]:
    """The value on each sample's masked tokens (asserting it is constant there and 0 elsewhere)."""
    values = []
    for b in range(advantages.shape[0]):
        on = advantages[b][MASK[b] == 1]
        assert torch.all(advantages[b][MASK[b] == 0] == 0)
        assert torch.all(on == on[0])
        values.append(float(on[0]))
    return values


def test_grpo_mean_baseline_with_std() -> None:
    adv = grpo_advantages(REWARDS, GROUPS, MASK, normalize_rewards=True, epsilon=0.0)
    std = statistics.stdev([1, 0, 0, 1])  # sample std of prompt 7 = 0.57735...
    expected = [0.5 / std, -0.5 / std, 0.0, -0.5 / std, 0.0, 0.5 / std, 0.0, 0.0]
    assert per_sample(adv) == pytest.approx(expected, rel=1e-12)
    assert not torch.isnan(adv).any()


def test_grpo_epsilon_and_no_normalisation() -> None:
    adv = grpo_advantages(REWARDS, GROUPS, MASK, normalize_rewards=True, epsilon=0.1)
    std = statistics.stdev([1, 0, 0, 1])
    assert per_sample(adv)[0] == pytest.approx(0.5 / (std + 0.1))
    adv = grpo_advantages(REWARDS, GROUPS, MASK, normalize_rewards=False)
    assert per_sample(adv) == pytest.approx([0.5, -0.5, 0.0, -0.5, 0.0, 0.5, 0.0, 0.0])


def test_grpo_leave_one_out() -> None:
    adv = grpo_advantages(REWARDS, GROUPS, MASK, use_leave_one_out_baseline=True, normalize_rewards=False)
    # Sample 0 (reward 1) vs others [0, 0, 1] -> 1 - 1/3; sample 1 (reward 0) vs [1, 0, 1] -> -2/3.
    expected = [2 / 3, -2 / 3, 0.0, -2 / 3, 0.0, 2 / 3, 0.0, 0.0]
    assert per_sample(adv) == pytest.approx(expected, rel=1e-12)
    assert per_sample(rloo_advantages(REWARDS, GROUPS, MASK)) == pytest.approx(expected, rel=1e-12)
    adv = grpo_advantages(REWARDS, GROUPS, MASK, use_leave_one_out_baseline=True, normalize_rewards=True, epsilon=0.0)
    std = statistics.stdev([1, 0, 0, 1])
    assert per_sample(adv) == pytest.approx([x / std for x in expected], rel=1e-12)


def test_reinforce_plus_plus_hand_computed() -> None:
    """KL in the reward, per token (not summed over the rest of the response), then whitened
    over the masked tokens with the population variance (NeMo RL's reinforce_plus_plus)."""
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
    logprobs = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -0.5, -1.0]], dtype=torch.float64)
    reference = torch.tensor([[0.0, -1.5, -1.0, 9.0], [0.0, -0.5, -1.0, -1.0]], dtype=torch.float64)
    adv = reinforce_plus_plus_advantages(
        rewards, mask, logprobs=logprobs, reference_logprobs=reference, kl_coef=0.1, kl_type="k1"
    )
    # k1 KL per valid token: row 0: [0.5, -1.0]; row 1: [0, 0.5, 0]; a = reward - 0.1 * kl
    values = [1 - 0.05, 1 + 0.1, 0.0, -0.05, 0.0]
    mean, std = statistics.mean(values), statistics.pstdev(values)
    white = [(v - mean) / std for v in values]
    expected = torch.tensor([[0, white[0], white[1], 0], [0, white[2], white[3], white[4]]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)


def test_reinforce_plus_plus_baseline_and_equal_rewards() -> None:
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1]])
    same = reinforce_plus_plus_advantages(torch.full((4,), 0.3, dtype=torch.float64), mask, group_ids=torch.tensor([0, 0, 1, 1]))
    assert torch.all(same == 0)
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0], dtype=torch.float64)
    adv = reinforce_plus_plus_advantages(rewards, mask, group_ids=torch.tensor([0, 0, 1, 1]))
    # After the group baseline every sample is +-0.5 on each of its tokens; whitened over the
    # six masked tokens, each weighing one (so the longer samples weigh more)
    values = [0.5, 0.5, -0.5, 0.5, 0.5, -0.5]
    mean, std = statistics.mean(values), statistics.pstdev(values)
    expected = torch.tensor([[0.5, 0.5], [-0.5, 0], [0.5, 0.5], [0, -0.5]], dtype=torch.float64)
    torch.testing.assert_close(adv, torch.where(mask == 1, (expected - mean) / std, 0.0).to(torch.float64))
    assert math.isclose(float(adv[mask == 1].pow(2).mean()), 1.0)


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"'rewards' must be a tensor of shape \[batch\]"):
        grpo_advantages(REWARDS[:, None], GROUPS, MASK)
    with pytest.raises(ValueError, match=r"'group_ids' must have shape \[batch\]=\[8\]"):
        grpo_advantages(REWARDS, GROUPS[:4], MASK)
    with pytest.raises(ValueError, match="'group_ids' must be an integer tensor"):
        grpo_advantages(REWARDS, GROUPS.double(), MASK)
    with pytest.raises(ValueError, match=r"'mask' must have shape \[batch, seq\]"):
        grpo_advantages(REWARDS, GROUPS, MASK[:4])
    with pytest.raises(ValueError, match="'rewards' must be a floating-point"):
        grpo_advantages(GROUPS, GROUPS, MASK)
    with pytest.raises(ValueError, match="reference_logprobs"):
        reinforce_plus_plus_advantages(REWARDS, MASK, kl_coef=0.1)
