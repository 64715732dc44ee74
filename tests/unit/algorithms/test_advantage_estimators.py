"""Advantage estimators against hand-computed small cases."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from nemo_rl.algorithms.advantage_estimators import (
    gdpo_advantages,
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
    std = statistics.stdev([0, 0, 1])  # the other members of sample 0 (and of 1: [1, 0, 1])
    assert per_sample(adv) == pytest.approx([x / std for x in expected], rel=1e-12)


def test_grpo_leave_one_out_std_is_the_other_members() -> None:
    """NeMo RL's rule: with a leave-one-out baseline each sample is divided by the sample std of
    the other members, and kept unscaled where they have no spread. Group (1, 0, 0, 0): sample
    0's others [0, 0, 0] have no spread -> 1 - 0 = 1; each 0's others [1, 0, 0] have mean 1/3
    and std sqrt(1/3) -> -(1/3) / sqrt(1/3) = -0.57735. A pair (1, 0): one other each -> +-1.
    A group whose rewards are all equal gets exactly 0."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.1, 0.1, 0.1])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    mask = torch.ones(9, 2)
    adv = grpo_advantages(rewards, groups, mask, use_leave_one_out_baseline=True, epsilon=0.0)
    third = -(1 / 3) / statistics.stdev([1, 0, 0])
    assert adv[:, 0].tolist() == pytest.approx([1.0, third, third, third, 1.0, -1.0, 0.0, 0.0, 0.0], rel=1e-6)
    assert adv[6:].abs().sum() == 0


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


# GDPO: 2 groups x 4 samples x 2 rewards. Group 0: correctness [1, 0, 1, 0], format [0, 1, 0, 0]
# (samples 0 and 1 score (1, 0) and (0, 1): the same total). Group 1: correctness [1, 1, 1, 1]
# (zero std), format [1, 0, 0, 0].
GDPO_GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
GDPO_REWARDS = {
    "reward/format": torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64),
    "reward/correctness": torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64),
}
GDPO_MASK = torch.ones(8, 2, dtype=torch.long)


def whiten(values: list[float]) -> list[float]:
    """``(v - mean) / sample std`` over the batch: GDPO's last step."""
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / std for v in values]


def test_gdpo_hand_computed() -> None:
    # Group 0 correctness: mean 1/2, sample std sqrt(1/3) -> +-sqrt(3)/2; format: mean 1/4,
    # sample std 1/2 -> [-1/2, 3/2, -1/2, -1/2]. Group 1 correctness has no spread -> 0;
    # format [1, 0, 0, 0] -> [3/2, -1/2, -1/2, -1/2].
    h = math.sqrt(3) / 2
    correctness = [h, -h, h, -h, 0.0, 0.0, 0.0, 0.0]
    fmt = [-0.5, 1.5, -0.5, -0.5, 1.5, -0.5, -0.5, -0.5]
    adv = gdpo_advantages(GDPO_REWARDS, GDPO_GROUPS, GDPO_MASK, epsilon=0.0)
    summed = [c + f for c, f in zip(correctness, fmt)]  # [0.366, 0.634, 0.366, -1.366, 1.5, -.5, -.5, -.5]
    assert adv[:, 0].tolist() == pytest.approx(whiten(summed), rel=1e-12)
    assert adv[:, 0].tolist() == pytest.approx(
        [0.41159, 0.71290, 0.41159, -1.53607, 1.68673, -0.56224, -0.56224, -0.56224], abs=1e-5
    )
    # (1, 0) vs (0, 1): GRPO on the total reward (1 and 1) cannot tell them apart, GDPO can.
    totals = GDPO_REWARDS["reward/correctness"] + GDPO_REWARDS["reward/format"]
    grpo = grpo_advantages(totals, GDPO_GROUPS, GDPO_MASK)
    assert grpo[0, 0] == grpo[1, 0]
    assert adv[1, 0] - adv[0, 0] == pytest.approx((0.634 - 0.366) / 0.889294, abs=1e-4)
    # weights follow the sorted names: correctness x2, format x1
    weighted = gdpo_advantages(GDPO_REWARDS, GDPO_GROUPS, GDPO_MASK, reward_weights=[2.0, 1.0], epsilon=0.0)
    assert weighted[:, 0].tolist() == pytest.approx(whiten([2 * c + f for c, f in zip(correctness, fmt)]), rel=1e-12)
    # the default epsilon (1e-6) is added to each component's std
    eps = gdpo_advantages(GDPO_REWARDS, GDPO_GROUPS, GDPO_MASK)
    expected = whiten([c * (1 / math.sqrt(3)) / (1 / math.sqrt(3) + 1e-6) + f * 0.5 / (0.5 + 1e-6) for c, f in zip(correctness, fmt)])
    assert eps[:, 0].tolist() == pytest.approx(expected, rel=1e-12)


def test_gdpo_leave_one_out_and_no_normalisation() -> None:
    adv = gdpo_advantages(
        GDPO_REWARDS, GDPO_GROUPS, GDPO_MASK, use_leave_one_out_baseline=True, epsilon=0.0
    )
    # Leave-one-out: baseline and sample std over the other three members. Group 0 correctness
    # [1, 0, 1, 0]: sample 0 vs [0, 1, 0] -> (1 - 1/3) / sqrt(1/3); sample 1 vs [1, 1, 0] ->
    # (0 - 2/3) / sqrt(1/3). Format [0, 1, 0, 0]: sample 1 vs [0, 0, 0] has no spread -> 1 - 0
    # unscaled; the others vs e.g. [1, 0, 0] -> (0 - 1/3) / sqrt(1/3).
    s = math.sqrt(1 / 3)
    correctness = [(2 / 3) / s, (-2 / 3) / s, (2 / 3) / s, (-2 / 3) / s, 0, 0, 0, 0]
    fmt = [(-1 / 3) / s, 1.0, (-1 / 3) / s, (-1 / 3) / s, 1.0, (-1 / 3) / s, (-1 / 3) / s, (-1 / 3) / s]
    assert adv[:, 0].tolist() == pytest.approx(whiten([c + f for c, f in zip(correctness, fmt)]), rel=1e-12)
    raw = gdpo_advantages(GDPO_REWARDS, GDPO_GROUPS, GDPO_MASK, normalize_rewards=False)
    centred = [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0]
    fmt_centred = [-0.25, 0.75, -0.25, -0.25, 0.75, -0.25, -0.25, -0.25]
    # the batch whitening runs without normalize_rewards too
    assert raw[:, 0].tolist() == pytest.approx(whiten([c + f for c, f in zip(centred, fmt_centred)]), rel=1e-12)


def test_gdpo_edge_cases_and_errors() -> None:
    # every group without spread: all advantages exactly 0 (no NaN); a group of one gets 0
    flat = {"reward/a": torch.tensor([1.0, 1.0, 2.0]), "reward/b": torch.tensor([0.0, 0.0, 5.0])}
    adv = gdpo_advantages(flat, torch.tensor([0, 0, 1]), torch.ones(3, 1))
    assert adv.tolist() == [[0.0], [0.0], [0.0]]
    assert adv.dtype == torch.float32
    # complementary components (format = 1 - correctness) cancel: exactly 0, not whitened noise
    complementary = {"reward/a": torch.tensor([1.0, 0.0, 0.0, 0.0]), "reward/b": torch.tensor([0.0, 1.0, 1.0, 1.0])}
    assert gdpo_advantages(complementary, torch.zeros(4, dtype=torch.long), torch.ones(4, 1)).tolist() == [[0.0]] * 4
    # masked-out tokens get 0
    adv = gdpo_advantages(GDPO_REWARDS, GDPO_GROUPS, torch.tensor([[1, 0]] * 8))
    assert torch.all(adv[:, 1] == 0) and torch.all(adv[:, 0] != 0)
    with pytest.raises(ValueError, match="two or more reward components"):
        gdpo_advantages({"reward/a": torch.ones(2)}, torch.tensor([0, 0]), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"3 weights but the rewards have 2 components \['reward/correctness', 'reward/format'\]"):
        gdpo_advantages(GDPO_REWARDS, GDPO_GROUPS, GDPO_MASK, reward_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="reward/format"):
        gdpo_advantages(
            {"reward/correctness": torch.ones(8), "reward/format": torch.ones(7)}, GDPO_GROUPS, GDPO_MASK
        )
