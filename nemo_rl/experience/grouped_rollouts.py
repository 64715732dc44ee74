"""Grouped rollouts: each prompt rolled out several times, flattened into training fields.

:class:`RolloutRunner` is the one rollout of GRPO, whichever store keeps its samples: the
driver's in-memory batch store calls it directly, the data-plane rollout actor calls it and
writes the fields to the store. It returns the flattened :func:`training_fields` (the bulk
``[B, S]`` tensors) and a :class:`RolloutCarry` (per-sample scalars the driver keeps: rewards,
masks, group ids, metrics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl.data.llm_message_utils import message_logs_to_flat
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.environments.interfaces import REWARD_COMPONENT_PREFIX, EnvironmentInterface
from nemo_rl.experience.async_engine_rollouts import multi_turn_rollout_for
from nemo_rl.models.generation.interfaces import GenerationInterface

# The fields of :func:`training_fields` that hold right-padded token rows ``[B, S]``.
TOKEN_FIELDS = ("input_ids", "token_mask", "generation_logprobs")
_CARRY_TENSORS = (
    "group_ids", "rewards", "loss_multiplier", "truncated", "response_truncated",
    "response_tokens",
)


def repeat_prompts(
    batch: BatchedDataDict, num_generations: int
) -> tuple[BatchedDataDict, torch.Tensor]:
    """Each prompt row ``num_generations`` times in a row, and ``[B * n]`` group ids."""
    group_ids = torch.arange(batch.size).repeat_interleave(num_generations)
    return batch.repeat_interleave(num_generations), group_ids


def training_fields(rollout: BatchedDataDict, pad_token_id: int) -> BatchedDataDict:
    """The conversations of a :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` batch
    as training fields.

    Returns:
        ``input_ids`` ``[B, S]`` int64 (padded with ``pad_token_id``), ``token_mask`` ``[B, S]``
        float32 (1 on assistant tokens), ``generation_logprobs`` ``[B, S]`` float32 and
        ``input_lengths`` ``[B]`` int64, with ``S`` the longest conversation (tokens).
    """
    fields = message_logs_to_flat(rollout["message_log"], pad_token_id)
    fields["token_mask"] = fields["token_mask"].float()  # the loss multiplies by it
    return fields


@dataclass(frozen=True)
class RolloutCarry:
    """What the driver keeps of a rollout: per-sample scalars ``[B]`` and the metrics.

    Attributes:
        group_ids: int64, the prompt (GRPO group) of each sample.
        rewards: float32, ``total_reward`` of the rollout.
        loss_multiplier: float32, 0 for samples kept out of the loss (e.g. truncated prompts).
        truncated: bool, the conversation reached ``max_seq_len``.
        response_truncated: bool, the last response stopped at a token limit.
        response_tokens: int64, the sample's assistant tokens (the loss's ``token_mask``).
        metrics: the rollout metrics of ``run_multi_turn_rollout``.
        first_env_error: the first ``"environment '<task>': <error>"`` of a sample whose
            environment failed in the rollout(s) (also when that sample is no longer among the
            rows); None when none failed.
        sampling_step: the generation's ``sampling_step`` after the rollout (a driver whose
            generation facade is a copy of the roller's must continue from it).
        reward_components: ``{"reward/<name>": [B] float32}``, the named rewards of
            environments that return several (summed over turns; 0 for a sample that never got
            one); empty when every environment returned one reward.
    """

    group_ids: torch.Tensor
    rewards: torch.Tensor
    loss_multiplier: torch.Tensor
    truncated: torch.Tensor
    response_truncated: torch.Tensor
    response_tokens: torch.Tensor
    metrics: dict[str, float]
    sampling_step: int
    first_env_error: str | None = None
    reward_components: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @staticmethod
    def from_rollout(
        rollout: BatchedDataDict,
        group_ids: torch.Tensor,
        metrics: dict[str, float],
        sampling_step: int,
    ) -> RolloutCarry:
        """The carry of a :func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout` batch
        whose rows are in ``group_ids``."""
        return RolloutCarry(
            group_ids=group_ids,
            rewards=rollout["total_reward"].float(),
            loss_multiplier=torch.as_tensor(rollout["loss_multiplier"], dtype=torch.float32),
            truncated=rollout["truncated"].bool(),
            response_truncated=rollout["response_truncated"].bool(),
            response_tokens=torch.tensor(
                [
                    sum(len(m["token_ids"]) for m in log if m["role"] == "assistant")
                    for log in rollout["message_log"]
                ],
                dtype=torch.int64,
            ),
            metrics=metrics,
            sampling_step=sampling_step,
            first_env_error=next((e for e in rollout["env_error"] if e is not None), None),
            reward_components={
                key: rollout[key].float()
                for key in rollout.keys()
                if key.startswith(REWARD_COMPONENT_PREFIX)
            },
        )

    @property
    def size(self) -> int:
        """Samples (rows)."""
        return int(self.rewards.numel())

    def select(self, rows: torch.Tensor | Sequence[int]) -> RolloutCarry:
        """Rows ``rows`` in that order (metrics and sampling step kept)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return dataclasses.replace(
            self,
            **{name: getattr(self, name)[index] for name in _CARRY_TENSORS},
            reward_components={k: v[index] for k, v in self.reward_components.items()},
        )

    @staticmethod
    def concat(carries: Sequence[RolloutCarry], metrics: Mapping[str, float]) -> RolloutCarry:
        """Rows of ``carries`` one after the other, with ``metrics``; the last sampling step
        and the first environment error. A reward component some carries lack is 0 in their
        rows."""
        if not carries:
            raise ValueError("RolloutCarry.concat needs at least one carry")
        names = sorted({name for c in carries for name in c.reward_components})
        return RolloutCarry(
            **{name: torch.cat([getattr(c, name) for c in carries]) for name in _CARRY_TENSORS},
            metrics=dict(metrics),
            sampling_step=carries[-1].sampling_step,
            first_env_error=next(
                (c.first_env_error for c in carries if c.first_env_error is not None), None
            ),
            reward_components={
                name: torch.cat(
                    [c.reward_components.get(name, torch.zeros(c.size)) for c in carries]
                )
                for name in names
            },
        )


@dataclass
class RolloutRunner:
    """Everything a rollout needs besides its prompts.

    Attributes:
        generation: the generation facade (awake while :meth:`run` runs).
        tokenizer: decodes responses, tokenizes observations.
        task_to_env: environment actor per task name.
        max_seq_len: most tokens of a conversation (``policy.max_total_sequence_length``).
        max_rollout_turns: most assistant turns per sample.
        pad_token_id: pads ``input_ids`` past each row's length.
    """

    generation: GenerationInterface
    tokenizer: Any
    task_to_env: dict[str, EnvironmentInterface]
    max_seq_len: int
    max_rollout_turns: int
    pad_token_id: int

    def run(
        self, prompts: BatchedDataDict, num_generations: int, *, greedy: bool = False
    ) -> tuple[BatchedDataDict, RolloutCarry]:
        """Roll out ``num_generations`` responses per prompt (a prompt's responses are
        consecutive rows); the environments score them during the rollout.

        Args:
            prompts: ``P`` collated ``DatumSpec`` rows.
            num_generations: responses per prompt.
            greedy: argmax decoding.

        Returns:
            ``(fields, carry)`` of the ``P * num_generations`` samples: :func:`training_fields`
            and the carry (group id = prompt index).
        """
        batch, group_ids = repeat_prompts(prompts, num_generations)
        rollout, metrics = multi_turn_rollout_for(self.generation)(
            self.generation,
            batch,
            self.tokenizer,
            self.task_to_env,
            max_seq_len=self.max_seq_len,
            max_rollout_turns=self.max_rollout_turns,
            greedy=greedy,
        )
        carry = RolloutCarry.from_rollout(
            rollout, group_ids, metrics, self.generation.sampling_step
        )
        return training_fields(rollout, self.pad_token_id), carry
