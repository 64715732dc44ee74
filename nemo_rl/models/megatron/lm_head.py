"""The GPTModel's output layer made to hand back its input, so the LM head can be fused with the
log-probabilities (:mod:`nemo_rl.distributed.fused_lm_head`) instead of materialising logits.

Inside :func:`output_layer_returns_hidden` the last stage's ``output_layer`` returns what its
matmul would have multiplied: the final norm's output after the output layer's own input
mapping (all-gathered over the sequence under sequence parallelism, else entering the TP
region whose backward sums the input gradient over the TP ranks), so the stage's forward
returns ``[b, s, hidden]`` instead of ``[b, s, vocab / TP]``. :func:`output_weight` is the
matrix the output layer would have used (the embedding when tied), its token rows only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient reaching the
    output layer's input comes back through the stage's ``[b, s] -> [s, b]`` transpose, and the
    TP mapping all-reduces it (gloo mishandles non-contiguous buffers; the output layer's own
    matmul gradient is contiguous)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def output_weight(stage: Any) -> tuple[Tensor, int]:
    """``[tokens, hidden]``: the rows of the LM head on this rank of the last stage that are
    tokens, without the vocabulary padding (:mod:`megatron_bridge.vocab_padding`), and the
    token id of the first; the rows are a view of the word-embedding parameter when input and
    output embeddings are tied.

    Raises:
        ValueError: this rank holds padding only (a vocabulary of a few thousand tokens over a
            large TP), which the fused LM head cannot score.
    """
    from megatron_bridge.vocab_padding import vocab_shard

    if stage.share_embeddings_and_output_weights:
        weight = stage.shared_embedding_or_output_weight()
    else:
        weight = stage.output_layer.weight
    shard = vocab_shard(stage)
    if shard.tokens == 0:
        raise ValueError(
            f"tensor-parallel rank rows [{shard.start}, {shard.start + shard.rows}) are all "
            "vocabulary padding, which the fused LM head (policy.logprob_chunk_size) cannot "
            "score: lower policy.megatron_cfg.make_vocab_size_divisible_by or the TP size, or "
            "set policy.logprob_chunk_size to null"
        )
    return weight[: shard.tokens], shard.start


@contextmanager
def output_layer_returns_hidden(stage: Any) -> Iterator[None]:
    """Within the block, ``stage``'s output layer returns its (TP-mapped) input ``[s, b, h]``
    instead of logits; a stage without an output layer (not the last pipeline stage) is left
    alone."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    from megatron_bridge.vocab_padding import padding_mask_of

    layer = getattr(stage, "output_layer", None) if stage.post_process else None
    if layer is None:
        yield
        return
    mask = padding_mask_of(layer)  # the input handed back has no padding columns to fill

    def passthrough(input_: Tensor, weight: Tensor | None = None, **_: Any) -> tuple[Tensor, None]:
        if layer.sequence_parallel:
            mapped = gather_from_sequence_parallel_region(input_, group=layer.tp_group)
        else:
            mapped = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
        return _ContiguousGrad.apply(mapped), None

    layer.forward = passthrough
    if mask is not None:
        mask.enabled = False
    try:
        yield
    finally:
        del layer.forward  # back to the class's forward
        if mask is not None:
            mask.enabled = True
