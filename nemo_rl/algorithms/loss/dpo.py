"""Direct Preference Optimisation (sigmoid loss) with an optional SFT term on the chosen.

Rows come in pairs: even rows are chosen responses, odd rows the rejected response of the
same prompt (row 2i chosen, row 2i+1 rejected). For each row, ``s`` is the sum over its valid
tokens of the policy logprobs, or their mean with ``preference_average_log_probs``; ``s_ref`` is
the same for ``reference_policy_logprobs``. The implicit reward is
``reward = beta * (s - s_ref)`` (``beta * s`` with ``reference_free``) and the pair's loss is
``-logsigmoid(reward_chosen - reward_rejected)`` (:func:`~nemo_rl.algorithms.loss.preference.
bradley_terry`). The SFT term is the NLL of the chosen row
(token sum, or mean with ``sft_average_log_probs``). The total is
``preference_loss_weight * preference + sft_loss_weight * sft``, each averaged over valid pairs:
a micro-batch divides its sum over pairs by ``global_valid_seqs / 2`` (``global_valid_seqs``
counts valid rows, so two per pair).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from nemo_rl.algorithms.loss._common import (
    data_tensor,
    global_count,
    logprob_input,
    masked_sum,
    valid_token_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_rl.algorithms.loss.preference import Pairs, bradley_terry
from nemo_rl.utils.config import ConfigModel, as_config

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class DPOLossConfig(ConfigModel):
    """Configuration of :class:`DPOLossFn` (the ``dpo`` loss section, NeMo RL key names)."""

    reference_policy_kl_penalty: float = Field(
        default=0.05, gt=0.0, description="beta: scale of the implicit reward; > 0."
    )
    preference_loss_weight: float = Field(
        default=1.0, ge=0.0, description="Weight of the preference (sigmoid) term."
    )
    sft_loss_weight: float = Field(
        default=0.0, ge=0.0, description="Weight of the NLL term on the chosen responses; 0: off."
    )
    preference_average_log_probs: bool = Field(
        default=False,
        description="Use the mean instead of the sum of token logprobs in the implicit reward.",
    )
    sft_average_log_probs: bool = Field(
        default=False,
        description="Use the mean instead of the sum of token logprobs in the SFT term.",
    )
    reference_free: bool = Field(
        default=False, description="Drop the reference model: reward = beta * s."
    )


_OWNER = "DPOLossFn"
_BS = "[batch, seq]"


class DPOLossFn:
    """DPO loss; see the module docstring.

    Input: ``next_token_logprobs`` [B, S], B even, pairs adjacent. Data keys: ``token_mask``
    [B, S], ``sample_mask`` [B] (equal within a pair), ``reference_policy_logprobs`` [B, S]
    (unless ``reference_free``).

    Metrics (additive over micro-batches; means are over the global valid pairs): ``loss``,
    ``preference_loss``, ``sft_loss``, ``rewards_chosen_mean``, ``rewards_rejected_mean``,
    ``accuracy`` (fraction of pairs with reward_chosen > reward_rejected), ``num_valid_samples``
    (count of valid rows).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB

    def __init__(self, cfg: DPOLossConfig | Mapping[str, Any]) -> None:
        """``cfg``: the config model, or a mapping of its keys (missing keys: defaults)."""
        self.cfg = as_config(cfg, DPOLossConfig, owner=_OWNER)

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global DPO loss and its metrics."""
        c = self.cfg
        lp = logprob_input(kwargs, _OWNER)
        batch, seq = lp.shape
        pairs = Pairs.of(data, batch, global_valid_seqs, lp.dtype, _OWNER)
        global_count(global_valid_toks, "global_valid_toks")
        mask = valid_token_mask(data, batch, seq, lp.dtype)
        counts = mask.sum(-1).clamp_min(1)

        def sequence_score(logprobs: torch.Tensor, average: bool) -> torch.Tensor:
            total = masked_sum(logprobs, mask, dim=-1)
            return total / counts if average else total

        score = sequence_score(lp, c.preference_average_log_probs)
        if not c.reference_free:
            ref = data_tensor(data, "reference_policy_logprobs", (batch, seq), _BS, floating=True).to(lp.dtype)
            score = score - sequence_score(ref, c.preference_average_log_probs)
        preference, reward_metrics = bradley_terry(c.reference_policy_kl_penalty * score, pairs)
        sft = pairs.mean(-sequence_score(lp, c.sft_average_log_probs)[0::2])
        loss = c.preference_loss_weight * preference + c.sft_loss_weight * sft
        metrics = {
            "loss": float(loss),
            "preference_loss": float(preference),
            "sft_loss": float(sft),
            **reward_metrics,
            "num_valid_samples": float(pairs.rows.sum()),
        }
        return loss, metrics
