"""Log-probabilities of target tokens from vocab-parallel logits, without gathering the vocab.

Under tensor parallelism (TP) the output layer leaves each rank with a slice of the vocabulary:
rank r holds logits for token ids ``[vocab_start_index, vocab_end_index)``. The functions here
compute per-token log-probabilities (and top-k views) from those shards with a few collectives
over per-position statistics ([batch, seq] tensors), never a [batch, seq, vocab] all-gather.

Conventions shared by every function:

* ``vocab_parallel_logits`` is [batch, seq, vocab / TP]; ``target`` is [batch, seq] token ids.
* Next-token alignment: ``out[:, t]`` is ``log p(target[:, t] | tokens < t)``, computed from the
  logits at position ``t - 1``; ``out[:, 0]`` is 0 (nothing predicts the first token). The output
  has the input's length so it lines up with ``target`` and its masks.
* ``tp_group=None`` means no tensor parallelism (the local shard is the whole vocabulary); it is
  not a shortcut for the default process group. A group of world size 1 is the same case. Both
  run the same code as TP > 1, minus the collectives.
* The loss is assumed replicated over the TP group (every rank computes the same loss from the
  same reduced values), as in Megatron-Core; each rank's gradient is d(loss)/d(its own shard).
* Statistics are accumulated in float32 for bfloat16/float16 logits (float64 stays float64), and
  log-probabilities are returned in that accumulation dtype.
* Collectives work with gloo and NCCL; every tensor handed to one is contiguous (gloo silently
  mishandles non-contiguous buffers).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

ProcessGroup = dist.ProcessGroup

# Candidates gathered per rank for nucleus (top-p) filtering when no top-k is given. The kept set
# must fit in the TP * cap globally largest logits; otherwise ``masked_logprobs`` raises.
DEFAULT_TOP_P_CANDIDATES = 1024


def vocab_range_for_rank(vocab_size_padded: int, rank: int, world_size: int) -> tuple[int, int]:
    """Token-id range ``[start, end)`` that ``rank`` holds when ``world_size`` ranks split the vocab.

    Args:
        vocab_size_padded: vocabulary size after padding; must be divisible by ``world_size``.
        rank: rank within the tensor-parallel group, ``0 <= rank < world_size``.
        world_size: tensor-parallel group size, >= 1.

    Raises:
        ValueError: a non-positive size, a rank outside the group, or an indivisible vocab.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if vocab_size_padded < 1 or vocab_size_padded % world_size:
        raise ValueError(
            f"vocab_size_padded must be a positive multiple of world_size={world_size}, got "
            f"{vocab_size_padded}; pad the vocabulary (Megatron pads to a multiple of "
            f"make_vocab_size_divisible_by * TP)"
        )
    per_rank = vocab_size_padded // world_size
    return rank * per_rank, (rank + 1) * per_rank


def _group_size_rank(group: ProcessGroup | None) -> tuple[int, int]:
    """(world size, rank) of ``group``; (1, 0) for ``None``."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce a contiguous tensor in place over ``group`` (no-op without a TP group)."""
    if _group_size_rank(group)[0] > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32 for 16-bit floats, else the input's float dtype."""
    return torch.promote_types(dtype, torch.float32)


def _validate(
    logits: torch.Tensor, target: torch.Tensor, vocab_start_index: int, vocab_end_index: int
) -> None:
    """Check shapes, dtypes and the vocab range shared by every entry point."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            "vocab_parallel_logits must be a floating-point tensor of shape [batch, seq, vocab/TP], "
            f"got {type(logits).__name__} {tuple(getattr(logits, 'shape', ()))}"
        )
    batch, seq, local_vocab = logits.shape
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != (batch, seq):
        raise ValueError(
            f"target must have shape [batch, seq] = [{batch}, {seq}] (vocab_parallel_logits.shape[:2]), "
            f"got {tuple(getattr(target, 'shape', ()))}"
        )
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer token ids, got dtype {target.dtype}; use .long()")
    if vocab_end_index - vocab_start_index != local_vocab or vocab_start_index < 0:
        raise ValueError(
            f"[vocab_start_index, vocab_end_index) = [{vocab_start_index}, {vocab_end_index}) must be a "
            f"non-negative range as wide as the local shard (vocab_parallel_logits.shape[-1] = "
            f"{local_vocab}); see vocab_range_for_rank"
        )


def _local_target(target: torch.Tensor, vocab_start_index: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of each target and whether it lies in this rank's shard.

    Returns:
        (index [..., 1] int64 clamped into the shard, in_range [...] bool).
    """
    shifted = target.long() - vocab_start_index
    in_range = (shifted >= 0) & (shifted < local_vocab)
    return shifted.clamp(0, local_vocab - 1).unsqueeze(-1), in_range


def _chunks(length: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """[start, end) position ranges covering ``range(length)``, each at most ``chunk_size`` long."""
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (sequence positions) or None, got {chunk_size!r}")
    step = length if chunk_size is None else chunk_size
    return [(s, min(s + step, length)) for s in range(0, length, max(step, 1))]


def _check_target_coverage(counts: torch.Tensor, target: torch.Tensor, vocab_start_index: int, vocab_end_index: int) -> None:
    """Raise unless every scored target was found in exactly one rank's shard.

    ``counts`` is [batch, seq-1] after the SUM all-reduce, identical on every rank, so all ranks
    raise together instead of leaving a peer stuck in the next collective.
    """
    bad = counts != 1
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"target[{b}, {t + 1}] = {int(target[b, t + 1])} is outside the vocabulary (no tensor-parallel "
            f"rank holds it; this rank holds [{vocab_start_index}, {vocab_end_index})); target must have "
            f"shape [batch, seq] with ids in [0, vocab_size)"
        )


def _forward_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    group: ProcessGroup | None,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global log-sum-exp and target logit for positions ``0 .. seq-2`` (predicting ``t + 1``).

    Per chunk of positions: MAX all-reduce of the local max, then one SUM all-reduce of the
    stacked [local sum-exp, local target logit (0 if not in this shard), in-shard count].

    Returns:
        (lse [batch, seq-1], target_logit [batch, seq-1], counts [batch, seq-1]), accumulation dtype.
    """
    batch, seq, local_vocab = logits.shape
    dtype = _compute_dtype(logits.dtype)
    lse = torch.empty(batch, seq - 1, dtype=dtype, device=logits.device)
    target_logit = torch.empty_like(lse)
    counts = torch.empty_like(lse)
    spans = _chunks(seq - 1, chunk_size)
    width = max((e - s for s, e in spans), default=0)
    # One work buffer reused by every chunk: no per-chunk allocation (and page faults).
    work = torch.empty(batch, width, local_vocab, dtype=dtype, device=logits.device)
    for start, end in spans:
        chunk = logits[:, start:end]
        buf = work[:, : end - start]
        local_max = chunk.amax(dim=-1).to(dtype).contiguous()
        global_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
        torch.sub(chunk, global_max.unsqueeze(-1), out=buf)
        idx, in_range = _local_target(target[:, start + 1 : end + 1], vocab_start_index, local_vocab)
        stacked = torch.stack(
            (
                buf.exp_().sum(dim=-1),
                chunk.gather(-1, idx).squeeze(-1).to(dtype).masked_fill(~in_range, 0.0),
                in_range.to(dtype),
            )
        )
        _all_reduce(stacked, dist.ReduceOp.SUM, group)
        lse[:, start:end] = global_max + stacked[0].log()
        target_logit[:, start:end] = stacked[1]
        counts[:, start:end] = stacked[2]
    return lse, target_logit, counts


def _logprobs_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    group: ProcessGroup | None,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [batch, seq] (position 0 = 0) and the lse [batch, seq-1] for backward."""
    lse, target_logit, counts = _forward_stats(logits, target, vocab_start_index, group, chunk_size)
    _check_target_coverage(counts, target, vocab_start_index, vocab_end_index)
    out = torch.zeros(logits.shape[:2], dtype=lse.dtype, device=logits.device)
    out[:, 1:] = target_logit - lse
    return out, lse


class _VocabParallelLogprobs(torch.autograd.Function):
    """Autograd wrapper: forward via ``_logprobs_forward``; backward recomputes softmax per chunk.

    Saves only the logits (no copy), the targets and the [batch, seq-1] log-sum-exp.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        group: ProcessGroup | None,
        chunk_size: int | None,
    ) -> torch.Tensor:
        out, lse = _logprobs_forward(logits, target, vocab_start_index, vocab_end_index, group, chunk_size)
        ctx.save_for_backward(logits, target, lse)
        ctx.vocab_start_index = vocab_start_index
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor):  # type: ignore[override]
        logits, target, lse = ctx.saved_tensors
        batch, seq, local_vocab = logits.shape
        dtype = lse.dtype
        grad_logits = torch.empty_like(logits)
        grad_logits[:, -1] = 0  # the last position predicts nothing that is scored
        # Write straight into the gradient when it already has the accumulation dtype;
        # otherwise (16-bit logits) go through one reused float32 chunk buffer.
        in_place = grad_logits.dtype == dtype
        spans = _chunks(seq - 1, ctx.chunk_size)
        width = max((e - s for s, e in spans), default=0)
        work = None if in_place else torch.empty(batch, width, local_vocab, dtype=dtype, device=logits.device)
        for start, end in spans:
            g = grad_out[:, start + 1 : end + 1].to(dtype)
            buf = grad_logits[:, start:end] if work is None else work[:, : end - start]
            # d logprob / d logit_j = onehot_j - softmax_j, softmax recomputed from the global lse.
            torch.sub(logits[:, start:end], lse[:, start:end].unsqueeze(-1), out=buf)
            buf.exp_().mul_(-g.unsqueeze(-1))
            idx, in_range = _local_target(target[:, start + 1 : end + 1], ctx.vocab_start_index, local_vocab)
            buf.scatter_add_(-1, idx, (g * in_range).unsqueeze(-1))
            if work is not None:
                grad_logits[:, start:end] = buf
        return grad_logits, None, None, None, None, None


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: ProcessGroup | None,
    inference_only: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Next-token log-probabilities of ``target`` from vocab-sharded logits.

    Args:
        vocab_parallel_logits: [batch, seq, vocab/TP] logits of this rank's vocab shard.
        target: [batch, seq] token ids (int). ``target[:, 0]`` is never scored; every other id
            must lie in exactly one rank's range, i.e. in ``[0, vocab_size_padded)``.
        vocab_start_index: first token id of this rank's shard.
        vocab_end_index: one past the last token id of this rank's shard.
        tp_group: tensor-parallel group the vocab is split over; ``None`` = not split.
        inference_only: build no autograd graph (nothing saved for backward).
        chunk_size: sequence positions processed at once (all batch rows together). Bounds the
            temporaries of forward and backward to [batch, chunk_size, vocab/TP]; ``None``
            processes the whole sequence as one chunk.

    Returns:
        [batch, seq] log-probabilities (nats) in the accumulation dtype; ``out[:, 0] = 0`` and
        ``out[:, t] = log p(target[:, t] | logits[:, t - 1])``.

    Raises:
        ValueError: wrong shapes, a vocab range that does not match the shard, a non-positive
            ``chunk_size``, or a scored target outside the vocabulary (raised on every rank).
        TypeError: non-integer ``target``.
    """
    _validate(vocab_parallel_logits, target, vocab_start_index, vocab_end_index)
    if inference_only or not (torch.is_grad_enabled() and vocab_parallel_logits.requires_grad):
        with torch.no_grad():
            return _logprobs_forward(
                vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group, chunk_size
            )[0]
    return _VocabParallelLogprobs.apply(
        vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group, chunk_size
    )


class _AllReduceSumReplicated(torch.autograd.Function):
    """SUM all-reduce whose backward is the identity (the loss downstream is replicated per rank)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(tensor.contiguous().clone(), dist.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _AllGatherLastDimReplicated(torch.autograd.Function):
    """All-gather along the last dim in rank order; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        world, rank = _group_size_rank(group)
        ctx.rank, ctx.width = rank, tensor.shape[-1]
        if world == 1:
            return tensor.clone()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None


def _gathered_topk(
    logits: torch.Tensor, k: int, vocab_start_index: int, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-``k`` of vocab-sharded logits: values (differentiable) and global indices, sorted descending."""
    local_k = min(k, logits.shape[-1])
    values, indices = torch.topk(logits, local_k, dim=-1)
    values = _AllGatherLastDimReplicated.apply(values, group)
    indices = _AllGatherLastDimReplicated.apply(indices + vocab_start_index, group)
    top_values, pos = torch.topk(values, k, dim=-1)
    return top_values, indices.gather(-1, pos)


def distributed_topk_logits(
    vocab_parallel_logits: torch.Tensor,
    k: int,
    vocab_start_index: int,
    tp_group: ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest logits over the whole (sharded) vocabulary, for distillation.

    Each rank takes its local top-``min(k, vocab/TP)``, the candidates are all-gathered
    ([batch, seq, TP * min(k, vocab/TP)]) and the top ``k`` of those kept; every rank gets the
    same result. Values keep autograd (each rank's gradient lands on its own shard).

    Args:
        vocab_parallel_logits: [batch, seq, vocab/TP] logits of this rank's shard.
        k: how many logits per position, ``1 <= k <= vocab_size``.
        vocab_start_index: first token id of this rank's shard.
        tp_group: tensor-parallel group; ``None`` = not split.

    Returns:
        (values [batch, seq, k] in the logits' dtype, global token ids [batch, seq, k] int64),
        sorted by descending value; aligned with the logits' positions (no next-token shift).
    """
    logits = vocab_parallel_logits
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(
            "vocab_parallel_logits must have shape [batch, seq, vocab/TP], got "
            f"{tuple(getattr(logits, 'shape', ()))}"
        )
    vocab = logits.shape[-1] * _group_size_rank(tp_group)[0]
    if not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k must be an int in [1, vocab_size={vocab}], got {k!r}")
    return _gathered_topk(logits, k, vocab_start_index, tp_group)


def masked_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: ProcessGroup | None,
    top_k: int | None = None,
    top_p: float | None = None,
    top_p_candidates: int | None = DEFAULT_TOP_P_CANDIDATES,
    widen: bool = False,
) -> torch.Tensor:
    """Next-token log-probabilities under the top-k / top-p truncated, renormalised distribution.

    Scores exactly what a vLLM / Hugging Face sampler with these settings draws from: top-k keeps
    the ``top_k`` largest logits; top-p then keeps the smallest set of the most probable
    remaining tokens whose cumulative probability (renormalised over the top-k set when
    ``top_k`` is given, over the full vocabulary otherwise) reaches ``top_p``, always at least
    one token; the kept logits are renormalised. A target outside the kept set gets ``-inf``.
    Apply temperature to the logits before calling, as the sampler does.

    Only candidates cross ranks: each rank all-gathers its local top-``c`` values (and ids),
    [batch, seq, TP * c], where ``c = top_k`` if given, else ``top_p_candidates``. With top-p
    alone the full-vocabulary normaliser is computed like ``from_parallel_logits_to_logprobs``
    (two [batch, seq] all-reduces). ``top_p_candidates=None`` gathers the whole shard, i.e. a
    [batch, seq, vocab] tensor on every rank: exact for any ``top_p`` but memory-heavy.

    Ties at the cut-off value: the samplers keep every token tied with the last kept one; here
    exactly ``top_k`` candidates are kept. The two differ only for exactly tied logits.

    Args:
        vocab_parallel_logits: [batch, seq, vocab/TP] logits (after temperature).
        target: [batch, seq] token ids; ``target[:, 0]`` is not scored.
        vocab_start_index, vocab_end_index: this rank's token-id range.
        tp_group: tensor-parallel group; ``None`` = not split.
        top_k: keep the ``top_k`` largest logits (``None`` = no top-k), ``1 <= top_k <= vocab``.
        top_p: nucleus mass in ``(0, 1]`` (``None`` or 1 = no top-p).
        top_p_candidates: per-rank candidate cap for top-p without top-k (see above).
        widen: where the nucleus exceeds the candidates, gather the whole shard instead of
            raising.

    Returns:
        [batch, seq] log-probabilities in the accumulation dtype, ``out[:, 0] = 0``; differentiable
        w.r.t. the logits (kept tokens only).

    Raises:
        ValueError: bad shapes/ranges or settings, a target outside the vocabulary, or (top-p
            without top-k, ``widen`` False) a nucleus larger than the gathered candidates; raise
            ``top_p_candidates``, pass ``None`` or ``widen`` in that case.
    """
    _validate(vocab_parallel_logits, target, vocab_start_index, vocab_end_index)
    _check_truncation(vocab_parallel_logits, tp_group, top_k, top_p, top_p_candidates)
    if top_k is None and (top_p is None or top_p >= 1.0):
        return from_parallel_logits_to_logprobs(
            vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group
        )
    logprob, counts = truncated_logprobs(
        vocab_parallel_logits[:, :-1], target[:, 1:], vocab_start_index, tp_group,
        top_k, top_p, top_p_candidates, widen,
    )
    _check_target_coverage(counts, target, vocab_start_index, vocab_end_index)
    return torch.nn.functional.pad(logprob, (1, 0), value=0.0)


def _check_truncation(
    logits: torch.Tensor,
    group: ProcessGroup | None,
    top_k: int | None,
    top_p: float | None,
    top_p_candidates: int | None,
) -> None:
    """Raise unless the truncation settings are valid for vocab-sharded ``logits``."""
    vocab = logits.shape[-1] * _group_size_rank(group)[0]
    if top_k is not None and (not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size={vocab}], got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if top_p_candidates is not None and (not isinstance(top_p_candidates, int) or top_p_candidates < 1):
        raise ValueError(f"top_p_candidates must be None or a positive int, got {top_p_candidates!r}")


def truncated_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    tp_group: ProcessGroup | None,
    top_k: int | None,
    top_p: float | None,
    top_p_candidates: int | None = DEFAULT_TOP_P_CANDIDATES,
    widen: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``target`` under the top-k / top-p truncated, renormalised
    distribution of the logits at the SAME position (no next-token shift; see
    :func:`masked_logprobs` for the semantics and the candidates).

    Args:
        logits: ``[..., vocab / TP]`` this rank's shard (after temperature).
        target: ``[...]`` global token ids.
        vocab_start_index: first token id of this rank's shard.
        tp_group: tensor-parallel group; ``None`` = not split.
        top_k, top_p, top_p_candidates: as in :func:`masked_logprobs` (settings not checked).
        widen: top-p without top-k whose nucleus exceeds the candidates: gather the whole
            shard instead of raising (exact for any ``top_p``, [..., vocab] on every rank).

    Returns:
        ``(logprob [...], count [...])`` in the accumulation dtype: ``-inf`` where the target
        is outside the kept set; ``count`` is how many ranks hold the target (1 when valid,
        identical on every rank). Differentiable w.r.t. ``logits`` (kept tokens only).

    Raises:
        ValueError: (top-p without top-k, ``widen`` False) a nucleus larger than the gathered
            candidates.
    """
    world = _group_size_rank(tp_group)[0]
    local_vocab = logits.shape[-1]
    vocab = local_vocab * world
    use_top_p = top_p is not None and top_p < 1.0
    dtype = _compute_dtype(logits.dtype)
    if top_k is not None:
        per_rank = min(top_k, local_vocab)
    elif top_p_candidates is None:
        per_rank = local_vocab
    else:
        per_rank = min(top_p_candidates, local_vocab)
    n_cand = top_k if top_k is not None else per_rank * world
    values, _ = _gathered_topk(logits, n_cand, vocab_start_index, tp_group)
    values = values.to(dtype)  # [..., n_cand], descending

    # Target logit: local gather, SUM over ranks; the count checks the id is in the vocabulary.
    idx, in_range = _local_target(target, vocab_start_index, local_vocab)
    local_logit = logits.gather(-1, idx).squeeze(-1).to(dtype).masked_fill(~in_range, 0.0)
    target_logit = _AllReduceSumReplicated.apply(local_logit, tp_group)
    counts = _all_reduce(in_range.to(dtype).contiguous(), dist.ReduceOp.SUM, tp_group)

    keep = torch.ones_like(values, dtype=torch.bool)
    if use_top_p:
        with torch.no_grad():
            if top_k is not None:
                norm = torch.logsumexp(values, dim=-1)
            else:
                norm = vocab_parallel_logsumexp(logits.detach().to(dtype), tp_group)
            probs = (values.detach() - norm.unsqueeze(-1)).exp()
            cumulative = probs.cumsum(dim=-1)
            # Keep token i iff the mass strictly before it is < top_p; for the first token that
            # mass is 0, so at least one token is always kept.
            keep = (cumulative - probs) < top_p
            # The (n_cand + 1)-th token would be kept too: the nucleus is not inside the candidates.
            short = top_k is None and n_cand < vocab and bool((cumulative[..., -1] < top_p).any())
        if short and widen:
            return truncated_logprobs(logits, target, vocab_start_index, tp_group, None, top_p, None)
        if short:
            raise ValueError(
                f"top_p={top_p} needs more than the {n_cand} gathered candidates at some position; "
                f"raise top_p_candidates (now {top_p_candidates} per rank) or pass None"
            )
    kept = values.masked_fill(~keep, -math.inf)
    threshold = kept.masked_fill(~keep, math.inf).amin(dim=-1)
    logprob = torch.where(
        target_logit >= threshold,
        target_logit - torch.logsumexp(kept, dim=-1),
        torch.full_like(target_logit, -math.inf),
    )
    return logprob, counts


def vocab_parallel_logsumexp(
    vocab_parallel_logits: torch.Tensor, tp_group: ProcessGroup | None
) -> torch.Tensor:
    """``log sum_v exp(logits[..., v])`` over the whole (sharded) vocabulary, [...]; differentiable.

    Entries may be -inf (masked tokens); a position whose every entry is -inf gives -inf.
    The maximum is taken without gradient (it cancels out of the result's value and gradient).
    """
    logits = vocab_parallel_logits
    peak = logits.detach().amax(dim=-1, keepdim=True)
    peak = _all_reduce(peak.contiguous(), dist.ReduceOp.MAX, tp_group)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    local = torch.exp(logits - peak).sum(dim=-1)
    total = _AllReduceSumReplicated.apply(local, tp_group)
    return torch.log(total) + peak.squeeze(-1)


def gather_at_global_indices(
    vocab_parallel_logits: torch.Tensor, indices: torch.Tensor, vocab_start_index: int, tp_group: ProcessGroup | None
) -> torch.Tensor:
    """``logits[..., indices]`` for global token ids ``indices`` [..., k] from vocab-sharded logits
    [..., vocab/TP]: each rank fills the ids of its shard, the ranks sum; differentiable (each
    rank's gradient lands on its own shard)."""
    width = vocab_parallel_logits.shape[-1]
    local = indices - vocab_start_index
    mine = (local >= 0) & (local < width)
    values = vocab_parallel_logits.gather(-1, local.clamp(0, width - 1))
    values = torch.where(mine, values, torch.zeros_like(values))
    return _AllReduceSumReplicated.apply(values, tp_group)
