"""A step's per-sample training fields, from the rollout carry: GRPO advantages and the
loss's sample mask ``[B]``."""

from __future__ import annotations

import torch

from nemo_rl.algorithms.advantage_estimators import grpo_advantages, group_reward_std
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.experience.grouped_rollouts import RolloutCarry


def advantage_fields(
    carry: RolloutCarry, grpo_cfg: GRPOConfig
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-sample ``advantages`` and ``sample_mask`` ``[B]`` float32 of a step.

    ``advantages`` is the value :func:`grpo_advantages` puts on every loss token of the sample
    (the policy's batch holds it on every token of ``token_mask``).

    Returns:
        ``(fields, metrics)``; metrics: ``fraction_of_zero_std_groups`` and, with overlong
        filtering, ``overlong_filtered_fraction``.
    """
    rewards, group_ids = carry.rewards, carry.group_ids
    advantages = grpo_advantages(
        rewards,
        group_ids,
        torch.ones(carry.size, 1),
        use_leave_one_out_baseline=grpo_cfg.use_leave_one_out_baseline,
        normalize_rewards=grpo_cfg.normalize_rewards,
    )[:, 0]
    sample_mask, metrics = loss_sample_mask(
        carry.loss_multiplier, carry.truncated | carry.response_truncated, grpo_cfg
    )
    metrics["fraction_of_zero_std_groups"] = zero_std_group_fraction(rewards, group_ids)
    return {"advantages": advantages, "sample_mask": sample_mask}, metrics


def loss_sample_mask(
    loss_multiplier: torch.Tensor, overlong: torch.Tensor, grpo_cfg: GRPOConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B]`` float sample mask of the loss: ``loss_multiplier``, times 0 for ``overlong``
    rows (cut by a token limit) when ``grpo_cfg.overlong_filtering``; with the filter, the
    metric ``overlong_filtered_fraction``."""
    sample_mask = loss_multiplier.float()
    if not grpo_cfg.overlong_filtering:
        return sample_mask, {}
    return sample_mask * (~overlong).float(), {
        "overlong_filtered_fraction": float(overlong.float().mean())
    }


def zero_std_group_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of prompt groups whose responses all got the same reward."""
    has_variance = group_reward_std(rewards, group_ids) > 0
    groups = torch.unique(group_ids)
    with_variance = torch.unique(group_ids[has_variance])
    return 1.0 - with_variance.numel() / groups.numel()
