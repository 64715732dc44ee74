"""InMemoryBatchStore: a step's batches pass through the driver as tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from nemo_rl.algorithms.grpo_step.interfaces import BatchStore, Partition
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.grouped_rollouts import TOKEN_FIELDS, RolloutCarry, RolloutRunner


class InMemoryBatchStore(BatchStore[BatchedDataDict]):
    """The handle of a batch is the batch: training fields ``[B, S]`` with ``S`` the longest
    sample, per-sample fields ``[B]``.

    Args:
        runner: rolls the prompts out with the driver's generation facade.
        policy: a :class:`~nemo_rl.models.policy.lm_policy.Policy` (logprobs, training).
    """

    def __init__(self, runner: RolloutRunner, policy: Any) -> None:
        self.runner = runner
        self.policy = policy

    def scope(
        self, partition: Partition, num_samples: int, group_size: int
    ) -> AbstractContextManager[None]:
        """Nothing to clean up: a failed step's tensors are garbage."""
        return nullcontext()

    def rollout(
        self, prompts: BatchedDataDict, num_generations: int, partition: Partition, greedy: bool
    ) -> tuple[BatchedDataDict, RolloutCarry]:
        return self.runner.run(prompts, num_generations, greedy=greedy)

    def keep(self, batches: Sequence[BatchedDataDict], rows: torch.Tensor) -> BatchedDataDict:
        """The rows, token fields cut to the longest kept sample (as if only they had been
        rolled out)."""
        pads = {"input_ids": self.runner.pad_token_id}
        joined = BatchedDataDict.from_batches(batches, pad_value_dict=pads)
        picked = joined.select_indices(rows)
        seq = max(int(picked["input_lengths"].max()), 1) if picked.size else 1
        for name in TOKEN_FIELDS:
            picked[name] = picked[name][:, :seq]
        return picked

    def add_fields(
        self, batch: BatchedDataDict, fields: Mapping[str, torch.Tensor]
    ) -> BatchedDataDict:
        """``advantages`` goes in as the loss reads it: ``[B, S]``, the sample's value on every
        token of ``token_mask`` (per-token ``[B, S]`` advantages, REINFORCE++'s with the KL in
        the reward, masked the same way)."""
        out = BatchedDataDict(batch)
        out.update(fields)
        if "advantages" in fields:
            adv = fields["advantages"]
            out["advantages"] = (adv if adv.dim() == 2 else adv[:, None]) * batch["token_mask"]
        return out

    def logprobs(self, batch: BatchedDataDict, *, reference: bool = False) -> BatchedDataDict:
        out = BatchedDataDict(batch)
        if reference:
            result = self.policy.get_reference_policy_logprobs(batch)
            out["reference_policy_logprobs"] = result["reference_logprobs"]
        else:
            out["prev_logprobs"] = self.policy.get_logprobs(batch)["logprobs"]
        return out

    def train(self, batch: BatchedDataDict, loss_fn: Any) -> dict[str, Any]:
        return self.policy.train(batch, loss_fn)

    def release(self, batch: BatchedDataDict) -> None:
        """Nothing to drop: the driver's references go with the step."""

    def close(self) -> None:
        """Nothing held."""
