"""GRPO over the data plane: the driver carries keys, lengths and per-sample scalars only.

Same algorithm, seeds and metrics as :func:`nemo_rl.algorithms.grpo.grpo_train`; what moves
where differs. One step (:func:`grpo_step_sync`):

1. ``policy.prepare_step`` opens the training partition.
2. Refit if stale, then the :class:`~nemo_rl.experience.sync_rollout_actor.SyncRolloutActor`
   rolls the prompts out and writes every sample's training fields to the store; the driver
   gets the :class:`~nemo_rl.data_plane.KVBatchMeta` and a
   :class:`~nemo_rl.experience.sync_rollout_actor.RolloutCarry` (rewards, masks, group ids).
   With dynamic sampling, samples of groups without reward variance and surplus groups are
   dropped from the store (``discard_samples``) as soon as they are known.
3. Advantages and ``sample_mask`` from the carry, written back as per-sample fields.
4. ``prev_logprobs`` and ``reference_policy_logprobs``: workers fetch their shards by key and
   write the results back under the same keys.
5. ``train_from_meta``; then ``finish_step`` leaves the partition empty. A step that fails
   clears its partition before the error propagates.

:func:`grpo_train_sync` is the loop (checkpoints, SFT warm start, validation through the
``val`` partition) for ``data_plane.enabled``; ``components.policy`` must be a
:class:`~nemo_rl.models.policy.tq_policy.TQPolicy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import ray
import torch
from ray.actor import ActorHandle

from nemo_rl.algorithms.advantage_estimators import grpo_advantages
from nemo_rl.algorithms.grpo import (
    GRPOComponents,
    collect_groups_with_variance,
    grpo_train,
    loss_sample_mask,
    merge_rollout_metrics,
    prepare_generation,
    step_metrics,
    validation_metrics,
    zero_std_group_fraction,
)
from nemo_rl.algorithms.grpo_config import GRPOConfig
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.experience.sync_rollout_actor import RolloutCarry, SyncRolloutActor
from nemo_rl.models.policy.tq_policy import VAL_PARTITION_ID, TQPolicy


def start_rollout_actor(components: GRPOComponents) -> ActorHandle:
    """A :class:`SyncRolloutActor` (Ray actor, no CPU reserved: it mostly waits on the
    engines and environments) attached to the policy's data plane."""
    policy = _tq_policy(components)
    cfg = components.cfg
    actor_cls = ray.remote(num_cpus=0)(SyncRolloutActor)
    return actor_cls.remote(
        components.generation,
        components.tokenizer,
        components.task_to_env,
        policy.dp_cfg.model_dump(),
        max_seq_len=cfg.policy.max_total_sequence_length,
        max_rollout_turns=cfg.grpo.max_rollout_turns,
        pad_token_id=components.pad_token_id,
    )


def stop_rollout_actor(actor: ActorHandle) -> None:
    """Close the actor's data-plane client and end it."""
    try:
        ray.get(actor.close.remote(), timeout=60)
    finally:
        kill_actors([actor])


def rollout_to_dataplane(
    components: GRPOComponents,
    actor: ActorHandle,
    prompts: BatchedDataDict,
    partition_id: str,
    num_generations: int,
    greedy: bool = False,
) -> tuple[KVBatchMeta, RolloutCarry]:
    """One rollout by ``actor`` into ``partition_id``; the driver's generation facade
    continues from the actor's sampling step. Refit and waking the engines stay here."""
    generation = components.generation
    meta, carry = ray.get(
        actor.rollout.remote(
            prompts,
            partition_id,
            num_generations=num_generations,
            sampling_step=generation.sampling_step,
            greedy=greedy,
        )
    )
    generation.sampling_step = carry.sampling_step
    return meta, carry


def rollout_groups_sync(
    components: GRPOComponents, actor: ActorHandle, prompts: BatchedDataDict
) -> tuple[KVBatchMeta, RolloutCarry]:
    """Refit if stale, then ``num_generations_per_prompt`` responses per prompt into the
    training partition (the data-plane twin of :func:`grpo.rollout_groups`)."""
    timer, generation = components.timer, components.generation
    with timer.time("refit"):
        prepare_generation(components)
    with timer.time("generation"):
        out = rollout_to_dataplane(
            components,
            actor,
            prompts,
            _tq_policy(components).tq_partition_id,
            components.cfg.grpo.num_generations_per_prompt,
        )
        generation.finish_generation()
    return out


def sample_groups_with_variance_sync(
    components: GRPOComponents, actor: ActorHandle, batches: Iterator[BatchedDataDict]
) -> tuple[KVBatchMeta, RolloutCarry, dict[str, float]]:
    """Dynamic sampling as :func:`grpo.sample_groups_with_variance` decides it; dropped
    samples leave the store at once (``discard_samples``).

    Returns:
        ``(meta, carry, sampling_metrics)`` of exactly ``num_prompts_per_step`` groups (group
        ids renumbered 0..n-1; the carry's metrics merged over the generation batches).

    Raises:
        RuntimeError: too few groups with reward variance after
            ``grpo.dynamic_sampling_max_gen_batches`` generation batches.
    """
    policy = _tq_policy(components)
    partition_id = policy.tq_partition_id

    def roll_out() -> tuple[tuple[KVBatchMeta, RolloutCarry], torch.Tensor, torch.Tensor]:
        meta, carry = rollout_groups_sync(components, actor, next(batches))
        return (meta, carry), carry.group_ids, carry.rewards

    def keep_rows(
        batch: tuple[KVBatchMeta, RolloutCarry], rows: torch.Tensor
    ) -> tuple[KVBatchMeta, RolloutCarry]:
        meta, carry = batch
        dropped = torch.ones(carry.size, dtype=torch.bool)
        dropped[rows] = False
        policy.discard_samples(_keys_at(meta, dropped), partition_id)
        return meta.subset(rows.tolist()), carry.select(rows)

    kept, group_ids, keep, sampling_metrics = collect_groups_with_variance(
        roll_out, keep_rows, components.cfg.grpo
    )
    meta = KVBatchMeta.concat([m for m, _ in kept])
    carries = [c for _, c in kept]
    carry = RolloutCarry.concat(carries, merge_rollout_metrics([c.metrics for c in carries]))
    policy.discard_samples(_keys_at(meta, ~keep), partition_id)
    rows = torch.nonzero(keep).flatten()
    kept_carry = dataclasses.replace(carry.select(rows), group_ids=group_ids[keep])
    return meta.subset(rows.tolist()), kept_carry, sampling_metrics


def train_fields_from_carry(
    carry: RolloutCarry, grpo_cfg: GRPOConfig
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-sample ``advantages`` and ``sample_mask`` ``[B]`` of a step, from the carry.

    ``advantages`` is the value :func:`grpo_advantages` puts on every loss token of the sample
    (the workers expand it over ``token_mask``); ``sample_mask`` and the metrics are those of
    :func:`grpo.build_train_data`.
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


@contextmanager
def cleared_on_error(policy: TQPolicy, partition_id: str) -> Iterator[None]:
    """Clear ``partition_id`` if the body raises (a failed step leaves no samples behind)."""
    try:
        yield
    except BaseException:
        policy.abort_partition(partition_id)
        raise


def grpo_step_sync(
    components: GRPOComponents, actor: ActorHandle, batches: Iterator[BatchedDataDict]
) -> dict[str, float]:
    """One GRPO step through the data plane (see the module docstring); its metrics."""
    cfg, timer = components.cfg, components.timer
    policy = _tq_policy(components)
    group_size = cfg.grpo.num_generations_per_prompt
    policy.prepare_step(cfg.grpo.num_prompts_per_step * group_size, group_size)
    with cleared_on_error(policy, policy.tq_partition_id):
        sampling_metrics: dict[str, float] = {}
        if cfg.grpo.use_dynamic_sampling:
            meta, carry, sampling_metrics = sample_groups_with_variance_sync(
                components, actor, batches
            )
        else:
            meta, carry = rollout_groups_sync(components, actor, next(batches))
        with timer.time("data_processing"):
            fields, data_metrics = train_fields_from_carry(carry, cfg.grpo)
            meta = policy.write_to_dataplane(meta, fields)
        data_metrics.update(sampling_metrics)
        policy.prepare_for_training()
        with timer.time("policy_logprobs"):
            meta = policy.get_logprobs_from_meta(meta, timer=timer)
        if cfg.loss_fn.reference_policy_kl_penalty > 0:
            with timer.time("reference_logprobs"):
                meta = policy.get_reference_policy_logprobs_from_meta(meta, timer=timer)
        with timer.time("policy_training"):
            train_results = policy.train_from_meta(meta, components.loss_fn, timer=timer)
        policy.finish_training()
        components.generation_stale = True
        policy.finish_step(meta)
    return step_metrics(carry.metrics, train_results, data_metrics)


def validate_sync(components: GRPOComponents, actor: ActorHandle) -> dict[str, float]:
    """Rollouts of the validation prompts (greedy with ``grpo.val_greedy``) through the
    validation partition (one batch at a time, emptied after each); the metrics of
    :func:`grpo.validate`."""
    policy = _tq_policy(components)
    partition_id = VAL_PARTITION_ID
    prepare_generation(components)
    rewards, lengths = [], []
    for batch in components.val_batches:
        policy.prepare_val_partition(len(batch["message_log"]), partition_id=partition_id)
        with cleared_on_error(policy, partition_id):
            meta, carry = rollout_to_dataplane(
                components,
                actor,
                batch,
                partition_id,
                num_generations=1,
                greedy=components.cfg.grpo.val_greedy,
            )
            policy.finish_step(meta)
        rewards.append(carry.rewards)
        lengths.append(carry.metrics["mean_generated_tokens_per_sample"])
    components.generation.finish_generation()
    return validation_metrics(rewards, lengths)


def grpo_train_sync(components: GRPOComponents) -> dict[str, float]:
    """:func:`grpo.grpo_train` with the data-plane step and validation (one rollout actor
    for the run).

    Returns:
        The last step's train metrics plus the last validation's (``val_`` prefixed).
    """
    actor = start_rollout_actor(components)
    try:
        return grpo_train(
            components,
            step_fn=lambda c, batches: grpo_step_sync(c, actor, batches),
            validate_fn=lambda c: validate_sync(c, actor),
        )
    finally:
        stop_rollout_actor(actor)


def _tq_policy(components: GRPOComponents) -> TQPolicy:
    policy = components.policy
    if not isinstance(policy, TQPolicy):
        raise TypeError(
            f"the data-plane GRPO loop needs a TQPolicy, got {type(policy).__name__}; build the "
            "run with data_plane.enabled=true"
        )
    return policy


def _keys_at(meta: KVBatchMeta, mask: torch.Tensor) -> list[str]:
    """Keys of the rows where ``mask`` ``[B]`` (bool) is set."""
    return [meta.keys[i] for i in torch.nonzero(mask).flatten().tolist()]
