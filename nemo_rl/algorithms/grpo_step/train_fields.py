"""A step's training fields, from the rollout carry: the advantages of
``grpo.adv_estimator``, the loss's sample mask ``[B]`` and, for VAPO's NLL, the rewards
(:func:`train_fields`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.algorithms.advantage_estimators import (
    gdpo_advantages,
    grpo_advantages,
    group_reward_std,
    reinforce_plus_plus_advantages,
)
from nemo_rl.algorithms.grpo_config import GRPOConfig, GRPOMasterConfig
from nemo_rl.experience.grouped_rollouts import RolloutCarry
from nemo_rl.utils.errors import InputError


class RewardComponentsError(InputError, ValueError):
    """GDPO's rewards do not fit it: too few components, a sample without them, or
    ``reward_weights`` of another length."""


@dataclass(frozen=True)
class RewardKL:
    """The per-token KL penalty REINFORCE++ subtracts from the reward
    (``loss_fn.use_kl_in_reward``): ``coef`` times the ``kl_type`` estimate on
    ``logprobs - reference_logprobs``, ``[B, S]`` each, on ``token_mask`` ``[B, S]``."""

    logprobs: torch.Tensor
    reference_logprobs: torch.Tensor
    token_mask: torch.Tensor
    coef: float
    kl_type: str


def train_fields(
    carry: RolloutCarry, cfg: GRPOMasterConfig, batch: Any
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """What the step adds to its training batch after the logprob passes: the fields of
    :func:`advantage_fields` (per token with ``loss_fn.use_kl_in_reward``, from ``batch``'s
    ``prev_logprobs``, ``reference_policy_logprobs`` and ``token_mask``: a driver-side
    batch) and, with ``loss_fn.positive_example_nll_weight > 0``, ``rewards`` ``[B]`` float32
    (VAPO's NLL trains on the samples with reward > 0)."""
    loss = cfg.loss_fn
    reward_kl = None
    if loss.use_kl_in_reward and loss.reference_policy_kl_penalty != 0:
        reward_kl = RewardKL(
            batch["prev_logprobs"],
            batch["reference_policy_logprobs"],
            batch["token_mask"].float(),
            loss.reference_policy_kl_penalty,
            loss.reference_policy_kl_type,
        )
    fields, metrics = advantage_fields(carry, cfg.grpo, reward_kl)
    if loss.positive_example_nll_weight > 0:
        fields["rewards"] = carry.rewards.float()
    return fields, metrics


def advantage_fields(
    carry: RolloutCarry, grpo_cfg: GRPOConfig, reward_kl: RewardKL | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``advantages`` and ``sample_mask`` ``[B]`` float32 of a step.

    ``advantages`` is the value the estimator (``grpo_cfg.adv_estimator``) puts on every loss
    token of the sample (the policy's batch holds it on every token of ``token_mask``): with no
    KL term in the reward, every estimator here gives one value per sample. With
    ``reward_kl`` (REINFORCE++ only) they differ per token: ``advantages`` is ``[B, S]``,
    0 outside ``reward_kl.token_mask`` and on masked-out samples.

    Returns:
        ``(fields, metrics)``; metrics: ``fraction_of_zero_std_groups`` (of the total
        reward), ``reward/<name>`` (mean of each named reward, when environments return
        several) and, with overlong filtering, ``overlong_filtered_fraction``.

    Raises:
        RewardComponentsError: gdpo on rewards that do not fit it (:func:`gdpo_step_advantages`).
    """
    rewards, group_ids = carry.rewards, carry.group_ids
    sample_mask, metrics = loss_sample_mask(
        carry.loss_multiplier, carry.truncated | carry.response_truncated, grpo_cfg
    )
    est = grpo_cfg.adv_estimator
    baseline_groups = group_ids if est.minus_baseline else None
    if est.name == "reinforce_plus_plus" and reward_kl is not None:
        # whitened over the loss's tokens, each with its own KL
        advantages = reinforce_plus_plus_advantages(
            rewards.double(),
            reward_kl.token_mask * (sample_mask > 0)[:, None],
            logprobs=reward_kl.logprobs,
            reference_logprobs=reward_kl.reference_logprobs,
            kl_coef=reward_kl.coef,
            kl_type=reward_kl.kl_type,
            group_ids=baseline_groups,
        ).float()
    elif est.name == "gdpo":
        advantages = gdpo_step_advantages(carry, grpo_cfg)
    elif est.name == "reinforce_plus_plus":
        # whitened over the loss's tokens: each sample weighs its response tokens
        tokens = carry.response_tokens * (sample_mask > 0)
        width = max(int(tokens.max()), 1)
        token_mask = (torch.arange(width)[None, :] < tokens[:, None]).float()
        per_token = reinforce_plus_plus_advantages(rewards, token_mask, group_ids=baseline_groups)
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
    for name, values in carry.reward_components.items():
        metrics[name] = float(values.mean())
    return {"advantages": advantages, "sample_mask": sample_mask}, metrics


def gdpo_step_advantages(carry: RolloutCarry, grpo_cfg: GRPOConfig) -> torch.Tensor:
    """``[B]`` float32 GDPO advantages of the carry's named rewards
    (:func:`~nemo_rl.algorithms.advantage_estimators.gdpo_advantages`).

    Raises:
        RewardComponentsError: fewer than two named rewards, a sample whose total reward is not
            the sum of its named rewards (its environment returned one reward), or
            ``reward_weights`` of another length than the rewards.
    """
    est = grpo_cfg.adv_estimator
    components = carry.reward_components
    names = sorted(components)
    if len(names) < 2:
        raise RewardComponentsError(
            f"grpo.adv_estimator.name=gdpo needs two or more rewards per sample, but this "
            f"step's environments returned {names or 'one reward'}; return "
            "{'reward/<name>': tensor, ...} from the environment's step (or give a reward_fn "
            "task several reward_fns), or use grpo.adv_estimator.name=grpo"
        )
    summed = torch.stack([components[name] for name in names]).sum(0)
    unsplit = torch.nonzero(~torch.isclose(summed, carry.rewards, atol=1e-5)).flatten()
    if unsplit.numel():
        row = int(unsplit[0])
        raise RewardComponentsError(
            f"grpo.adv_estimator.name=gdpo: {unsplit.numel()} of this step's samples have a "
            f"total reward that is not the sum of their named rewards {names} (sample {row}: "
            f"{float(carry.rewards[row]):g} vs {float(summed[row]):g}): their environment "
            "returned a single reward; every training task's environment must return the same "
            "named rewards"
        )
    if est.reward_weights is not None and len(est.reward_weights) != len(names):
        raise RewardComponentsError(
            f"grpo.adv_estimator.reward_weights has {len(est.reward_weights)} weights but the "
            f"environments return {len(names)} rewards {names}; give one weight per reward, in "
            "that (sorted) order"
        )
    return gdpo_advantages(
        components,
        carry.group_ids,
        torch.ones(carry.size, 1),
        use_leave_one_out_baseline=bool(est.use_leave_one_out_baseline),
        normalize_rewards=bool(est.normalize_rewards),
        reward_weights=est.reward_weights,
    )[:, 0]


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
