"""SyncRolloutActor: rollouts whose training fields go straight into the data plane.

The rollout actor of synchronous GRPO over the data plane (``data_plane.enabled``; async GRPO
passes its rollouts through the driver), under the name and module path NeMo RL's TQ policy
interface gives it. Run as a Ray actor next to the driver, it rolls a batch of prompts out
(:class:`~nemo_rl.experience.grouped_rollouts.RolloutRunner`) and writes each sample's training
fields to the data plane once, under keys it mints. The driver gets back only a
:class:`~nemo_rl.data_plane.KVBatchMeta` (keys, lengths) and a
:class:`~nemo_rl.experience.grouped_rollouts.RolloutCarry` of per-sample scalars: the bulk
tensors never pass through it.

Fields written (see :mod:`nemo_rl.models.policy.tq_policy`): ``input_ids``, ``token_mask`` and
``generation_logprobs`` per token (right-padded rows), ``input_lengths`` per sample.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl.data_plane.columns import PAD_VALUE_DICT, write_columns
from nemo_rl.data_plane.config import attach_data_plane
from nemo_rl.data_plane.interfaces import DataPlaneClient
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.experience.grouped_rollouts import RolloutCarry, RolloutRunner


def store_training_fields(
    client: DataPlaneClient,
    partition_id: str,
    keys: Sequence[str],
    fields: BatchedDataDict,
    pad_token_id: int,
) -> KVBatchMeta:
    """Put a rollout's :func:`~nemo_rl.experience.grouped_rollouts.training_fields` under
    ``keys`` (one per row).

    Returns:
        The meta of the samples: lengths from ``input_lengths``, the written fields, and
        ``input_ids``' pad value in ``extra_info``.
    """
    meta = KVBatchMeta(
        partition_id=partition_id,
        keys=keys,
        sequence_lengths=fields["input_lengths"],
        extra_info={PAD_VALUE_DICT: {"input_ids": pad_token_id}},
    )
    return write_columns(client, meta, fields)


class SyncRolloutActor:
    """Rolls prompts out and writes the samples' training fields to the data plane.

    Args:
        runner: the rollout; its generation facade is replaced by the driver's at every
            :meth:`rollout` (the engines are shared).
        dp_cfg: the ``data_plane`` section; the actor attaches its own client.
    """

    def __init__(self, runner: RolloutRunner, dp_cfg: Mapping[str, Any]) -> None:
        self.runner = runner
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
        generation: Any,
        greedy: bool = False,
    ) -> tuple[KVBatchMeta, RolloutCarry]:
        """Roll out ``num_generations`` responses per prompt and store them in ``partition_id``.

        Args:
            prompts: ``P`` collated ``DatumSpec`` rows.
            partition_id: a registered partition.
            num_generations: responses per prompt; a prompt's responses are consecutive rows.
            generation: the driver's generation facade as it is now: seeds continue from its
                ``sampling_step``, and an engine restarted since the last call is its new one.
            greedy: argmax decoding.

        Returns:
            ``(meta, carry)`` of the ``P * num_generations`` samples, in rollout order
            (``carry.sampling_step``: where the driver's facade continues).
        """
        self.runner.generation = generation
        fields, carry = self.runner.run(prompts, num_generations, greedy=greedy)
        self._calls += 1
        prefix = f"{partition_id}/{self._actor_id}/{self._calls}"
        keys = [f"{prefix}/{row}" for row in range(carry.size)]
        meta = store_training_fields(
            self._data_plane, partition_id, keys, fields, self.runner.pad_token_id
        )
        return meta, carry

    def close(self) -> None:
        """Close this actor's data-plane client."""
        self._data_plane.close()
