"""Advantage estimators for outcome-reward RL: GRPO, RLOO, GDPO, REINFORCE++ and PPO's GAE.

Inputs are per-sample rewards [B] (one scalar per response), group ids [B] (responses to the
same prompt share an id) and a token mask [B, S] (1 on the response tokens the loss trains on).
Each estimator returns advantages [B, S] that are 0 outside the mask.

The semantics are NeMo RL's (``grpo.adv_estimator``), so a recipe gives the same advantages
in both. GRPO's group standard deviations are sample standard deviations (Bessel's correction,
n - 1; with a leave-one-out baseline, of the other members, one per sample); groups with a single member or zero spread get advantage 0 (never NaN). GDPO takes
several named rewards per sample (``reward/<name>`` components), normalises each within its
group, sums them with weights and whitens the sum over the batch. REINFORCE++ whitens over the
batch's tokens with the population variance. GAE (``ppo.adv_estimator``) bootstraps from a
critic's per-token values and whitens with the sample variance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nemo_rl.algorithms.loss._common import KL_TYPES, check_tensor, kl_estimate


def _check_inputs(rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor | None) -> torch.Tensor:
    """Validate shapes/dtypes; return ``mask`` as the rewards' dtype."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        got = list(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"'rewards' must be a tensor of shape [batch], got {got}")
    check_tensor(rewards, "rewards", rewards.shape, "[batch]", floating=True)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"'mask' must be a tensor of shape [batch, seq] with batch={rewards.shape[0]}, got {got}")
    check_tensor(mask, "mask", (rewards.shape[0], mask.shape[1]), "[batch, seq]", floating=False)
    if group_ids is not None:
        check_tensor(group_ids, "group_ids", rewards.shape, "[batch]", floating=False)
        if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
            raise ValueError(f"'group_ids' must be an integer tensor, got dtype {group_ids.dtype}")
    return mask.to(rewards.dtype)


def _group_statistics(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size, group reward sum, group sample std), each [B]."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sizes = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    sums = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, rewards)
    means = sums / sizes
    squares = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, (rewards - means[inverse]).square())
    stds = torch.where(sizes > 1, squares / (sizes - 1).clamp_min(1), torch.zeros_like(squares)).sqrt()
    return sizes[inverse], sums[inverse], stds[inverse]


def group_reward_std(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[B]`` sample standard deviation of the rewards of each row's group (0 for a group of
    one). Rows of a group whose responses all scored the same get 0: they carry no GRPO signal."""
    return _group_statistics(rewards, group_ids)[2]


def _group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    epsilon: float,
) -> torch.Tensor:
    """``[B]`` float64 advantage of one reward (or reward component), group by group, as NeMo RL
    computes it for GRPO and for each GDPO component.

    Baseline: the group mean, or with ``use_leave_one_out_baseline`` the mean of the other
    members. Scale (``normalize_rewards``): the sample std (n - 1) of the same values the
    baseline averages (with leave-one-out, the other members: a per-sample std), plus
    ``epsilon``; where those values have no spread the centred reward is kept unscaled. A group
    of one gets 0.
    """
    values = rewards.double()
    advantages = torch.zeros_like(values)
    for group in torch.unique(group_ids):
        rows = torch.nonzero(group_ids == group).flatten()
        x = values[rows]
        n = x.numel()
        if n < 2:
            continue
        if use_leave_one_out_baseline:
            others = ~torch.eye(n, dtype=torch.bool)  # row i: the members but i
        else:
            others = torch.ones(n, n, dtype=torch.bool)
        count = others.sum(1).double()
        members = x[None, :].expand(n, n)
        baseline = (members * others).sum(1) / count
        centred = x - baseline
        if normalize_rewards:
            deviations = torch.where(others, members - baseline[:, None], 0.0)
            std = (deviations.square().sum(1) / (count - 1).clamp_min(1)).sqrt()
            high = torch.where(others, members, -torch.inf).amax(1)
            low = torch.where(others, members, torch.inf).amin(1)
            spread = (high > low) & (count > 1)
            centred = torch.where(spread, centred / (std + epsilon), centred)
        if not bool(x.amax() > x.amin()):
            centred = torch.zeros_like(centred)  # all equal: exactly 0, not rounding noise
        advantages[rows] = centred
    return advantages


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    use_leave_one_out_baseline: bool = False,
    normalize_rewards: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: reward minus the group baseline, optionally divided by the group std.

    Args:
        rewards: [B] float, one reward per response.
        group_ids: [B] int, responses to the same prompt share an id.
        mask: [B, S], 1 on the tokens that receive the advantage.
        use_leave_one_out_baseline: baseline = mean of the *other* members of the group
            (a single-member group gets advantage 0); otherwise the group mean.
        normalize_rewards: divide by the sample std (n - 1) of the values the baseline
            averages, + ``epsilon``: the group's std, or with ``use_leave_one_out_baseline`` the
            std of the other members (one per sample, NeMo RL's rule). Where those values have
            no spread the centred reward is kept unscaled (a group whose rewards are all equal
            gets 0 either way).
        epsilon: added to the std in the division.

    Returns:
        [B, S] advantages, the sample's value on its masked tokens and 0 elsewhere.
    """
    token_mask = _check_inputs(rewards, mask, group_ids)
    advantages = _group_advantages(rewards, group_ids, use_leave_one_out_baseline, normalize_rewards, epsilon)
    return advantages.to(rewards.dtype)[:, None] * token_mask


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RLOO advantages: reward minus the mean reward of the other responses to the same prompt.

    Same inputs and output as :func:`grpo_advantages`; no std normalisation. Unbiased because
    the baseline does not depend on the sample's own reward.
    """
    return grpo_advantages(rewards, group_ids, mask, use_leave_one_out_baseline=True, normalize_rewards=False)


# Relative size below which GDPO's combined advantages are rounding noise of cancelling terms.
_CANCELLATION_TOLERANCE = 1e-12


def gdpo_advantages(
    reward_components: Mapping[str, torch.Tensor],
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    use_leave_one_out_baseline: bool = False,
    normalize_rewards: bool = True,
    reward_weights: Sequence[float] | None = None,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GDPO advantages (``grpo.adv_estimator.name: gdpo``): each reward component normalised
    within its group, the weighted sum of those, whitened over the batch.

    Per component ``n`` (taken in sorted name order): ``A_n = (r_n - baseline) / (std +
    epsilon)`` within the group, where baseline is the group mean (or, with
    ``use_leave_one_out_baseline``, the mean of the other members) and std the sample std of
    the same values; a sample whose baseline values have no spread keeps ``r_n - baseline``
    unscaled, and a group of one gets 0. Then ``A = sum_n w_n A_n`` (``w_n = 1`` without
    ``reward_weights``) and ``(A - mean(A)) / std(A)`` over all ``B`` samples (sample std; 0
    when that std is 0 or float64 rounding noise of components that cancel exactly). The batch
    whitening always runs; ``normalize_rewards`` only gates the per-component division.
    Computed in float64: NeMo RL's float32 arithmetic agrees to ~1e-6
    except where its rounding dominates (near-cancelling components, rewards whose spread is
    tiny next to their size).

    Args:
        reward_components: ``{"reward/<name>": [B] float}``, at least two.
        group_ids: [B] int, responses to the same prompt share an id.
        mask: [B, S], 1 on the tokens that receive the advantage.
        use_leave_one_out_baseline: baseline and std over the other members of the group.
        normalize_rewards: divide each component by its group std + ``epsilon``.
        reward_weights: one weight per component in the sorted order of the names; None: 1.
        epsilon: added to each component's group std in the division.

    Returns:
        [B, S] advantages in the components' dtype, the sample's value on its masked tokens
        and 0 elsewhere.

    Raises:
        ValueError: fewer than two components, components of different shapes, or
            ``reward_weights`` of another length than the components.
    """
    names = sorted(reward_components)
    if len(names) < 2:
        raise ValueError(
            f"GDPO needs two or more reward components (reward/<name>), got {names}; use "
            "grpo.adv_estimator.name=grpo for a single reward"
        )
    first = reward_components[names[0]]
    token_mask = _check_inputs(first, mask, group_ids)
    for name in names[1:]:
        check_tensor(reward_components[name], name, first.shape, "[batch]", floating=True)
    weights = [1.0] * len(names) if reward_weights is None else list(reward_weights)
    if len(weights) != len(names):
        raise ValueError(
            f"grpo.adv_estimator.reward_weights has {len(weights)} weights but the rewards have "
            f"{len(names)} components {names}; give one weight per component, in that (sorted) "
            "order"
        )
    terms = [
        weight
        * _group_advantages(
            reward_components[name], group_ids, use_leave_one_out_baseline, normalize_rewards, epsilon
        )
        for weight, name in zip(weights, names)
    ]
    combined = torch.stack(terms).sum(0)
    centred = combined - combined.mean()
    spread = combined.std() if combined.numel() > 1 else torch.zeros((), dtype=combined.dtype)
    # Components that cancel exactly leave float64 rounding noise (~1e-16 of the terms' size),
    # which the whitening would blow up to unit scale: such a sum counts as no spread.
    noise = _CANCELLATION_TOLERANCE * float(torch.stack(terms).abs().amax())
    centred = centred / spread if spread > noise else torch.zeros_like(centred)
    return centred.to(first.dtype)[:, None] * token_mask


def reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "k3",
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages as NeMo RL computes them (``grpo.adv_estimator.name:
    reinforce_plus_plus``): the sample's reward, minus its group's mean reward when
    ``group_ids`` are given (``minus_baseline``, "REINFORCE++-baseline"), on each of its masked
    tokens, minus ``kl_coef`` times the ``kl_type`` estimate of KL(policy || reference) on that
    token when ``kl_coef`` is not 0 (KL in the reward); then whitened over all masked tokens of
    the batch: ``(a - mean) / sqrt(max(var, 1e-8))`` with the population variance.

    Args:
        rewards: [B] float, one reward per response.
        mask: [B, S], 1 on the tokens that receive an advantage (the loss's tokens).
        logprobs, reference_logprobs: [B, S], needed when ``kl_coef`` is not 0.
        kl_coef: weight of the per-token KL penalty in the reward.
        kl_type: "k1", "k2" or "k3".
        group_ids: [B] int; None: no group baseline.

    Returns:
        [B, S] advantages, 0 outside ``mask``.
    """
    token_mask = _check_inputs(rewards, mask, group_ids)
    batch, seq = token_mask.shape
    if group_ids is not None:
        sizes, sums, _ = _group_statistics(rewards, group_ids)
        rewards = rewards - sums / sizes
    advantages = rewards[:, None].expand(batch, seq)
    if kl_coef != 0.0:
        if kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
        if logprobs is None or reference_logprobs is None:
            raise ValueError("kl_coef != 0 needs 'logprobs' and 'reference_logprobs' of shape [batch, seq]")
        check_tensor(logprobs, "logprobs", (batch, seq), "[batch, seq]", floating=True)
        check_tensor(reference_logprobs, "reference_logprobs", (batch, seq), "[batch, seq]", floating=True)
        kl = kl_estimate(logprobs.to(rewards.dtype), reference_logprobs.to(rewards.dtype), kl_type)
        advantages = advantages - kl_coef * kl
    count = token_mask.sum().clamp_min(1)
    mean = (advantages * token_mask).sum() / count
    variance = ((advantages - mean).square() * token_mask).sum() / count
    return (advantages - mean) * variance.clamp_min(1e-8).rsqrt() * token_mask


def length_adaptive_lambda(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda of each sample (NeMo RL's
    ``ppo.adv_estimator.length_adaptive_alpha``): ``1 - 1 / max(alpha * l, 1)``, ``l`` the
    sample's count of masked tokens, so longer responses bootstrap less.

    Args:
        mask: [B, S], 1 on the response tokens the loss trains on.
        alpha: > 0.

    Returns:
        [B] float32 lambdas in [0, 1).
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = mask.float().sum(dim=1)
    return 1.0 - 1.0 / (alpha * lengths).clamp_min(1.0)


def _gae_recursion(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    token_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> torch.Tensor:
    """``[B, S]`` unwhitened GAE advantages, backwards over the masked positions (unmasked
    ones skipped); ``lam`` a float or ``[B]`` per sample."""
    batch = values.shape[0]
    next_value = values.new_zeros(batch)
    next_advantage = values.new_zeros(batch)
    advantages = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        on = token_mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(on > 0, values[:, t], next_value)
        next_advantage = torch.where(on > 0, advantage, next_advantage)
        advantages[:, t] = next_advantage
    return advantages


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float | torch.Tensor,
    normalize_advantages: bool = True,
    value_lam: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation for outcome rewards, as NeMo RL's PPO computes it
    (``ppo.adv_estimator.name: gae`` with ``gae_gamma`` / ``gae_lambda``, and VAPO's decoupled
    lambdas).

    Each sample's reward is the token reward of its last masked token (0 on the others).
    Backwards over the positions: ``delta_t = r_t + gamma * V_next - V_t`` and
    ``A_t = delta_t + gamma * lam * A_next``, where ``V_next`` / ``A_next`` are the value and
    advantage of the next *masked* position (0 after the last one): unmasked positions (prompt,
    padding, a tool turn between two responses) are skipped, not treated as states. Returns
    are ``A_t + V_t`` with the unwhitened advantages (the critic's targets), computed with
    ``value_lam`` when given (VAPO: the returns' lambda, e.g. 1 for Monte Carlo targets, while
    the policy's advantages use ``lam``). With ``normalize_advantages`` the advantages are then
    whitened over all masked tokens of the batch: ``(A - mean) / sqrt(var + 1e-8)`` with the
    sample variance (n - 1).

    With ``gamma = lam = 1`` every advantage is ``reward - V_t``.

    Args:
        rewards: [B] float, one reward per response.
        values: [B, S] float, the critic's value of each position (``V_t``: the state from
            which token ``t`` is generated).
        mask: [B, S], 1 on the response tokens (the loss's tokens).
        gamma: discount factor per token.
        lam: GAE lambda of the advantages, 0 (one-step TD) to 1 (Monte Carlo); a float or [B]
            per sample (:func:`length_adaptive_lambda`).
        normalize_advantages: whiten the advantages over the batch's masked tokens.
        value_lam: GAE lambda of the returns; None: ``lam``.

    Returns:
        ``(advantages, returns)``, each [B, S] in the rewards' dtype and 0 outside ``mask``.
    """
    token_mask = _check_inputs(rewards, mask, None)
    batch, seq = token_mask.shape
    check_tensor(values, "values", (batch, seq), "[batch, seq]", floating=True)
    if isinstance(lam, torch.Tensor):
        check_tensor(lam, "lam", (batch,), "[batch]", floating=True)
        lam = lam.to(rewards.dtype)
    values = values.to(rewards.dtype)
    has_response = token_mask.any(dim=1)
    last = seq - 1 - token_mask.flip(1).argmax(dim=1)
    token_rewards = torch.zeros_like(values)
    token_rewards[has_response, last[has_response]] = rewards[has_response]
    advantages = _gae_recursion(token_rewards, values, token_mask, gamma, lam)
    value_advantages = advantages
    if value_lam is not None:
        value_advantages = _gae_recursion(token_rewards, values, token_mask, gamma, value_lam)
    returns = (value_advantages + values) * token_mask
    if normalize_advantages:
        count = token_mask.sum()
        mean = (advantages * token_mask).sum() / count.clamp_min(1)
        variance = ((advantages - mean).square() * token_mask).sum() / (count - 1).clamp_min(1)
        advantages = (advantages - mean) * torch.rsqrt(variance + 1e-8)
    return advantages * token_mask, returns
