"""A step's per-sample training fields, from the rollout carry: the advantages of
``grpo.adv_estimator`` and the loss's sample mask ``[B]``."""

from __future__ import annotations

import torch

from nemo_rl.algorithms.advantage_estimators import (
    grpo_advantages,
    group_reward_std,
    reinforce_plus_plus_advantages,
)
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.experience.grouped_rollouts import RolloutCarry


def advantage_fields(
    carry: RolloutCarry, grpo_cfg: GRPOConfig
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-sample ``advantages`` and ``sample_mask`` ``[B]`` float32 of a step.

    ``advantages`` is the value the estimator (``grpo_cfg.adv_estimator``) puts on every loss
    token of the sample (the policy's batch holds it on every token of ``token_mask``): with no
    KL term in the reward, every estimator here gives one value per sample.

    Returns:
        ``(fields, metrics)``; metrics: ``fraction_of_zero_std_groups`` and, with overlong
        filtering, ``overlong_filtered_fraction``.
    """
    rewards, group_ids = carry.rewards, carry.group_ids
    sample_mask, metrics = loss_sample_mask(
        carry.loss_multiplier, carry.truncated | carry.response_truncated, grpo_cfg
    )
    est = grpo_cfg.adv_estimator
    if est.name == "reinforce_plus_plus":
        # whitened over the loss's tokens: each sample weighs its response tokens
        tokens = carry.response_tokens * (sample_mask > 0)
        width = max(int(tokens.max()), 1)
        token_mask = (torch.arange(width)[None, :] < tokens[:, None]).float()
        per_token = reinforce_plus_plus_advantages(
            rewards, token_mask, group_ids=group_ids if est.minus_baseline else None
        )
        advantages = per_token[:, 0]
    else:
        advantages = grpo_advantages(
            rewards,
            group_ids,
            torch.ones(carry.size, 1),
            use_leave_one_out_baseline=bool(est.use_leave_one_out_baseline),
            normalize_rewards=bool(est.normalize_rewards),
        )[:, 0]
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
