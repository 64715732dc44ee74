"""Bradley-Terry preference loss on per-row rewards: the reward model's loss and DPO's
preference term.

Rows come in pairs: row 2i is the chosen response, row 2i+1 the rejected one of the same
prompt. Given a reward ``r`` per row, the pair's loss is ``-log sigmoid(r_chosen - r_rejected)``
(the negative log-likelihood of the observed preference under the Bradley-Terry model). Means
are over the valid pairs of the global batch: a micro-batch divides its sum over pairs by
``global_valid_seqs / 2`` (``global_valid_seqs`` counts valid rows, two per pair).

:class:`PreferenceLossFn` takes the rewards of a reward model's scalar head
(:attr:`~nemo_rl.algorithms.loss.interfaces.LossInputType.REWARD`); DPO
(:mod:`nemo_rl.algorithms.loss.dpo`) applies :func:`bradley_terry` to its implicit rewards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from nemo_rl.algorithms.loss._common import (
    check_tensor,
    global_count,
    masked_sum,
    safe_divide,
    sample_mask,
    take_inputs,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


@dataclass(frozen=True)
class Pairs:
    """The (chosen, rejected) pairs of a micro-batch of ``B`` rows.

    Attributes:
        rows: ``[B]`` sample mask of the rows.
        valid: ``[B / 2]`` 1 for the pairs that count.
        global_pairs: valid pairs of the global batch (scalar).
    """

    rows: torch.Tensor
    valid: torch.Tensor
    global_pairs: torch.Tensor

    @classmethod
    def of(
        cls,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        batch: int,
        global_valid_seqs: torch.Tensor,
        dtype: torch.dtype,
        owner: str,
    ) -> Pairs:
        """The pairs of ``batch`` rows, from ``data['sample_mask']``.

        Raises:
            ValueError: an odd ``batch``, or a pair whose two rows' ``sample_mask`` differ.
        """
        if batch % 2:
            raise ValueError(
                f"{owner}: needs an even batch (chosen/rejected pairs), got {batch} rows"
            )
        rows = sample_mask(data, batch, dtype)
        if not torch.equal(rows[0::2], rows[1::2]):
            raise ValueError(
                f"{owner}: 'sample_mask' must be equal for the chosen and rejected row of each pair"
            )
        pairs = global_count(global_valid_seqs, "global_valid_seqs").to(dtype) / 2
        return cls(rows, rows[0::2], pairs)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Micro-batch share of the mean of per-pair ``values`` ``[B / 2]`` over the global
        valid pairs."""
        return safe_divide(masked_sum(values, self.valid), self.global_pairs)


def bradley_terry(rewards: torch.Tensor, pairs: Pairs) -> tuple[torch.Tensor, dict[str, float]]:
    """``-log sigmoid(r_chosen - r_rejected)`` averaged over the valid pairs, and its metrics.

    Args:
        rewards: ``[B]`` reward of each row, chosen rows even, rejected rows odd.

    Returns:
        ``(loss, metrics)``; metrics (additive over micro-batches) ``rewards_chosen_mean``,
        ``rewards_rejected_mean``, ``accuracy`` (share of pairs with r_chosen > r_rejected:
        ties are not wins).
    """
    chosen, rejected = rewards[0::2], rewards[1::2]
    loss = pairs.mean(-F.logsigmoid(chosen - rejected))
    with torch.no_grad():
        metrics = {
            "rewards_chosen_mean": float(pairs.mean(chosen)),
            "rewards_rejected_mean": float(pairs.mean(rejected)),
            "accuracy": float(pairs.mean((chosen > rejected).to(rewards.dtype))),
        }
    return loss, metrics


_OWNER = "PreferenceLossFn"


class PreferenceLossFn:
    """Bradley-Terry loss of a reward model (NeMo RL's ``PreferenceLoss``); see the module
    docstring.

    Input: ``rewards`` [B] (B even, pairs adjacent). Data keys: ``sample_mask`` [B] (equal
    within a pair).

    Metrics (additive over micro-batches; means over the global valid pairs): ``loss``,
    ``accuracy``, ``rewards_chosen_mean``, ``rewards_rejected_mean``, ``num_valid_samples``
    (count of valid rows).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.REWARD

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global preference loss and its metrics."""
        (rewards,) = take_inputs(kwargs, ("rewards",), _OWNER)
        if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
            got = list(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
            raise ValueError(f"{_OWNER}: 'rewards' must be a tensor of shape [batch], got {got}")
        check_tensor(rewards, "rewards", tuple(rewards.shape), "[batch]", floating=True)
        global_count(global_valid_toks, "global_valid_toks")
        pairs = Pairs.of(data, rewards.shape[0], global_valid_seqs, rewards.dtype, _OWNER)
        loss, metrics = bradley_terry(rewards, pairs)
        return loss, {
            "loss": float(loss),
            **metrics,
            "num_valid_samples": float(pairs.rows.sum()),
        }
