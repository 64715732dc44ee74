"""Tensor transforms between Hugging Face and Megatron-Core layouts, TP-shard aware.

Every transform here comes in a pair: ``*_shard`` builds one tensor-parallel rank's Megatron
tensor from HF tensors (reading only the rows/columns that rank needs), and ``*_unshard``
turns the list of all TP ranks' Megatron tensors back into the HF tensors, bit for bit.

Layouts (``h`` = hidden size, ``d`` = head dim, ``nq``/``nkv`` = query/KV heads, ``g = nq/nkv``):

* fused QKV: Megatron's ``linear_qkv`` weight is ``[(nq + 2*nkv) * d, h]`` grouped per KV head:
  for each KV head ``j``, the ``g`` query heads that share it, then ``k_j``, then ``v_j``.
  A TP rank holds ``nkv / tp`` whole groups, so TP slicing is a contiguous row range.
* fused gate/up: Megatron's ``linear_fc1`` weight is ``[2 * ffn, h]``; each TP rank holds
  ``[gate_rows_r; up_rows_r]`` (its slice of gate, then its slice of up), so the full fused
  tensor is *not* ``cat(gate, up)`` once TP > 1.
* vocab padding: embedding / output rows are padded with zeros to a multiple of
  ``make_vocab_size_divisible_by * tp``; padding rows are never exported.

The ``*_unshard`` functions copy as little as the layout allows: with one shard (TP=1) they
return views of it where the HF tensor is a contiguous piece of the Megatron one (every
tensor but q/k/v, which are copied once out of the interleaved fused QKV). Their results are
contiguous and may share memory with ``shards``.
"""

from __future__ import annotations

from typing import Protocol

import torch


class TensorReader(Protocol):
    """Reads (a row or column range of) one HF tensor by name, without loading the rest."""

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """The tensor ``name``, or its slice ``[start:stop]`` along ``dim`` (0 or 1)."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of the tensor ``name``."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of the tensor ``name``."""
        ...


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Embedding rows Megatron allocates: ``vocab_size`` rounded up to ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def tp_range(size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``tp_rank``'s equal slice of ``size`` items."""
    if size % tp_size:
        raise ValueError(f"size {size} is not divisible by tensor-parallel size {tp_size}")
    part = size // tp_size
    return tp_rank * part, (tp_rank + 1) * part


def qkv_shard(
    reader: TensorReader,
    names: tuple[str, str, str],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    tp_rank: int,
    tp_size: int,
) -> torch.Tensor:
    """One TP rank's fused ``linear_qkv`` weight ``[(nq+2nkv)/tp * d, h]`` (or bias, 1-D).

    Args:
        names: HF names of the q, k and v projections (all weights or all biases).
    """
    q_name, k_name, v_name = names
    g = num_heads // num_kv_heads
    kv_lo, kv_hi = tp_range(num_kv_heads, tp_rank, tp_size)
    q = reader.read(q_name, 0, kv_lo * g * head_dim, kv_hi * g * head_dim)
    k = reader.read(k_name, 0, kv_lo * head_dim, kv_hi * head_dim)
    v = reader.read(v_name, 0, kv_lo * head_dim, kv_hi * head_dim)
    groups = kv_hi - kv_lo
    tail = q.shape[1:]
    # Interleave per query group: [q heads of group j, k_j, v_j] for each local KV head j.
    fused = torch.cat(
        [
            q.reshape(groups, g * head_dim, *tail),
            k.reshape(groups, head_dim, *tail),
            v.reshape(groups, head_dim, *tail),
        ],
        dim=1,
    )
    return fused.reshape(groups * (g + 2) * head_dim, *tail)


def _cat(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(shards, dim)``, or the single shard itself (no copy) when TP=1."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def qkv_unshard(
    shards: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int
) -> list[torch.Tensor]:
    """HF ``[q, k, v]`` from all TP ranks' fused ``linear_qkv`` tensors (weights or biases)."""
    g = num_heads // num_kv_heads
    tail = shards[0].shape[1:]
    # Each rank holds whole query groups, so the groups of all ranks stack along dim 0.
    grouped = _cat([s.reshape(-1, (g + 2) * head_dim, *tail) for s in shards], dim=0)
    q, k, v = torch.split(grouped, [g * head_dim, head_dim, head_dim], dim=1)
    # One copy each, straight out of the interleaved groups (a strided view).
    return [
        q.reshape(num_heads * head_dim, *tail).contiguous(),
        k.reshape(num_kv_heads * head_dim, *tail).contiguous(),
        v.reshape(num_kv_heads * head_dim, *tail).contiguous(),
    ]


def gate_up_shard(
    reader: TensorReader, names: tuple[str, str], ffn: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """One TP rank's ``linear_fc1`` weight ``[2 * ffn / tp, h]``: its gate rows, then up rows."""
    lo, hi = tp_range(ffn, tp_rank, tp_size)
    gate = reader.read(names[0], 0, lo, hi)
    up = reader.read(names[1], 0, lo, hi)
    return torch.cat([gate, up], dim=0)


def gate_up_unshard(shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """HF ``[gate, up]`` from all TP ranks' ``linear_fc1`` tensors."""
    halves = [torch.chunk(shard, 2, dim=0) for shard in shards]
    gate = _cat([h[0] for h in halves], dim=0)
    up = _cat([h[1] for h in halves], dim=0)
    return [gate.contiguous(), up.contiguous()]


def vocab_shard(
    reader: TensorReader, name: str, vocab_size: int, padded_size: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """One TP rank's rows ``[padded/tp, h]`` of an embedding or output matrix, zero padded."""
    lo, hi = tp_range(padded_size, tp_rank, tp_size)
    real_hi = min(hi, vocab_size)
    if real_hi == hi:
        return reader.read(name, 0, lo, hi)
    out = torch.zeros(hi - lo, reader.shape(name)[1], dtype=reader.dtype(name))
    if real_hi > lo:
        out[: real_hi - lo] = reader.read(name, 0, lo, real_hi)
    return out


def vocab_unshard(shards: list[torch.Tensor], vocab_size: int) -> list[torch.Tensor]:
    """The HF ``[vocab, h]`` matrix from all TP ranks' rows, padding rows dropped."""
    return [_cat(shards, dim=0)[:vocab_size].contiguous()]


def split_shard(
    reader: TensorReader, name: str, dim: int | None, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """One TP rank's slice along ``dim`` (0 column-parallel, 1 row-parallel, None replicated)."""
    if dim is None:
        return reader.read(name)
    lo, hi = tp_range(reader.shape(name)[dim], tp_rank, tp_size)
    return reader.read(name, dim, lo, hi)


def split_unshard(shards: list[torch.Tensor], dim: int | None) -> list[torch.Tensor]:
    """The HF tensor from all TP ranks' slices (replicated: rank 0's copy)."""
    if dim is None:
        return [shards[0].contiguous()]
    return [_cat(shards, dim=dim).contiguous()]
