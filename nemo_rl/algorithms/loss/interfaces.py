"""The contract every training loss follows.

A loss is called once per micro-batch. It must return the micro-batch's share of the *global*
loss: token-level losses divide by ``global_valid_toks`` (valid tokens of the whole global
batch) and sequence-level losses by ``global_valid_seqs`` (valid sequences of the whole global
batch), so that the sum of the micro-batch losses, and of their gradients, equals the loss of the
global batch however it is split. Metrics follow the same rule: every metric a loss in this
package returns is additive over micro-batches (sum the micro-batch values to get the global
value), except those its ``metric_reductions`` names (:func:`metric_reductions`): extremes,
reduced by their minimum or maximum.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class MetricReduction(enum.Enum):
    """How a loss metric of the micro-batches (and data-parallel ranks) becomes the global
    batch's."""

    SUM = "sum"
    """Added up (the default: token and sequence means are shares of the global mean)."""
    MIN = "min"
    """The smallest (an extreme over the valid tokens)."""
    MAX = "max"
    """The largest."""


def metric_reductions(loss_fn: Any) -> Mapping[str, MetricReduction]:
    """The metrics of ``loss_fn`` that are not added up over micro-batches: its optional
    ``metric_reductions`` attribute (name -> :class:`MetricReduction`); every other metric is
    :attr:`MetricReduction.SUM`."""
    return getattr(loss_fn, "metric_reductions", {})


class LossType(enum.Enum):
    """How a loss is normalised across the global batch."""

    TOKEN_LEVEL = "token_level"
    """Sum over valid tokens divided by ``global_valid_toks``."""
    SEQUENCE_LEVEL = "sequence_level"
    """Sum over valid sequences of a per-sequence mean divided by ``global_valid_seqs``."""


class LossInputType(enum.Enum):
    """Which model outputs the trainer passes to the loss as keyword arguments."""

    LOGIT = "logit"
    """``logits``: [batch, seq, vocab]."""
    LOGPROB = "logprob"
    """``next_token_logprobs``: [batch, seq]; position 0 is 0 (nothing predicts it).
    ``ClippedPGLossFn`` also takes NeMo RL's [batch, seq - 1], aligned with ``data[:, 1:]``."""
    REWARD = "reward"
    """``rewards``: [batch], a scalar head's value at each row's last real token."""
    VALUE = "value"
    """``values``: [batch, seq], a scalar head's value of the state before each token (the
    head at the previous position; position 0 is 0), aligned like ``next_token_logprobs``."""
    DISTILLATION = "distillation"
    """``student_topk_logprobs``, ``teacher_topk_logprobs``: [batch, seq, k]; ``H_all``."""
    DRAFT = "draft"
    """``teacher_logits``, ``student_logits``: [batch, seq, vocab]; ``mask``: [batch, seq]."""


@runtime_checkable
class LossFunction(Protocol):
    """Signature of the loss functions used by the trainers.

    ``loss_type`` says which global count normalises the loss; ``input_type`` says which
    keyword arguments ``__call__`` receives (see :class:`LossInputType`).
    """

    loss_type: LossType
    input_type: LossInputType

    def __call__(
        self,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Compute the micro-batch's share of the global loss and its metrics.

        Args:
            data: batch-first tensors of the micro-batch (advantages, masks, reference
                logprobs, ...), read as a mapping from key to tensor.
            global_valid_seqs: scalar, number of valid sequences in the global batch.
            global_valid_toks: scalar, number of valid tokens in the global batch.
            **kwargs: model outputs, by ``input_type``: LOGPROB ``next_token_logprobs``;
                LOGIT ``logits``; REWARD ``rewards``; VALUE ``values``; DISTILLATION ``student_topk_logprobs``,
                ``teacher_topk_logprobs``, ``H_all``; DRAFT ``teacher_logits``,
                ``student_logits``, ``mask``.

        Returns:
            ``(loss, metrics)``: a scalar tensor to minimise and a dict of floats.
        """
        ...
