"""Direct Preference Optimisation (sigmoid loss) with an optional SFT term on the chosen.

Rows come in pairs: even rows are chosen responses, odd rows the rejected response of the
same prompt (row 2i chosen, row 2i+1 rejected). For each row, ``s`` is the sum over its valid
tokens of the policy logprobs, or their mean with ``preference_average_log_probs``; ``s_ref`` is
the same for ``reference_policy_logprobs``. The implicit reward is
``reward = beta * (s - s_ref)`` (``beta * s`` with ``reference_free``) and the pair's loss is
``-logsigmoid(reward_chosen - reward_rejected)``. The SFT term is the NLL of the chosen row
(token sum, or mean with ``sft_average_log_probs``). The total is
``preference_loss_weight * preference + sft_loss_weight * sft``, each averaged over valid pairs:
a micro-batch divides its sum over pairs by ``global_valid_seqs / 2`` (``global_valid_seqs``
counts valid rows, so two per pair).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch
import torch.nn.functional as F

from nemo_rl.algorithms.loss._common import (
    config_to_dict,
    data_tensor,
    global_count,
    logprob_input,
    masked_sum,
    safe_divide,
    sample_mask,
    valid_token_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class DPOLossConfig(TypedDict):
    """Configuration of :class:`DPOLossFn`."""

    reference_policy_kl_penalty: float
    """beta: scale of the implicit reward; > 0."""
    preference_loss_weight: float
    """Weight of the preference (sigmoid) term."""
    sft_loss_weight: float
    """Weight of the NLL term on the chosen responses; 0 disables it."""
    preference_average_log_probs: bool
    """Use the mean instead of the sum of token logprobs in the implicit reward."""
    sft_average_log_probs: bool
    """Use the mean instead of the sum of token logprobs in the SFT term."""
    reference_free: NotRequired[bool]
    """Drop the reference model: reward = beta * s (default False)."""


_REQUIRED = (
    "reference_policy_kl_penalty",
    "preference_loss_weight",
    "sft_loss_weight",
    "preference_average_log_probs",
    "sft_average_log_probs",
)
_DEFAULTS: dict[str, Any] = {"reference_free": False}
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
        c = config_to_dict(cfg, owner=_OWNER, required=_REQUIRED, defaults=_DEFAULTS)
        self.beta = float(c["reference_policy_kl_penalty"])
        self.preference_weight = float(c["preference_loss_weight"])
        self.sft_weight = float(c["sft_loss_weight"])
        self.preference_average = bool(c["preference_average_log_probs"])
        self.sft_average = bool(c["sft_average_log_probs"])
        self.reference_free = bool(c["reference_free"])
        if self.beta <= 0:
            raise ValueError(f"{_OWNER}: reference_policy_kl_penalty (beta) must be > 0, got {self.beta}")

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global DPO loss and its metrics."""
        lp = logprob_input(kwargs, _OWNER)
        batch, seq = lp.shape
        if batch % 2:
            raise ValueError(
                f"{_OWNER}: 'next_token_logprobs' needs an even batch (chosen/rejected pairs), got {batch} rows"
            )
        pairs = global_count(global_valid_seqs, "global_valid_seqs").to(lp.dtype) / 2
        global_count(global_valid_toks, "global_valid_toks")
        rows = sample_mask(data, batch, lp.dtype)
        if not torch.equal(rows[0::2], rows[1::2]):
            raise ValueError(f"{_OWNER}: 'sample_mask' must be equal for the chosen and rejected row of each pair")
        mask = valid_token_mask(data, batch, seq, lp.dtype)
        counts = mask.sum(-1).clamp_min(1)

        def sequence_score(logprobs: torch.Tensor, average: bool) -> torch.Tensor:
            total = masked_sum(logprobs, mask, dim=-1)
            return total / counts if average else total

        score = sequence_score(lp, self.preference_average)
        if not self.reference_free:
            ref = data_tensor(data, "reference_policy_logprobs", (batch, seq), _BS, floating=True).to(lp.dtype)
            score = score - sequence_score(ref, self.preference_average)
        rewards = self.beta * score
        chosen, rejected = rewards[0::2], rewards[1::2]
        pair_valid = rows[0::2]

        def pair_mean(values: torch.Tensor) -> torch.Tensor:
            return safe_divide(masked_sum(values, pair_valid), pairs)

        preference = pair_mean(-F.logsigmoid(chosen - rejected))
        sft = pair_mean(-sequence_score(lp, self.sft_average)[0::2])
        loss = self.preference_weight * preference + self.sft_weight * sft
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "preference_loss": float(preference),
                "sft_loss": float(sft),
                "rewards_chosen_mean": float(pair_mean(chosen)),
                "rewards_rejected_mean": float(pair_mean(rejected)),
                "accuracy": float(pair_mean((chosen > rejected).to(lp.dtype))),
                "num_valid_samples": float(rows.sum()),
            }
        return loss, metrics
