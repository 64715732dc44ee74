"""What a rollout generation backend takes, returns and must implement.

Token tensors are right-padded ``[batch, seq]`` (int64 token ids); the true per-sample lengths
(tokens) travel under their own keys. A backend is driven in colocated RL as::

    generation.prepare_for_generation()   # wake the engines (weights + KV cache back on device)
    out = generation.generate(batch)
    generation.finish_generation()        # free device memory for training
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NotRequired, TypedDict

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.config import GenerationConfig

__all__ = [
    "AsyncGenerationInterface",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationInterface",
    "GenerationOutputSpec",
    "PromptTooLongError",
]


class PromptTooLongError(ValueError):
    """A prompt that leaves no room to generate under the engine's ``max_model_len``.

    The rollout's own loop never sends one (it cuts a sample at ``max_total_sequence_length``);
    an agent can, when its conversation outgrows the context: the HTTP endpoint answers it with
    a 400 whose error ``code`` is ``context_length_exceeded`` (OpenAI's code for this), so the
    agent can end the episode instead of failing.
    """

    #: the ``code`` of the endpoint's error body for this request (OpenAI's)
    openai_code = "context_length_exceeded"


class GenerationDatumSpec(TypedDict):
    """Input of :meth:`GenerationInterface.generate`.

    Attributes:
        input_ids: ``[batch, seq]`` prompt token ids, right-padded (pad values are ignored).
        input_lengths: ``[batch]`` prompt lengths in tokens, each in ``[1, seq]``.
        stop_strings: optional, one entry per sample: strings that end that sample's response
            (merged with ``GenerationConfig.stop_strings``), or None for the config's only.
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    stop_strings: NotRequired[list[list[str] | None]]


class GenerationOutputSpec(TypedDict):
    """Output of :meth:`GenerationInterface.generate`, rows in input order.

    Attributes:
        output_ids: ``[batch, seq_total]`` int64: the unpadded prompt followed by the generated
            tokens, right-padded with the pad token id. ``seq_total`` is the larger of the input
            ``seq`` and the longest ``unpadded_sequence_lengths``. A response ended by a stop
            string keeps the whole token that completed the string.
        logprobs: ``[batch, seq_total]`` float32: at the position of each generated token, its
            log-probability under the distribution it was sampled from (the logits divided by
            the temperature, then top-k / top-p truncated and renormalised; greedy decoding:
            the unscaled distribution); 0.0 at prompt and pad positions.
        generation_lengths: ``[batch]`` int64, generated tokens per sample (EOS included).
        unpadded_sequence_lengths: ``[batch]`` int64, ``input_lengths + generation_lengths``.
        truncated: ``[batch]`` bool, True where generation stopped at the token limit
            (``max_new_tokens`` or the engine's ``max_model_len``) without EOS, a stop token or
            a stop string.
    """

    output_ids: torch.Tensor
    logprobs: torch.Tensor
    generation_lengths: torch.Tensor
    unpadded_sequence_lengths: torch.Tensor
    truncated: torch.Tensor


class GenerationInterface(ABC):
    """A rollout generation backend (e.g. a set of vLLM engines behind one driver object)."""

    @abstractmethod
    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """Generate one response per row of ``data``; ``greedy`` forces argmax decoding."""

    @abstractmethod
    def prepare_for_generation(self, **kwargs: Any) -> bool:
        """Make the engines ready to generate (e.g. wake them from sleep); True on success."""

    @abstractmethod
    def finish_generation(self, **kwargs: Any) -> bool:
        """Release what generation holds between rollouts (e.g. put engines to sleep)."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Stop the engines and their workers; True if they shut down cleanly."""


class AsyncGenerationInterface(GenerationInterface):
    """A backend that can also generate for a few rows without waiting for other calls, so
    each sample of a rollout advances on its own (``vllm_cfg.async_engine``)."""

    @abstractmethod
    async def generate_async(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        greedy: bool = False,
        *,
        seed_key: tuple[int, ...],
    ) -> BatchedDataDict[GenerationOutputSpec]:
        """:meth:`GenerationInterface.generate` for ``data`` (typically one sample's turn),
        concurrently with other calls. ``seed_key`` names the call for sampling: calls with
        equal keys under the same base seed sample alike; its first entry picks the replica,
        so a sample whose key starts with its index stays on one engine (and its prefix cache)
        across turns."""

    @abstractmethod
    def reserve_sampling_step(self) -> int:
        """The next sampling step, now counted as used (a rollout made of many
        :meth:`generate_async` calls takes one step, as one :meth:`generate` call does)."""
