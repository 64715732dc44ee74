"""Negative log-likelihood (SFT) loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl.algorithms.loss._common import (
    global_count,
    global_token_mean,
    logprob_input,
    sample_mask,
    valid_token_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

_OWNER = "NLLLoss"


class NLLLoss:
    """Token-level NLL: ``-sum(lp * token_mask * sample_mask) / global_valid_toks``.

    Input: ``next_token_logprobs`` [B, S]. Data keys: ``token_mask`` [B, S], ``sample_mask`` [B].
    Metrics (additive over micro-batches): ``loss``; ``num_unmasked_tokens`` (count of valid
    tokens); ``num_valid_samples`` (count of samples with sample_mask 1).
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.LOGPROB

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global NLL and its metrics."""
        lp = logprob_input(kwargs, _OWNER)
        global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")
        mask = valid_token_mask(data, lp.shape[0], lp.shape[1], lp.dtype)
        loss = global_token_mean(-lp, mask, toks)
        metrics = {
            "loss": float(loss.detach()),
            "num_unmasked_tokens": float(mask.sum()),
            "num_valid_samples": float(sample_mask(data, lp.shape[0], lp.dtype).sum()),
        }
        return loss, metrics
