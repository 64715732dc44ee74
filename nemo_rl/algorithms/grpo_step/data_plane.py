"""DataPlaneBatchStore: the driver carries keys, lengths and per-sample scalars only.

A :class:`~nemo_rl.experience.sync_rollout_actor.SyncRolloutActor` (one per run)
rolls the prompts out and writes every sample's training fields to the store; the driver's
handle is a :class:`~nemo_rl.data_plane.KVBatchMeta`. Per-sample fields the step adds are
written under the same keys; for logprobs and training the policy workers fetch their shards
by key and write logprobs back (:class:`~nemo_rl.models.policy.tq_policy.TQPolicy`).
Training uses the policy's training partition (opened per step, empty after it), validation
its own partition (opened and emptied per batch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import ray
import torch

from nemo_rl.algorithms.grpo_step.interfaces import BatchStore, Partition
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.distributed.worker_faults import WorkerTimeout
from nemo_rl.experience.sync_rollout_actor import SyncRolloutActor
from nemo_rl.experience.grouped_rollouts import RolloutCarry, RolloutRunner
from nemo_rl.experience.rollouts import ENV_STEP_TIMEOUT_S
from nemo_rl.models.policy.tq_policy import VAL_PARTITION_ID, TQPolicy


class DataPlaneBatchStore(BatchStore[KVBatchMeta]):
    """Batches live in the policy's data plane; starts the run's rollout actor.

    Args:
        runner: the rollout; the actor gets a copy, and the driver's generation facade with
            every rollout (its ``sampling_step``, its engines after a restart); the driver's
            facade continues from the actor's ``sampling_step``.
        policy: a :class:`TQPolicy` (the data plane, partitions, dispatch by meta).
        timer: receives the policy's dispatch timers (``policy_logprobs/dispatch``, ...).

    Raises:
        TypeError: ``policy`` is not a :class:`TQPolicy`.
    """

    def __init__(self, runner: RolloutRunner, policy: Any, timer: Any) -> None:
        if not isinstance(policy, TQPolicy):
            raise TypeError(
                f"the data-plane GRPO loop needs a TQPolicy, got {type(policy).__name__}; "
                "build the run with data_plane.enabled=true"
            )
        self.policy: TQPolicy = policy
        self.generation = runner.generation
        self.timer = timer
        self.partition_ids: dict[Partition, str] = {
            "train": policy.tq_partition_id,
            "val": VAL_PARTITION_ID,
        }
        # no CPU reserved: the actor mostly waits on the engines and environments
        actor_cls = ray.remote(num_cpus=0)(SyncRolloutActor)
        self.actor = actor_cls.remote(runner, policy.dp_cfg)
        # the actor's own waits are bounded: each turn's generation, each environment's step,
        # the store's writes; past their sum it is stopped or hung itself (taken at each
        # rollout: the generation's config is read then)
        turns = runner.max_rollout_turns
        self._rollout_envs = max(len(runner.task_to_env), 1)
        self._rollout_turns = turns
        self._rollout_bound = (
            f"{turns} turn(s) x (policy.generation.generate_timeout_s + "
            f"{ENV_STEP_TIMEOUT_S:g} s per environment) + data_plane.op_timeout_s"
        )

    def rollout_timeout_s(self) -> float:
        """Seconds the driver waits for one rollout of the actor (see ``_rollout_bound``)."""
        generate_s = self.generation.config.generate_timeout_s
        return (
            self._rollout_turns * (generate_s + ENV_STEP_TIMEOUT_S * self._rollout_envs)
            + self.policy.dp_cfg.op_timeout_s
        )

    @contextmanager
    def scope(self, partition: Partition, num_samples: int, group_size: int) -> Iterator[None]:
        """Opens the partition; clears it if the body raises (a failed step leaves no
        samples behind)."""
        partition_id = self.partition_ids[partition]
        if partition == "train":
            self.policy.prepare_step(num_samples, group_size)
        else:
            self.policy.prepare_val_partition(num_samples, partition_id=partition_id)
        try:
            yield
        except BaseException:
            self.policy.abort_partition(partition_id)
            raise

    def rollout(
        self, prompts: BatchedDataDict, num_generations: int, partition: Partition, greedy: bool
    ) -> tuple[KVBatchMeta, RolloutCarry]:
        ref = self.actor.rollout.remote(
            prompts,
            self.partition_ids[partition],
            num_generations=num_generations,
            generation=self.generation,
            greedy=greedy,
        )
        timeout_s = self.rollout_timeout_s()
        try:
            meta, carry = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerTimeout(
                f"the rollout actor gave no result for rollout within "
                f"{timeout_s:g} s ({self._rollout_bound}): stopped or hung"
            ) from None
        self.generation.sampling_step = carry.sampling_step
        return meta, carry

    def keep(self, batches: Sequence[KVBatchMeta], rows: torch.Tensor) -> KVBatchMeta:
        """The rows' meta; the other rows' samples are discarded from the store."""
        joined = KVBatchMeta.concat(batches)
        dropped = torch.ones(joined.size, dtype=torch.bool)
        dropped[rows] = False
        keys = [joined.keys[i] for i in torch.nonzero(dropped).flatten().tolist()]
        self.policy.discard_samples(keys, joined.partition_id)
        return joined.subset(rows.tolist())

    def add_fields(self, batch: KVBatchMeta, fields: Mapping[str, torch.Tensor]) -> KVBatchMeta:
        return self.policy.write_to_dataplane(batch, fields)

    def logprobs(self, batch: KVBatchMeta, *, reference: bool = False) -> KVBatchMeta:
        if reference:
            return self.policy.get_reference_policy_logprobs_from_meta(batch, timer=self.timer)
        return self.policy.get_logprobs_from_meta(batch, timer=self.timer)

    def train(self, batch: KVBatchMeta, loss_fn: Any) -> dict[str, Any]:
        return self.policy.train_from_meta(batch, loss_fn, timer=self.timer)

    def release(self, batch: KVBatchMeta) -> None:
        """Drops the samples (:meth:`TQPolicy.finish_step`: the partition is then empty).

        Raises:
            DataPlaneError: the partition held samples ``batch`` does not name.
        """
        self.policy.finish_step(batch)

    def close(self) -> None:
        """Close the actor's data-plane client and end it."""
        try:
            ray.get(self.actor.close.remote(), timeout=60)
        finally:
            kill_actors([self.actor])
