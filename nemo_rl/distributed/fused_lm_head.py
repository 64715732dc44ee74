"""Token log-probabilities straight from hidden states: the LM head's matmul fused with the
log-softmax, chunk by chunk, so the ``[tokens, vocab]`` logits never exist in full.

``token_logprobs(hidden, weight, targets, ...)`` equals ``log_softmax(hidden @ weight.T)``
gathered at ``targets`` (the output layer followed by
:func:`nemo_rl.distributed.model_utils.from_parallel_logits_to_logprobs`), computed over
``chunk_size`` tokens at a time: per chunk the logits ``[chunk, vocab / TP]`` are formed in the
weight's dtype (as the output layer's matmul does), turned into float32 statistics and dropped.
The backward recomputes each chunk's logits from the saved hidden states and weight, so it keeps
only ``[tokens]`` statistics between forward and backward, never ``[tokens, vocab]`` logits or
their float32 copy and gradient.

Sampling distribution (:mod:`nemo_rl.distributed.sampling`): each chunk's logits are divided
by the temperature (forward and backward); with top-k / top-p each chunk goes through
:func:`~nemo_rl.distributed.model_utils.truncated_logprobs` under activation checkpointing
instead of the hand-written backward.

Tensor parallelism: ``weight`` is this rank's vocabulary rows ``[vocab / TP, hidden]`` (the
output layer is column-parallel over the vocabulary); the maximum, the sum of exponentials and
the target logit are all-reduced over ``tp_group`` per chunk, as in ``model_utils``. ``hidden``
must already be the output layer's input on this rank (the full sequence, replicated over TP);
its gradient is this rank's share (the caller's TP region sums it, as the output layer's input
mapping does), and ``weight``'s gradient is the gradient of this rank's rows.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.utils.checkpoint
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from nemo_rl.distributed.model_utils import (
    ProcessGroup,
    _all_reduce,
    _chunks,
    _local_target,
    truncated_logprobs,
)
from nemo_rl.distributed.sampling import PLAIN_SAMPLING, TrainingSamplingParams

# Tokens whose logits exist at once (per TP rank: chunk x vocab / TP float32 values); NeMo RL's
# logprob_chunk_size default on the Megatron path.
DEFAULT_CHUNK_TOKENS = 1024


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """Float32 ``[n, vocab / TP]`` logits of one chunk, divided by ``temperature`` (not
    touched at 1.0, so that path stays bitwise the un-scaled one)."""
    logits = (hidden @ weight.t()).float()
    return logits if temperature == 1.0 else logits.div_(temperature)


def _chunk_stats(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab_start: int, group: ProcessGroup | None,
    temperature: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Float32 ``(lse, target_logit, in_vocab)`` ``[n]`` of one chunk of ``n`` tokens (logits
    divided by ``temperature``), reduced over ``group``."""
    logits = _chunk_logits(hidden, weight, temperature)
    idx, in_range = _local_target(targets, vocab_start, logits.shape[-1])
    target_logit = logits.gather(-1, idx).squeeze(-1).masked_fill_(~in_range, 0.0)
    local_max = logits.amax(dim=-1).contiguous()
    global_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
    sum_exp = logits.sub_(global_max.unsqueeze(-1)).exp_().sum(dim=-1)
    stacked = torch.stack((sum_exp, target_logit, in_range.float()))
    _all_reduce(stacked, dist.ReduceOp.SUM, group)
    return global_max + stacked[0].log(), stacked[1], stacked[2]


def _forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab_start: int,
    group: ProcessGroup | None, chunk_size: int | None, temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(logprobs, lse)``, float32 ``[n]`` each, of ``n`` tokens.

    Raises:
        ValueError: a target no rank's vocabulary shard holds (raised on every rank).
    """
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    out = torch.empty_like(lse)
    counts = torch.empty_like(lse)
    for start, end in _chunks(n, chunk_size):
        chunk_lse, target_logit, count = _chunk_stats(
            hidden[start:end], weight, targets[start:end], vocab_start, group, temperature
        )
        lse[start:end] = chunk_lse
        out[start:end] = target_logit - chunk_lse
        counts[start:end] = count
    _check_coverage(counts, targets, vocab_start, weight.shape[0])
    return out, lse


def _check_coverage(counts: Tensor, targets: Tensor, vocab_start: int, width: int) -> None:
    """Raise unless every target was found in exactly one rank's rows (``counts`` ``[n]``,
    reduced over the ranks, so that all ranks raise together)."""
    bad = counts != 1
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target token {int(targets[i])} (token {i} of {targets.numel()}) is outside the "
            f"vocabulary: no tensor-parallel rank holds it (this rank holds [{vocab_start}, "
            f"{vocab_start + width})); token ids must lie in [0, vocab_size)"
        )


class _FusedLMHeadLogprobs(torch.autograd.Function):
    """Forward: :func:`_forward`. Backward, per chunk: the logits again, ``d logprob / d logit
    = onehot - softmax`` scaled by the incoming gradient, cast to the weight's dtype (where the
    un-fused path's ``logits.float()`` casts it back), then ``d hidden = g @ W`` and
    ``d W += g.T @ hidden`` (accumulated in float32, cast once)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        vocab_start: int,
        group: ProcessGroup | None,
        chunk_size: int | None,
        temperature: float,
    ) -> Tensor:
        out, lse = _forward(hidden, weight, targets, vocab_start, group, chunk_size, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.vocab_start, ctx.chunk_size, ctx.temperature = vocab_start, chunk_size, temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for start, end in _chunks(hidden.shape[0], ctx.chunk_size):
            x = hidden[start:end]
            g = grad_out[start:end].float()
            logits = _chunk_logits(x, weight, ctx.temperature)
            grad_logits = logits.sub_(lse[start:end].unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
            idx, in_range = _local_target(targets[start:end], ctx.vocab_start, weight.shape[0])
            grad_logits.scatter_add_(-1, idx, (g * in_range).unsqueeze(-1))
            if ctx.temperature != 1.0:  # d (logit / T) / d logit
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t() @ x)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_start_index: int,
    tp_group: ProcessGroup | None,
    chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
    inference_only: bool = False,
    sampling: TrainingSamplingParams = PLAIN_SAMPLING,
) -> Tensor:
    """``log softmax(hidden @ weight.T)[targets]`` per token, without the full logits; under
    ``sampling`` the logprob of the engines' sampling distribution instead: logits divided by
    the temperature, then (top-k / top-p) truncated and renormalised
    (:func:`~nemo_rl.distributed.model_utils.truncated_logprobs`), ``-inf`` for a target
    outside the kept set.

    With truncation each chunk runs under activation checkpointing: its logits are formed
    again in the backward instead of being kept, so memory stays ``[chunk, vocab / TP]``.

    Args:
        hidden: ``[n, h]`` the output layer's input, one row per scored token.
        weight: ``[vocab / TP, h]`` this rank's rows of the output layer (the embedding when
            tied), in the compute dtype.
        targets: ``[n]`` the token id each row scores (global ids).
        vocab_start_index: first token id of this rank's rows.
        tp_group: the group the vocabulary is split over; None: not split.
        chunk_size: tokens whose logits exist at once; None: all ``n`` together.
        inference_only: build no autograd graph.
        sampling: the distribution scored; the default is the model's own.

    Returns:
        ``[n]`` float32 log-probabilities (nats).

    Raises:
        ValueError: mismatched shapes, a non-positive ``chunk_size``, or a target outside the
            vocabulary.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden [n, h] and weight [vocab / TP, h] must share h; got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if tuple(targets.shape) != (hidden.shape[0],):
        raise ValueError(f"targets must be [n] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    no_grad = inference_only or not (
        torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    )
    if sampling.truncates:
        with torch.no_grad() if no_grad else nullcontext():
            return _truncated(
                hidden, weight, targets, vocab_start_index, tp_group, chunk_size, sampling,
                checkpoint=not no_grad,
            )
    temperature = sampling.temperature
    if no_grad:
        with torch.no_grad():
            return _forward(
                hidden, weight, targets, vocab_start_index, tp_group, chunk_size, temperature
            )[0]
    return _FusedLMHeadLogprobs.apply(
        hidden, weight, targets, vocab_start_index, tp_group, chunk_size, temperature
    )


def _truncated(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab_start: int,
    group: ProcessGroup | None, chunk_size: int | None, sampling: TrainingSamplingParams,
    checkpoint: bool,
) -> Tensor:
    """``[n]`` float32 truncated-distribution logprobs, chunk by chunk; each chunk under
    activation checkpointing when ``checkpoint`` (its logits recomputed in the backward)."""

    def chunk_logprobs(x: Tensor, chunk_targets: Tensor) -> tuple[Tensor, Tensor]:
        logits = _chunk_logits(x, weight, sampling.temperature)
        return truncated_logprobs(
            logits, chunk_targets, vocab_start, group, sampling.top_k, sampling.top_p,
            widen=True,
        )

    parts, counts = [], []
    for start, end in _chunks(hidden.shape[0], chunk_size):
        args = (hidden[start:end], targets[start:end])
        if checkpoint:
            logprob, count = torch.utils.checkpoint.checkpoint(
                chunk_logprobs, *args, use_reentrant=False
            )
        else:
            logprob, count = chunk_logprobs(*args)
        parts.append(logprob.float())
        counts.append(count)
    all_counts = torch.cat(counts) if counts else hidden.new_zeros(0)
    _check_coverage(all_counts, targets, vocab_start, weight.shape[0])
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
