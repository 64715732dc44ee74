"""SyncRolloutActor: rollouts whose training fields go straight into the data plane.

Run as a Ray actor next to the driver, it rolls a batch of prompts out
(:func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout`), flattens every conversation and
writes each sample's training fields to the data plane once, under keys it mints. The driver
gets back only a :class:`~nemo_rl.data_plane.KVBatchMeta` (keys, lengths) and a
:class:`RolloutCarry` of per-sample scalars: the bulk tensors never pass through it.

Fields written (see :mod:`nemo_rl.models.policy.tq_policy`): ``input_ids``, ``token_mask`` and
``generation_logprobs`` per token (right-padded rows), ``input_lengths`` per sample.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.data_plane.columns import PAD_VALUE_DICT, write_columns
from nemo_rl.data_plane.config import attach_data_plane
from nemo_rl.data_plane.interfaces import DataPlaneClient
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import EnvironmentInterface
from nemo_rl.experience.rollouts import run_multi_turn_rollout
from nemo_rl.models.generation.interfaces import GenerationInterface

_TENSOR_FIELDS = ("group_ids", "rewards", "loss_multiplier", "truncated", "response_truncated")


@dataclass(frozen=True)
class RolloutCarry:
    """What the driver keeps of a rollout: per-sample scalars ``[B]`` and the metrics.

    Attributes:
        group_ids: int64, the prompt (GRPO group) of each sample.
        rewards: float32, ``total_reward`` of the rollout.
        loss_multiplier: float32, 0 for samples kept out of the loss (e.g. truncated prompts).
        truncated: bool, the conversation reached ``max_seq_len``.
        response_truncated: bool, the last response stopped at a token limit.
        metrics: the rollout metrics of ``run_multi_turn_rollout``.
        sampling_step: the generation's ``sampling_step`` after the rollout (the driver's copy
            of the generation facade must continue from it).
    """

    group_ids: torch.Tensor
    rewards: torch.Tensor
    loss_multiplier: torch.Tensor
    truncated: torch.Tensor
    response_truncated: torch.Tensor
    metrics: dict[str, float]
    sampling_step: int

    @staticmethod
    def from_rollout(
        rollout: BatchedDataDict,
        group_ids: torch.Tensor,
        metrics: dict[str, float],
        sampling_step: int,
    ) -> RolloutCarry:
        """The carry of a :func:`run_multi_turn_rollout` batch whose rows are in ``group_ids``."""
        return RolloutCarry(
            group_ids=group_ids,
            rewards=rollout["total_reward"].float(),
            loss_multiplier=torch.as_tensor(rollout["loss_multiplier"], dtype=torch.float32),
            truncated=rollout["truncated"].bool(),
            response_truncated=rollout["response_truncated"].bool(),
            metrics=metrics,
            sampling_step=sampling_step,
        )

    @property
    def size(self) -> int:
        """Samples (rows)."""
        return int(self.rewards.numel())

    def select(self, rows: torch.Tensor | Sequence[int]) -> RolloutCarry:
        """Rows ``rows`` in that order (metrics and sampling step kept)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return dataclasses.replace(
            self, **{name: getattr(self, name)[index] for name in _TENSOR_FIELDS}
        )

    @staticmethod
    def concat(carries: Sequence[RolloutCarry], metrics: Mapping[str, float]) -> RolloutCarry:
        """Rows of ``carries`` one after the other, with ``metrics``; the last sampling step."""
        if not carries:
            raise ValueError("RolloutCarry.concat needs at least one carry")
        return RolloutCarry(
            **{name: torch.cat([getattr(c, name) for c in carries]) for name in _TENSOR_FIELDS},
            metrics=dict(metrics),
            sampling_step=carries[-1].sampling_step,
        )


def store_rollout(
    client: DataPlaneClient,
    partition_id: str,
    keys: Sequence[str],
    rollout: BatchedDataDict,
    pad_token_id: int,
) -> KVBatchMeta:
    """Flatten the conversations of ``rollout`` and put their training fields under ``keys``.

    Returns:
        The meta of the samples: lengths from ``input_lengths``, the written fields, and
        ``input_ids``' pad value in ``extra_info``.
    """
    flat = message_logs_to_flat(rollout["message_log"], pad_token_id)
    meta = KVBatchMeta(
        partition_id=partition_id,
        keys=keys,
        sequence_lengths=flat["input_lengths"],
        extra_info={PAD_VALUE_DICT: {"input_ids": pad_token_id}},
    )
    return write_columns(
        client,
        meta,
        {
            "input_ids": flat["input_ids"],
            "input_lengths": flat["input_lengths"],
            "token_mask": flat["token_mask"].float(),
            "generation_logprobs": flat["generation_logprobs"].float(),
        },
    )


class SyncRolloutActor:
    """Rolls prompts out and writes the samples' training fields to the data plane.

    Args:
        generation: the generation facade (a copy of the driver's; its engines are shared).
        tokenizer: decodes responses, tokenizes observations.
        task_to_env: environment actor per task name.
        dp_cfg: the ``data_plane`` section; the actor attaches its own client.
        max_seq_len: most tokens of a conversation (``policy.max_total_sequence_length``).
        max_rollout_turns: most assistant turns per sample.
        pad_token_id: pads ``input_ids`` when the samples are read back as a batch.
    """

    def __init__(
        self,
        generation: GenerationInterface,
        tokenizer: Any,
        task_to_env: dict[str, EnvironmentInterface],
        dp_cfg: Mapping[str, Any],
        *,
        max_seq_len: int,
        max_rollout_turns: int,
        pad_token_id: int,
    ) -> None:
        self.generation = generation
        self.tokenizer = tokenizer
        self.task_to_env = task_to_env
        self.max_seq_len = max_seq_len
        self.max_rollout_turns = max_rollout_turns
        self.pad_token_id = pad_token_id
        self._data_plane = attach_data_plane(dp_cfg)
        # Keys are "<partition>/<actor id>/<call>/<row>": unique for the actor's lifetime.
        self._actor_id = uuid.uuid4().hex[:8]
        self._calls = 0

    def rollout(
        self,
        prompts: BatchedDataDict,
        partition_id: str,
        *,
        num_generations: int,
        sampling_step: int,
        greedy: bool = False,
    ) -> tuple[KVBatchMeta, RolloutCarry]:
        """Roll out ``num_generations`` responses per prompt and store them in ``partition_id``.

        Args:
            prompts: ``P`` collated ``DatumSpec`` rows.
            partition_id: a registered partition.
            num_generations: responses per prompt; a prompt's responses are consecutive rows
                (:func:`nemo_rl.algorithms.grpo.repeat_prompts`).
            sampling_step: the driver's ``generation.sampling_step`` (seeds continue from it).
            greedy: argmax decoding.

        Returns:
            ``(meta, carry)`` of the ``P * num_generations`` samples, in rollout order.
        """
        from nemo_rl.algorithms.grpo import repeat_prompts

        self.generation.sampling_step = sampling_step
        batch, group_ids = repeat_prompts(prompts, num_generations)
        rollout, metrics = run_multi_turn_rollout(
            self.generation,
            batch,
            self.tokenizer,
            self.task_to_env,
            max_seq_len=self.max_seq_len,
            max_rollout_turns=self.max_rollout_turns,
            greedy=greedy,
        )
        self._calls += 1
        prefix = f"{partition_id}/{self._actor_id}/{self._calls}"
        keys = [f"{prefix}/{row}" for row in range(len(group_ids))]
        meta = store_rollout(self._data_plane, partition_id, keys, rollout, self.pad_token_id)
        carry = RolloutCarry.from_rollout(
            rollout, group_ids, metrics, self.generation.sampling_step
        )
        return meta, carry

    def close(self) -> None:
        """Close this actor's data-plane client."""
        self._data_plane.close()
