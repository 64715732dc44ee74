"""Cross-entropy of a draft (speculative-decoding) model against the target model's soft labels."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl.algorithms.loss._common import (
    check_tensor,
    global_count,
    global_token_mean,
    take_inputs,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

_OWNER = "DraftCrossEntropyLoss"
_INPUTS = ("teacher_logits", "student_logits", "mask")


class DraftCrossEntropyLoss:
    """Token-level soft cross-entropy ``-sum_v softmax(teacher)_v * log_softmax(student)_v``.

    Inputs: ``teacher_logits`` and ``student_logits`` [B, S, V] (full vocabulary, same token
    order), ``mask`` [B, S] (1 where the draft is trained). When ``data`` holds ``sample_mask``
    [B] it multiplies ``mask``. The teacher is a constant (no gradient). The loss is the sum
    over masked positions / ``global_valid_toks`` (nats per token).

    Metrics (additive over micro-batches): ``loss``; ``top1_agreement`` (fraction of valid
    positions where the student's argmax equals the teacher's); ``num_valid_tokens`` (count).
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DRAFT

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global draft cross-entropy and its metrics."""
        teacher, student, mask = take_inputs(kwargs, _INPUTS, _OWNER)
        if not isinstance(student, torch.Tensor) or student.dim() != 3:
            got = list(student.shape) if isinstance(student, torch.Tensor) else type(student).__name__
            raise ValueError(f"'student_logits' must be a tensor of shape [batch, seq, vocab], got {got}")
        batch, seq, vocab = student.shape
        check_tensor(student, "student_logits", (batch, seq, vocab), "[batch, seq, vocab]", floating=True)
        check_tensor(teacher, "teacher_logits", (batch, seq, vocab), "[batch, seq, vocab]", floating=True)
        mask = check_tensor(mask, "mask", (batch, seq), "[batch, seq]", floating=False).to(student.dtype)
        if "sample_mask" in data:
            rows = check_tensor(data["sample_mask"], "sample_mask", (batch,), "[batch]", floating=False)
            mask = mask * rows.to(student.dtype)[:, None]
        global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")

        soft_labels = torch.softmax(teacher.detach().to(student.dtype), dim=-1)
        per_token = -(soft_labels * torch.log_softmax(student, dim=-1)).sum(-1)
        loss = global_token_mean(per_token, mask, toks)
        with torch.no_grad():
            agree = (student.argmax(-1) == teacher.argmax(-1)).to(student.dtype)
            metrics = {
                "loss": float(loss),
                "top1_agreement": float(global_token_mean(agree, mask, toks)),
                "num_valid_tokens": float(mask.sum()),
            }
        return loss, metrics
