"""Top-k distillation on vocab-parallel logits: the teacher's top-k, and the student's loss inputs.

Both follow the logprob convention of :mod:`~nemo_rl.models.policy.workers.megatron.forward`:
row position ``t`` holds the distribution over token ``t`` given tokens ``< t`` (computed from
the logits at ``t - 1``), and is zero at ``t = 0`` and at ``t >= input_lengths``, so the
``[B, S, k]`` tensors line up with ``input_ids`` and ``token_mask``.

- :func:`teacher_topk` (the teacher, no grad): the ``k`` most probable tokens of every position,
  as ``(logprobs [B, S, k], token ids [B, S, k])``; log-probabilities over the whole vocabulary
  at the loss's temperature, so they are also the teacher's top-k logits up to a per-position
  constant. Only these travel to the student, never ``[B, S, vocab]``.
- :func:`distillation_loss_inputs` (the student, differentiable): the keyword arguments of
  :class:`~nemo_rl.algorithms.loss.DistillationLossFn` from the student's logits and the
  teacher's top-k. With ``zero_outside_topk`` the two distributions keep their full-vocabulary
  probabilities and the rest of the vocabulary is one tail outcome (``H_all``); without it both
  are renormalised over the teacher's k tokens (no tail), as in NeMo RL.

Padded micro-batches without context parallelism only (the recipe's config refuses the others).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from nemo_rl.distributed.model_utils import (
    distributed_topk_logits,
    gather_at_global_indices,
    vocab_parallel_logsumexp,
)
from nemo_rl.models.policy.workers.megatron.forward import ModelInputs

# Smallest log tail mass of the teacher (1e-30): its top-k mass may round to 1 in float32.
LOG_TAIL_FLOOR = -69.0


def _tp() -> tuple[int, object]:
    """(this rank's index in the tensor-parallel group, that group)."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()


def _check_layout(inputs: ModelInputs) -> None:
    if inputs.next_targets is not None or inputs.sample_offsets is not None:
        raise ValueError(
            "top-k distillation supports padded micro-batches without context parallelism; "
            "set policy.sequence_packing.enabled=false and context_parallel_size=1"
        )


def _valid_positions(inputs: ModelInputs, device: torch.device) -> Tensor:
    """``[B, S]`` bool: positions ``1 <= t < input_lengths`` (a token with a predecessor)."""
    t = torch.arange(inputs.seq_len, device=device)
    return (t[None, :] >= 1) & (t[None, :] < inputs.lengths.to(device)[:, None])


def _to_token_positions(per_logit: Tensor, inputs: ModelInputs) -> Tensor:
    """``[B, s, k]`` values at logit positions -> ``[B, S, k]`` at the positions they predict
    (shifted one right; zero at invalid positions)."""
    values = per_logit[:, : inputs.seq_len]
    shifted = torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)
    valid = _valid_positions(inputs, values.device)[..., None]
    return torch.where(valid, shifted, torch.zeros_like(shifted))


def teacher_topk(logits: Tensor, inputs: ModelInputs, k: int, temperature: float) -> tuple[Tensor, Tensor]:
    """The teacher's top-``k`` of a micro-batch (see the module docstring).

    Args:
        logits: ``[B, s, V / TP]`` this TP rank's logits.
        k: tokens per position, ``1 <= k <= vocab``.
        temperature: the logits are divided by it before the softmax.

    Returns:
        ``(logprobs [B, S, k] float32, token ids [B, S, k] int64)``, sorted by descending
        probability.
    """
    _check_layout(inputs)
    tp_rank, tp_group = _tp()
    scaled = logits.float() / temperature
    values, ids = distributed_topk_logits(scaled, k, tp_rank * scaled.shape[-1], tp_group)
    logprobs = values - vocab_parallel_logsumexp(scaled, tp_group)[..., None]
    return _to_token_positions(logprobs, inputs), _to_token_positions(ids, inputs)


def distillation_loss_inputs(
    logits: Tensor,
    inputs: ModelInputs,
    data: Mapping[str, Tensor],
    temperature: float,
    zero_outside_topk: bool,
) -> dict[str, Tensor]:
    """``student_topk_logprobs``, ``teacher_topk_logprobs`` ``[B, S, k]`` and ``H_all``
    ``[B, S, 2]`` (student, teacher log tail mass) of a micro-batch.

    Args:
        logits: ``[B, s, V / TP]`` the student's logits on this TP rank (with grad).
        data: the micro-batch's ``teacher_topk_logits`` (the teacher's logprobs, as
            :func:`teacher_topk` gives them) and ``teacher_topk_indices``, ``[B, S, k]``.
        temperature: the student's logits are divided by it (the teacher's already were).
        zero_outside_topk: keep full-vocabulary probabilities with a tail outcome; False:
            renormalise both over the k tokens.
    """
    _check_layout(inputs)
    tp_rank, tp_group = _tp()
    teacher = data["teacher_topk_logits"].to(logits.device).float()
    ids = data["teacher_topk_indices"].to(logits.device).long()
    scaled = logits.float() / temperature
    start = tp_rank * scaled.shape[-1]
    # the ids scored at logit position t are those of token t + 1
    at_logits = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    picked = _to_token_positions(gather_at_global_indices(scaled, at_logits, start, tp_group), inputs)
    valid = _valid_positions(inputs, scaled.device)
    no_tail = torch.full(valid.shape, float("-inf"), device=scaled.device)
    if not zero_outside_topk:
        student = torch.log_softmax(picked, dim=-1)
        teacher = torch.log_softmax(teacher, dim=-1)
        return {
            "student_topk_logprobs": student,
            "teacher_topk_logprobs": teacher,
            "H_all": torch.stack([no_tail, no_tail], dim=-1),
        }
    lse = vocab_parallel_logsumexp(scaled, tp_group)
    # log mass of the tokens outside the top-k: logsumexp with the k tokens masked out
    width = scaled.shape[-1]
    local = at_logits - start
    mine = ((local >= 0) & (local < width)).float()
    hits = torch.zeros_like(scaled).scatter_add_(-1, local.clamp(0, width - 1), mine)
    tail = vocab_parallel_logsumexp(scaled.masked_fill(hits > 0, float("-inf")), tp_group)
    student_lse = _to_token_positions(lse[..., None], inputs)
    student_tail = _to_token_positions((tail - lse)[..., None], inputs)[..., 0]
    teacher_mass = teacher.exp().sum(-1).clamp(max=1.0)
    # floored: a teacher mass that rounds to 1 would make the reverse KL of the tail infinite
    teacher_tail = torch.log1p(-teacher_mass).clamp(min=LOG_TAIL_FLOOR)
    return {
        "student_topk_logprobs": picked - student_lse,
        "teacher_topk_logprobs": teacher,
        "H_all": torch.stack(
            [torch.where(valid, student_tail, no_tail), torch.where(valid, teacher_tail, no_tail)],
            dim=-1,
        ),
    }
