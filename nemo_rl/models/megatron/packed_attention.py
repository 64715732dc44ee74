"""Causal attention of each sequence of a pack (``thd`` layout) with itself, on one rank.

Two kernels compute the same function:

* on CUDA in bf16 / fp16, torch's variable-length flash-attention kernel
  (``torch.nn.attention.varlen.varlen_attn``): one call for the whole pack;
* elsewhere (CPU, fp32, a torch without the kernel), torch's fused
  ``scaled_dot_product_attention`` once per sequence.

A pack of many short sequences costs the per-sequence path one kernel launch per sequence and
layer, forward and backward: on a GPU that launch count, not the arithmetic, sets the step time.
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
    return per_sequence_causal(query, key, value, cu_seqlens.tolist(), scale)


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


def per_sequence_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Sequence[int], scale: float
) -> Tensor:
    """:func:`packed_causal_attention` with torch's fused ``scaled_dot_product_attention``, one
    call per sequence (any device and dtype)."""
    # [t, heads, hn] -> [1, heads, t, hn]
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
    gqa = q.size(1) != k.size(1)
    # One split, not a slice per sequence: a slice's backward writes its gradient into a
    # zero tensor of the whole pack's size (one per sequence and input, then summed); the
    # split's backward concatenates the pieces' gradients once.
    sizes = [hi - lo for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    tail = q.size(2) - cu_seqlens[-1]
    pieces = [t.split([*sizes, tail], dim=2) for t in (q, k, v)]
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, is_causal=True, scale=scale, enable_gqa=gqa
        )
        for qi, ki, vi, n in zip(*pieces, sizes)
        if n > 0
    ]
    if tail > 0:
        parts.append(q.new_zeros(1, q.size(1), tail, q.size(-1)))
    return torch.cat(parts, dim=2)[0].permute(1, 0, 2)
