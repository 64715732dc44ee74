"""One GRPO step, phase by phase, over a :class:`~.interfaces.BatchStore`.

:func:`grpo_step`:

1. **generate**: ``num_prompts_per_step`` prompts, each rolled out
   ``num_generations_per_prompt`` times (a group) after the engines took the latest weights;
   the environments score every response during the rollout. With dynamic sampling, groups
   whose responses all scored the same are dropped and further prompts rolled out until
   ``num_prompts_per_step`` groups remain (:func:`sample_groups_with_variance`). A run
   whose environments fail on most samples step after step stops here
   (:func:`~.env_errors.check_env_errors`).
2. **logprobs**: the policy's before the update (``prev_logprobs``) and, with a KL penalty, the
   reference policy's. With ``loss_fn.force_on_policy_ratio`` (one optimizer step per
   rollout: the weights that generated are the ones trained) the loss takes the ratio from
   the training forward itself and the policy's pass is skipped.
3. **advantages**: per group (:func:`~nemo_rl.algorithms.advantage_estimators.grpo_advantages`,
   or ``grpo.adv_estimator``'s); with ``loss_fn.use_kl_in_reward`` REINFORCE++'s per token,
   the KL of step 2's logprobs subtracted from the reward; with overlong filtering, responses
   cut by a token limit leave the loss; with VAPO's NLL the rewards join the batch
   (:func:`~.train_fields.train_fields`).
4. **train**: ``policy.train`` with the run's loss.
5. **refit**: the engines are marked stale; they take the new weights before their next
   generation (a step's rollout, or a validation).

A vLLM engine that dies during the step is restarted, refit, and the generation batch it broke
is redone from the same sampling step (:mod:`~.engine_recovery`); the step logs the restarts
as ``generation/engine_restarts``; the environments' own counts since the previous step
(:func:`~nemo_rl.environments.utils.environment_metrics`) are logged as ``env/<task>/<name>``.

The store decides where the samples live (driver memory or the data plane); the step sees
handles, a :class:`~nemo_rl.experience.grouped_rollouts.RolloutCarry` and metrics. A
:class:`RolloutSource` decides where phase 1's batch comes from and what phase 5 does:
:class:`SyncRollouts` (generate now, mark the engines stale) or, with
``grpo.async_grpo.enabled``, :class:`~.async_grpo.AsyncRollouts` (take a batch generated
ahead from the replay buffer, publish the new weights version to the collector).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol, TypeVar

import torch

from nemo_rl.algorithms.advantage_estimators import group_reward_std
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.algorithms.grpo_step.components import (
    GRPOComponents,
    prepare_generation,
    uses_reference_policy,
)
from nemo_rl.algorithms.grpo_step.engine_recovery import redo_on_engine_death
from nemo_rl.algorithms.grpo_step.env_errors import check_env_errors
from nemo_rl.algorithms.grpo_step.interfaces import BatchStore
from nemo_rl.algorithms.grpo_step.metrics import (
    merge_rollout_metrics,
    step_metrics,
    validation_metrics,
)
from nemo_rl.algorithms.grpo_step.train_fields import train_fields
from nemo_rl.algorithms.rollout_run import RolloutComponents
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.utils import environment_metrics, tasks_with_metrics
from nemo_rl.experience.grouped_rollouts import RolloutCarry

GroupsT = TypeVar("GroupsT")


class RolloutSource(Protocol):
    """Where a step's rollouts come from, and how the engines learn of the new weights."""

    def take(
        self, components: GRPOComponents, store: BatchStore[Any], batches: Iterator[BatchedDataDict]
    ) -> tuple[Any, RolloutCarry, dict[str, float]]:
        """The step's ``(batch, carry, metrics)`` of ``num_prompts_per_step`` groups."""

    def training(self, components: GRPOComponents) -> AbstractContextManager[None]:
        """Wraps the step's policy phases (logprobs, train); the new weights are published
        when it exits."""


class SyncRollouts:
    """The synchronous loop's source: generate the step's groups now
    (:func:`generate`); after training, the engines are stale and refit before their next
    generation."""

    def take(
        self, components: GRPOComponents, store: BatchStore[Any], batches: Iterator[BatchedDataDict]
    ) -> tuple[Any, RolloutCarry, dict[str, float]]:
        return generate(components, store, batches)

    @contextmanager
    def training(self, components: GRPOComponents) -> Iterator[None]:
        yield
        components.generation_stale = True


def grpo_step(
    components: GRPOComponents,
    store: BatchStore[Any],
    batches: Iterator[BatchedDataDict],
    source: RolloutSource | None = None,
) -> dict[str, float]:
    """One GRPO step on prompts from ``batches`` (collated DatumSpec rows; one batch, or
    several with dynamic sampling) with the rollouts of ``source`` (None:
    :class:`SyncRollouts`); returns its metrics (see the module docstring)."""
    cfg, timer, policy = components.cfg, components.timer, components.policy
    source = source if source is not None else SyncRollouts()
    group_size = cfg.grpo.num_generations_per_prompt
    with store.scope("train", cfg.grpo.num_prompts_per_step * group_size, group_size):
        # generate: rollouts, scored by the environments as they go (or generated ahead)
        batch, carry, sampling_metrics = source.take(components, store, batches)
        components.env_error_streak = check_env_errors(
            carry, cfg.grpo, components.env_error_streak
        )

        with source.training(components):
            # logprobs: the policy's before the update, the reference policy's for the KL
            # penalty
            policy.prepare_for_training()
            if not cfg.loss_fn.force_on_policy_ratio:
                with timer.time("policy_logprobs"):
                    batch = store.logprobs(batch)
            if uses_reference_policy(cfg):
                with timer.time("reference_logprobs"):
                    batch = store.logprobs(batch, reference=True)

            # advantages (per token with the KL in the reward), the loss's sample mask and
            # rewards
            with timer.time("data_processing"):
                fields, data_metrics = train_fields(carry, cfg, batch)
                batch = store.add_fields(batch, fields)
            data_metrics.update(sampling_metrics)

            # train
            with timer.time("policy_training"):
                train_results = store.train(batch, components.loss_fn)
            policy.finish_training()
        # refit: published by the source as it exits (the engines take the new weights
        # before their next generation)
        store.release(batch)
    metrics = step_metrics(carry.metrics, train_results, data_metrics)
    restarts = sum(components.generation.engine_restarts)
    metrics["generation/engine_restarts"] = float(restarts - components.engine_restarts_logged)
    components.engine_restarts_logged = restarts
    tasks = tasks_with_metrics(cfg.env)
    metrics.update(environment_metrics(components.task_to_env, tasks))
    return metrics


def generate(
    components: GRPOComponents, store: BatchStore[Any], batches: Iterator[BatchedDataDict]
) -> tuple[Any, RolloutCarry, dict[str, float]]:
    """The step's rolled-out groups: one generation batch, or with dynamic sampling as many
    as it takes (:func:`sample_groups_with_variance`).

    Returns:
        ``(batch, carry, sampling_metrics)``; sampling metrics only with dynamic sampling.
    """
    if components.cfg.grpo.use_dynamic_sampling:
        return sample_groups_with_variance(components, store, batches)
    batch, carry = rollout_groups(components, store, next(batches))
    return batch, carry, {}


def rollout_groups(
    components: RolloutComponents, store: BatchStore[Any], prompts: BatchedDataDict
) -> tuple[Any, RolloutCarry]:
    """Refit if stale, then ``num_generations_per_prompt`` responses per prompt into the
    training partition (redone if an engine died under it); the handle and the carry."""

    def attempt() -> tuple[Any, RolloutCarry]:
        with components.timer.time("refit"):
            prepare_generation(components)
        with components.timer.time("generation"):
            return generate_groups(components, store, prompts)

    return redo_on_engine_death(components, attempt)


def generate_groups(
    components: RolloutComponents, store: BatchStore[Any], prompts: BatchedDataDict
) -> tuple[Any, RolloutCarry]:
    """``num_generations_per_prompt`` responses per prompt into the training partition, on
    engines already awake with the weights wanted; the engines are put to sleep after."""
    out = store.rollout(
        prompts,
        num_generations=components.cfg.loop.num_generations_per_prompt,
        partition="train",
        greedy=False,
    )
    components.generation.finish_generation()
    return out


def collect_groups_with_variance(
    roll_out: Callable[[], tuple[GroupsT, torch.Tensor, torch.Tensor]],
    keep_rows: Callable[[GroupsT, torch.Tensor], GroupsT],
    grpo_cfg: GRPOConfig,
) -> tuple[list[GroupsT], torch.Tensor, torch.Tensor, dict[str, float]]:
    """The loop of dynamic sampling, whatever holds a generation batch.

    Args:
        roll_out: rolls out the next generation batch: ``(batch, group_ids [B], rewards [B])``.
        keep_rows: ``batch`` restricted to the given ``[n]`` row indices (the rows of groups
            with reward variance).
        grpo_cfg: ``num_prompts_per_step`` and ``dynamic_sampling_max_gen_batches``.

    Returns:
        ``(kept, group_ids, keep, sampling_metrics)``: the restricted batches in order;
        ``[N]`` group ids of their rows (N rows in all), renumbered 0.. in order; ``[N]`` bool,
        the rows of the first ``num_prompts_per_step`` groups (the rest is surplus); and
        ``dynamic_sampling_num_gen_batches``, ``dynamic_sampling_num_discarded_valid_samples``.

    Raises:
        RuntimeError: fewer groups with variance than needed after
            ``grpo.dynamic_sampling_max_gen_batches`` generation batches.
    """
    needed = grpo_cfg.num_prompts_per_step
    kept: list[GroupsT] = []
    kept_groups: list[torch.Tensor] = []
    num_kept = 0
    for num_gen_batches in range(1, grpo_cfg.dynamic_sampling_max_gen_batches + 1):
        batch, group_ids, rewards = roll_out()
        rows = torch.nonzero(group_reward_std(rewards.float(), group_ids) > 0).flatten()
        kept.append(keep_rows(batch, rows))
        kept_groups.append(group_ids[rows] + num_gen_batches * len(group_ids))
        num_kept += len(torch.unique(group_ids[rows]))
        if num_kept >= needed:
            break
    else:
        raise RuntimeError(
            f"dynamic sampling found {num_kept} of the {needed} prompt groups with reward "
            f"variance it needs after grpo.dynamic_sampling_max_gen_batches="
            f"{grpo_cfg.dynamic_sampling_max_gen_batches} generation batches; raise "
            "grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, raise "
            "grpo.num_generations_per_prompt, or use prompts of a difficulty where the "
            "policy's responses differ in reward"
        )
    _, group_ids = torch.unique(torch.cat(kept_groups), return_inverse=True)
    keep = group_ids < needed
    sampling_metrics = {
        "dynamic_sampling_num_gen_batches": float(num_gen_batches),
        "dynamic_sampling_num_discarded_valid_samples": float((~keep).sum()),
    }
    return kept, group_ids, keep, sampling_metrics


def sample_groups_with_variance(
    components: GRPOComponents, store: BatchStore[Any], batches: Iterator[BatchedDataDict]
) -> tuple[Any, RolloutCarry, dict[str, float]]:
    """Dynamic sampling: roll out generation batches until ``num_prompts_per_step`` prompt
    groups whose rewards differ are collected (:func:`collect_groups_with_variance`); groups
    with one reward for all responses leave the store at once, surplus groups of the last
    batch too.

    Returns:
        ``(batch, carry, sampling_metrics)`` of exactly ``num_prompts_per_step`` groups (the
        carry's group ids renumbered 0..n-1, its metrics merged over the generation batches).

    Raises:
        RuntimeError: too few groups with reward variance (see
            :func:`collect_groups_with_variance`).
    """

    def roll_out() -> tuple[tuple[Any, RolloutCarry], torch.Tensor, torch.Tensor]:
        batch, carry = rollout_groups(components, store, next(batches))
        return (batch, carry), carry.group_ids, carry.rewards

    def keep_rows(
        groups: tuple[Any, RolloutCarry], rows: torch.Tensor
    ) -> tuple[Any, RolloutCarry]:
        batch, carry = groups
        return store.keep([batch], rows), carry.select(rows)

    kept, group_ids, keep, sampling_metrics = collect_groups_with_variance(
        roll_out, keep_rows, components.cfg.grpo
    )
    carries = [carry for _, carry in kept]
    carry = RolloutCarry.concat(carries, merge_rollout_metrics([c.metrics for c in carries]))
    rows = torch.nonzero(keep).flatten()
    batch = store.keep([batch for batch, _ in kept], rows)
    carry = dataclasses.replace(carry.select(rows), group_ids=group_ids[keep])
    return batch, carry, sampling_metrics


def validate(components: RolloutComponents, store: BatchStore[Any]) -> dict[str, float]:
    """Rollouts of the validation prompts, sampled like training (greedy with the loop
    section's ``val_greedy``), one batch at a time through the validation partition (a batch
    an engine died under is redone); mean reward (= accuracy for 0/1 rewards)."""
    rewards, lengths = [], []
    for prompts in components.val_batches:

        def attempt(prompts: BatchedDataDict = prompts) -> RolloutCarry:
            prepare_generation(components)
            with store.scope("val", len(prompts["message_log"]), 1):
                batch, carry = store.rollout(
                    prompts, num_generations=1, partition="val",
                    greedy=components.cfg.loop.val_greedy,
                )
                store.release(batch)
            return carry

        carry = redo_on_engine_death(components, attempt)
        rewards.append(carry.rewards)
        lengths.append(carry.metrics["mean_generated_tokens_per_sample"])
    components.generation.finish_generation()
    return validation_metrics(rewards, lengths)
