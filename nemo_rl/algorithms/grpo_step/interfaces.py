"""The batch store: where a GRPO step's samples live between its phases.

The step (:mod:`nemo_rl.algorithms.grpo_step.step`) holds a handle per batch (``BatchT``: the
tensors themselves in memory, a :class:`~nemo_rl.data_plane.KVBatchMeta` on the data plane) and
per-sample scalars (:class:`~nemo_rl.experience.grouped_rollouts.RolloutCarry`); every phase is
one store call that takes a handle and returns the handle of the grown batch.

A batch's fields, by phase: ``rollout`` gives ``input_ids``, ``token_mask``,
``generation_logprobs`` ``[B, S]`` and ``input_lengths`` ``[B]``; the step adds ``advantages``
and ``sample_mask`` ``[B]`` (per sample: the policy expands ``advantages`` over
``token_mask``); ``logprobs`` adds ``prev_logprobs`` or ``reference_policy_logprobs``
``[B, S]``; ``train`` reads them all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, Literal, TypeVar

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.grouped_rollouts import RolloutCarry

BatchT = TypeVar("BatchT")

# What a batch is for: a training step, or a batch of validation prompts.
Partition = Literal["train", "val"]


class BatchStore(ABC, Generic[BatchT]):
    """Rollouts in, training out; the samples stay in the store between the calls."""

    @abstractmethod
    def scope(
        self, partition: Partition, num_samples: int, group_size: int
    ) -> AbstractContextManager[None]:
        """The span of one step (or one validation batch) of ``num_samples`` samples in
        groups of ``group_size``: samples stored inside are dropped if the body raises."""

    @abstractmethod
    def rollout(
        self, prompts: BatchedDataDict, num_generations: int, partition: Partition, greedy: bool
    ) -> tuple[BatchT, RolloutCarry]:
        """Roll out ``num_generations`` responses per prompt (consecutive rows; ``greedy``:
        argmax decoding) into ``partition`` and store their training fields; the engines must
        be awake. Returns the handle and the carry."""

    @abstractmethod
    def keep(self, batches: Sequence[BatchT], rows: torch.Tensor) -> BatchT:
        """Rows ``rows`` (``[n]`` indices, in that order) of ``batches`` one after the other;
        the other rows leave the store."""

    @abstractmethod
    def add_fields(self, batch: BatchT, fields: Mapping[str, torch.Tensor]) -> BatchT:
        """Store per-sample ``fields`` (``[B]`` tensors) with the batch's samples; the
        in-memory store also takes per-token ``[B, S]`` ``advantages``."""

    @abstractmethod
    def logprobs(self, batch: BatchT, *, reference: bool = False) -> BatchT:
        """Add the policy's logprobs as ``prev_logprobs`` (``reference``: the reference
        policy's, as ``reference_policy_logprobs``), ``[B, S]``."""

    @abstractmethod
    def train(self, batch: BatchT, loss_fn: Any) -> dict[str, Any]:
        """One ``policy.train`` on the batch; its results
        (:func:`~nemo_rl.models.policy.lm_policy.aggregate_train_results`)."""

    @abstractmethod
    def release(self, batch: BatchT) -> None:
        """Drop the batch's samples; the partition must hold no others."""

    @abstractmethod
    def close(self) -> None:
        """Free what the store holds for the run (actors, clients)."""
