"""The vocabulary padding of a Megatron GPT stage, kept out of its softmax.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP`` rows
(:meth:`~megatron_bridge.config.BridgeConfig.padded_vocab`: Llama 3.1's 128,256 tokens become
128,512 rows at TP 4 or 8). The padding rows are no tokens: loaded as zeros, their logits are 0,
and a softmax over all the output layer's columns gives them probability that the HF model, its
tokenizer and vLLM (which keeps the config's ``vocab_size`` columns) do not have. Every
log-probability would be off by the padding's share of the partition function, more the
flatter the distribution (a tiny model with 1,026 tokens padded to 1,152: the policy's and the
engines' token probabilities differed by 1-4 %).

:func:`exclude_vocab_padding` makes a stage's output layer fill the padding columns of its
logits with ``-inf``, so every softmax, top-k or log-sum-exp over the stage's logits is the HF
model's; :func:`vocab_shard` tells a fused LM head (which multiplies the weight itself) which of
this rank's rows are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class VocabShard:
    """This tensor-parallel rank's part of the output layer's vocabulary.

    Attributes:
        start: token id of the rank's first row.
        rows: the rank's rows (padded vocabulary / TP).
        tokens: how many of them are tokens (the first ``tokens``; the rest is padding).
    """

    start: int
    rows: int
    tokens: int


class _PaddingMask:
    """Forward hook of the output layer: ``-inf`` in the padding columns of its logits, unless
    ``enabled`` is off (the layer made to return its input instead of logits)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.enabled = True

    def __call__(self, module: Any, args: Any, output: tuple[Tensor, Any]) -> tuple[Tensor, Any]:
        if not self.enabled:
            return output
        logits, bias = output
        logits[..., self.tokens :] = float("-inf")  # in place: the matmul saved no output
        return logits, bias


def exclude_vocab_padding(stage: Any, vocab_size: int) -> VocabShard | None:
    """Make ``stage``'s output layer (last pipeline stage) give ``-inf`` logits to the padding
    rows of this rank, once; returns the rank's :class:`VocabShard` (None off the last stage).

    Args:
        stage: a megatron-core ``GPTModel`` stage built with the padded vocabulary.
        vocab_size: the HF config's ``vocab_size`` (token ids ``[0, vocab_size)``).
    """
    from megatron.core import parallel_state

    layer = getattr(stage, "output_layer", None) if stage.post_process else None
    if layer is None:
        return None
    rows = int(layer.output_size_per_partition)
    start = parallel_state.get_tensor_model_parallel_rank() * rows
    shard = VocabShard(start, rows, max(0, min(rows, vocab_size - start)))
    if shard.tokens < rows and getattr(layer, "vocab_padding_mask", None) is None:
        layer.vocab_padding_mask = _PaddingMask(shard.tokens)
        layer.register_forward_hook(layer.vocab_padding_mask)
    layer.vocab_shard = shard
    return shard


def vocab_shard(stage: Any) -> VocabShard:
    """The :class:`VocabShard` :func:`exclude_vocab_padding` recorded on ``stage``'s output
    layer.

    Raises:
        RuntimeError: the stage's padding was never excluded.
    """
    shard = getattr(getattr(stage, "output_layer", None), "vocab_shard", None)
    if shard is None:
        raise RuntimeError(
            "this stage's vocabulary padding was never excluded: build it with "
            "megatron_bridge.load.gpt_model_stage (or call exclude_vocab_padding)"
        )
    return shard


def padding_mask_of(layer: Any) -> _PaddingMask | None:
    """The output layer's padding mask (None: this rank holds no padding)."""
    return getattr(layer, "vocab_padding_mask", None)
