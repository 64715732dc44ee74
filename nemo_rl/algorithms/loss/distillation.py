"""Top-k knowledge distillation: forward, reverse or mixed KL between teacher and student.

At each position the distributions are compared on K+1 outcomes: the teacher's top-k tokens and
one "tail" bucket holding all other tokens. Inputs (natural logs):

- ``teacher_topk_logprobs`` [B, S, K]: log p_teacher of the teacher's top-k tokens.
- ``student_topk_logprobs`` [B, S, K]: log p_student of the same K tokens (same order).
- ``H_all`` [B, S, 2]: log probability mass outside those K tokens, ``H_all[..., 0]`` for
  the student and ``H_all[..., 1]`` for the teacher, i.e. ``log(1 - sum_k p_k)``. Callers
  compute it stably from full (possibly vocab-parallel) logits as
  ``logsumexp(logits outside top-k) - logsumexp(all logits)``; it may be -inf (no tail mass).

With ``P`` the teacher and ``Q`` the student over the K+1 outcomes:
forward KL = KL(P || Q) = sum P (log P - log Q); reverse KL = KL(Q || P); mixed =
``(1 - mixed_kl_weight) * forward + mixed_kl_weight * reverse``. Outcomes with zero probability
in the first argument contribute 0. The loss is token-level: sum over valid tokens /
``global_valid_toks``. Gradients flow into the student inputs (``student_topk_logprobs`` and
``H_all[..., 0]``); the teacher inputs are treated as constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field

from nemo_rl.algorithms.loss._common import (
    check_tensor,
    global_count,
    global_token_mean,
    sample_mask,
    take_inputs,
    valid_token_mask,
)
from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType
from nemo_rl.utils.config import ConfigModel, as_config

if TYPE_CHECKING:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class DistillationLossConfig(ConfigModel):
    """Configuration of :class:`DistillationLossFn` (NeMo RL key names)."""

    kl_type: Literal["forward", "reverse", "mixed"] = Field(
        default="forward",
        description='"forward": KL(teacher || student), "reverse": KL(student || teacher), '
        '"mixed": (1 - mixed_kl_weight) * forward + mixed_kl_weight * reverse.',
    )
    mixed_kl_weight: float = Field(
        default=0.5,
        ge=0.0,
        le=1.0,
        description='Weight of the reverse KL with kl_type "mixed", in [0, 1]; ignored otherwise.',
    )
    zero_outside_topk: bool = Field(
        default=False,
        description="How the policy worker forms the loss inputs: true keeps both models' "
        "full-vocabulary probabilities of the teacher's top-k tokens plus one tail outcome "
        "(the rest of the vocabulary); false renormalises both over the k tokens (no tail).",
    )
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        description="Both models' logits are divided by it before the softmax (teacher top-k "
        "and student); 1 compares the models' own distributions.",
    )


_OWNER = "DistillationLossFn"
_INPUTS = ("student_topk_logprobs", "teacher_topk_logprobs", "H_all")


def _kl_with_tail(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim of [..., K+1] log-probabilities; 0 * log 0 terms are 0."""
    p = torch.exp(log_p)
    present = p > 0
    safe_log_p = torch.where(present, log_p, torch.zeros_like(log_p))
    safe_log_q = torch.where(present, log_q, torch.zeros_like(log_q))
    return torch.where(present, p * (safe_log_p - safe_log_q), torch.zeros_like(p)).sum(-1)


class DistillationLossFn:
    """Top-k distillation loss; see the module docstring.

    Data keys: ``token_mask`` [B, S], ``sample_mask`` [B]. Metrics (additive over micro-batches,
    token means over ``global_valid_toks``): ``loss``, ``forward_kl``, ``reverse_kl`` (nats per
    token), ``num_valid_samples``.
    """

    loss_type = LossType.TOKEN_LEVEL
    input_type = LossInputType.DISTILLATION

    def __init__(self, cfg: DistillationLossConfig | Mapping[str, Any]) -> None:
        """``cfg``: the config model, or a mapping of its keys (missing keys: defaults)."""
        self.cfg = as_config(cfg, DistillationLossConfig, owner=_OWNER)

    def __call__(
        self,
        data: BatchedDataDict | Mapping[str, torch.Tensor],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Micro-batch share of the global distillation loss and its metrics."""
        student, teacher, tail = take_inputs(kwargs, _INPUTS, _OWNER)
        if not isinstance(student, torch.Tensor) or student.dim() != 3:
            got = list(student.shape) if isinstance(student, torch.Tensor) else type(student).__name__
            raise ValueError(f"'student_topk_logprobs' must be a tensor of shape [batch, seq, k], got {got}")
        batch, seq, k = student.shape
        check_tensor(student, "student_topk_logprobs", (batch, seq, k), "[batch, seq, k]", floating=True)
        check_tensor(teacher, "teacher_topk_logprobs", (batch, seq, k), "[batch, seq, k]", floating=True)
        check_tensor(tail, "H_all", (batch, seq, 2), "[batch, seq, 2] (student, teacher log tail mass)", floating=True)
        global_count(global_valid_seqs, "global_valid_seqs")
        toks = global_count(global_valid_toks, "global_valid_toks")
        mask = valid_token_mask(data, batch, seq, student.dtype)

        log_q = torch.cat([student, tail[..., :1]], dim=-1)
        log_p = torch.cat([teacher, tail[..., 1:]], dim=-1).detach().to(student.dtype)
        forward = _kl_with_tail(log_p, log_q)
        reverse = _kl_with_tail(log_q, log_p)
        if self.cfg.kl_type == "forward":
            per_token = forward
        elif self.cfg.kl_type == "reverse":
            per_token = reverse
        else:
            weight = self.cfg.mixed_kl_weight
            per_token = (1.0 - weight) * forward + weight * reverse
        loss = global_token_mean(per_token, mask, toks)
        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "forward_kl": float(global_token_mean(forward, mask, toks)),
                "reverse_kl": float(global_token_mean(reverse, mask, toks)),
                "num_valid_samples": float(sample_mask(data, batch, student.dtype).sum()),
            }
        return loss, metrics
