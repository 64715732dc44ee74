"""Causal attention of each sequence of a pack (``thd`` layout) with itself, on one rank.

Two kernels compute the same function:

* on CUDA in bf16 / fp16, torch's variable-length flash-attention kernel
  (``torch.nn.attention.varlen.varlen_attn``): one call for the whole pack;
* elsewhere (CPU, fp32, a torch without the kernel), torch's fused
  ``scaled_dot_product_attention`` once per bucket of sequences of similar length, each padded
  at its end to the bucket's longest.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


@functools.cache
def _varlen_kernel() -> tuple[Callable[..., Tensor], dict[str, Any], bool] | None:
    """torch's varlen flash-attention function, the keyword arguments that make it causal and
    whether it takes ``enable_gqa`` (its signature changed across torch releases), or None
    where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


def varlen_applies(query: Tensor) -> bool:
    """True when :func:`packed_causal_attention` runs the varlen kernel for ``query``."""
    return (
        query.is_cuda
        and query.dtype in (torch.bfloat16, torch.float16)
        and _varlen_kernel() is not None
    )


def packed_causal_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> Tensor:
    """Causal attention of each packed sequence with itself.

    Args:
        query: ``[t, np, hn]`` the pack's queries, sequences back to back.
        key, value: ``[t, ng, hn]``; ``ng`` divides ``np`` (grouped-query attention).
        cu_seqlens: ``[n + 1]`` int32 sequence boundaries (tokens) on the query's device; a
            sequence's padding follows its real tokens, so causal attention keeps it out of
            their outputs.
        max_seqlen: the longest sequence, in tokens.
        scale: softmax scale.

    Returns:
        ``[t, np, hn]`` in the query's dtype; rows past ``cu_seqlens[-1]`` are zero.
    """
    if varlen_applies(query):
        return varlen_causal(query, key, value, cu_seqlens, max_seqlen, scale)
    return bucketed_causal(query, key, value, cu_seqlens.tolist(), scale)


def varlen_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float
) -> Tensor:
    """:func:`packed_causal_attention` with torch's varlen flash-attention kernel (CUDA, bf16 or
    fp16 only)."""
    kernel, causal, takes_gqa = _varlen_kernel()
    groups = query.size(1) // key.size(1)
    kwargs: dict[str, Any] = dict(causal, scale=scale)
    if groups > 1 and takes_gqa:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    cu = cu_seqlens.to(torch.int32)
    end = int(cu[-1])
    # Only the rows inside the pack go in: the kernel's backward leaves the key and value
    # gradients of rows past the last sequence unwritten.
    out = kernel(query[:end], key[:end], value[:end], cu, cu, max_seqlen, max_seqlen, **kwargs)
    if end < query.size(0):
        out = torch.cat([out, out.new_zeros(query.size(0) - end, *out.shape[1:])])
    return out


def bucketed_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Sequence[int], scale: float
) -> Tensor:
    """:func:`packed_causal_attention` with torch's fused ``scaled_dot_product_attention`` (any
    device and dtype): one batched call per :data:`BUCKET_TOKENS`-token length bucket.

    Each sequence is zero-padded at its end to its bucket's longest and the bucket's sequences
    run as one ``[g, heads, length, hn]`` batch. Causal attention keeps the appended rows out of
    every real row's output, so the result is the per-sequence one; the padded rows' outputs
    are dropped. A GRPO pack holds many sequences of similar length, so this is a few calls a
    layer instead of one per sequence.
    """
    # [t, heads, hn] -> [1, heads, t, hn]
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
    gqa = q.size(1) != k.size(1)
    sizes = [hi - lo for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    tail = q.size(2) - cu_seqlens[-1]
    # One split, not a slice per sequence: a slice's backward writes its gradient into a
    # zero tensor of the whole pack's size (one per sequence and input, then summed); the
    # split's backward concatenates the pieces' gradients once.
    pieces = [t.split([*sizes, tail], dim=2) for t in (q, k, v)]
    outputs: list[Tensor | None] = [None] * len(sizes)
    for members in length_buckets(sizes).values():
        longest = max(sizes[i] for i in members)
        # q, k, v of the bucket: [g, heads (q) or groups (k, v), longest, hn]
        batch = [torch.cat([_pad_rows(part[i], longest) for i in members]) for part in pieces]
        attended = torch.nn.functional.scaled_dot_product_attention(
            *batch, is_causal=True, scale=scale, enable_gqa=gqa
        )
        for i, out in zip(members, attended.split(1, dim=0)):
            outputs[i] = out[:, :, : sizes[i]]
    parts = [out for out in outputs if out is not None]
    if tail > 0:
        parts.append(q.new_zeros(1, q.size(1), tail, q.size(-1)))
    return torch.cat(parts, dim=2)[0].permute(1, 0, 2)


# Sequences whose lengths round up to the same multiple of this many tokens share one attention
# call: the padding wastes under this many rows of attention per sequence.
BUCKET_TOKENS = 16


def length_buckets(sizes: Sequence[int]) -> dict[int, list[int]]:
    """Indices of the non-empty sequences of ``sizes`` (tokens) grouped by their length rounded
    up to a multiple of :data:`BUCKET_TOKENS`, in pack order within each group."""
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        if n > 0:
            buckets.setdefault(-(-n // BUCKET_TOKENS), []).append(i)
    return buckets


def _pad_rows(piece: Tensor, rows: int) -> Tensor:
    """``piece`` ``[1, heads, n, hn]`` with zero rows appended up to ``rows``."""
    missing = rows - piece.size(2)
    return torch.nn.functional.pad(piece, (0, 0, 0, missing)) if missing else piece
