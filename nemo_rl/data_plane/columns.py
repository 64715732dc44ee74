"""Batch tensors <-> per-sample data-plane columns.

Two kinds of fields are stored per sample:

* token fields: one value per token (``input_ids``, ``token_mask``, logprobs), written as the
  writer's right-padded rows ``[B, S_w, ...]`` and read back as ``[B, S, ...]``: each row cut
  or padded to one common ``S`` (only padding is cut: every sample is at most ``S`` long).
  Rows are stored as the writer padded them rather than trimmed to their length: a
  ``[B, S_w]`` tensor goes to the store as one regular tensor, where per-sample trimmed
  tensors would become jagged nested tensors and one message part per sample, which
  TransferQueue puts 2-3x slower than the padding costs.
* sample fields: one value per sample, stored as a 0-dim tensor (``input_lengths``,
  ``sample_mask``, per-sample advantages). Written from and read back as ``[B]``.

The common ``S`` of a read is the batch's global forward pad length, stamped once on the
meta (:func:`stamp_pad_seqlen`) and inherited by its DP shards, so that the driver and every
worker materialise the same ``[B, S]`` shapes as the in-memory path (where ``S`` is the
longest sample of the batch). Positions past a sample's length read as the field's pad value
(``pad_value_dict``, else 0) whatever the writer padded with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from nemo_rl.data_plane.interfaces import Column, DataPlaneClient
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict

# extra_info key: the sequence dimension (tokens) every token field of the batch is padded to.
GLOBAL_FORWARD_PAD_SEQLEN = "global_forward_pad_seqlen"
# extra_info key: {field: pad value} of token fields whose padding is not 0 (e.g. input_ids).
PAD_VALUE_DICT = "pad_value_dict"


def stamp_pad_seqlen(meta: KVBatchMeta) -> int:
    """Set ``meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN]`` to the longest sample (tokens, >= 1)
    unless already set; returns it. Mutates ``meta.extra_info`` in place (idempotent)."""
    if GLOBAL_FORWARD_PAD_SEQLEN not in meta.extra_info:
        meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] = max(max(meta.sequence_lengths, default=1), 1)
    return int(meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN])


def to_columns(meta: KVBatchMeta, fields: Mapping[str, Any]) -> dict[str, Column]:
    """``fields`` checked to be columns of ``meta``'s samples.

    Args:
        meta: the samples.
        fields: per name, a token field ``[B, S, ...]`` (``S`` >= every sample's length), a
            sample field ``[B]``, or ``B`` per-sample tensors; stored as given.

    Raises:
        ValueError: a token field shorter than a sample's length (names field and key).
    """
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 2:
            too_long = [
                k for k, n in zip(meta.keys, meta.sequence_lengths) if n > value.shape[1]
            ]
            if too_long:
                raise ValueError(
                    f"token field {name!r} has {value.shape[1]} positions but samples "
                    f"{too_long[:4]} of partition {meta.partition_id!r} are longer; pass the "
                    "whole right-padded [batch, seq] tensor"
                )
    return dict(fields)


def write_columns(
    client: DataPlaneClient, meta: KVBatchMeta, fields: Mapping[str, Any]
) -> KVBatchMeta:
    """Put ``fields`` (see :func:`to_columns`) under ``meta``'s keys; ``meta`` with them."""
    return client.put_by_meta(meta, to_columns(meta, fields))


def read_columns(
    client: DataPlaneClient,
    meta: KVBatchMeta,
    select_fields: Sequence[str],
    pad_value_dict: Optional[Mapping[str, Any]] = None,
) -> BatchedDataDict:
    """Fetch ``select_fields`` of ``meta``'s samples as one batch in ``meta``'s row order.

    Token fields come back ``[B, S, ...]`` with ``S = stamp_pad_seqlen(meta)``, padded with
    ``pad_value_dict[name]`` (else ``meta.extra_info[PAD_VALUE_DICT][name]``, else 0); sample
    fields come back ``[B]``. The result carries ``meta.micro_batch_plan``.

    Raises:
        MissingSamplesError: keys or fields missing in the store.
        ValueError: an empty meta, or a field mixing 0-dim and token samples.
    """
    if meta.size == 0:
        raise ValueError(f"read_columns got an empty batch of partition {meta.partition_id!r}")
    seq = stamp_pad_seqlen(meta)
    too_long = [k for k, n in zip(meta.keys, meta.sequence_lengths) if n > seq]
    if too_long:
        raise ValueError(
            f"samples {too_long[:4]} of partition {meta.partition_id!r} are longer than the "
            f"batch's {GLOBAL_FORWARD_PAD_SEQLEN}={seq}; stamp the pad length on the whole "
            "batch before sharding it"
        )
    samples = client.get_by_meta(meta, select_fields)
    pads = {**meta.extra_info.get(PAD_VALUE_DICT, {}), **(pad_value_dict or {})}
    batch = BatchedDataDict()
    for name, values in samples.items():
        ranks = {v.ndim for v in values}
        if ranks == {0}:
            batch[name] = torch.stack(values)
        elif 0 in ranks:
            raise ValueError(
                f"field {name!r} of partition {meta.partition_id!r} mixes per-sample scalars and "
                "per-token tensors; write it with one kind for every sample"
            )
        else:
            batch[name] = _right_padded(values, meta.sequence_lengths, seq, pads.get(name, 0))
    batch.micro_batch_plan = meta.micro_batch_plan
    return batch


def _right_padded(
    values: list[torch.Tensor], lengths: Sequence[int], seq: int, pad_value: Any
) -> torch.Tensor:
    """``[B, seq, ...]``: the first ``lengths[i]`` positions of ``values[i]``, then
    ``pad_value``."""
    first = values[0]
    out = first.new_full((len(values), seq, *first.shape[1:]), pad_value)
    for row, (value, n) in enumerate(zip(values, lengths)):
        out[row, :n] = value[:n]
    return out
