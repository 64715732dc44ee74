"""The scalar head of a reward model: the GPTModel's LM head swapped for ``hidden -> 1``.

A Bradley-Terry reward model is the policy's decoder with a linear score head. The model is
built and loaded as the causal LM (:func:`~nemo_rl.models.policy.workers.megatron.model_setup.
build_gpt_stage`), then :func:`attach_reward_head` replaces ``output_layer`` on the last
pipeline stage by a :class:`ScalarHead`, so the GPTModel's forward returns one value per
token, ``[b, s, 1]``, where it returned the vocabulary logits; the reward of a row is the value
at its last real token (:func:`~nemo_rl.models.policy.workers.megatron.forward.
rewards_from_outputs`). The head keeps the name ``output_layer.weight``, which is where the
bridge of a ``...ForSequenceClassification`` model puts HF's ``score.weight``
(:meth:`megatron_bridge.BridgeConfig.as_sequence_classifier`), so checkpoints export as an HF
sequence classifier, and such an export loads back with its trained head (the head is attached
before the weights are loaded: a PPO critic started from a reward model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class ScalarHead(torch.nn.Module):
    """``hidden [s, b, h] -> values [s, b, 1]``, replicated on every TP rank.

    Called by the GPTModel where it calls its output layer (``weight``: the tied embedding,
    ignored; ``runtime_gather_output``: ignored, the output is whole). Under sequence
    parallelism the hidden states arrive split along ``s``; they are gathered first (the
    backward keeps this rank's part: every TP rank computes the same loss).

    Args:
        hidden_size: ``h``.
        sequence_parallel: the decoder runs with sequence parallelism.
        weight: ``[1, h]`` initial weight.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, weight: Tensor) -> None:
        super().__init__()
        if tuple(weight.shape) != (1, hidden_size):
            raise ValueError(f"score head weight must be [1, {hidden_size}], got {list(weight.shape)}")
        self.weight = torch.nn.Parameter(weight)
        self.sequence_parallel = sequence_parallel

    def forward(
        self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None, **_: Any
    ) -> tuple[Tensor, None]:
        """``(values [s, b, 1], None)``, the output layer's return shape."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype)), None


def initial_head_weight(hidden_size: int, std: float, seed: int) -> Tensor:
    """``[1, h]`` float32 draws of N(0, std^2) from ``seed`` (the same on every rank, as
    transformers initialises ``score.weight`` with ``initializer_range``)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, hidden_size, generator=generator) * std


def attach_reward_head(model: torch.nn.Module, weight: Tensor) -> None:
    """Give a (not yet DDP-wrapped) GPTModel stage the scalar head ``weight`` ``[1, h]``.

    The last pipeline stage's ``output_layer`` becomes a :class:`ScalarHead`; every stage stops
    sharing the embedding with the output layer (there is no LM head left to tie, and
    megatron would otherwise all-reduce the embedding's gradient with the head's).
    """
    model.share_embeddings_and_output_weights = False
    if not model.post_process:
        return
    param = next(model.parameters())
    model.output_layer = ScalarHead(
        model.config.hidden_size,
        model.config.sequence_parallel,
        weight.to(device=param.device, dtype=param.dtype),
    )
