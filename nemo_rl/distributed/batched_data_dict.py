"""Batch-first dictionaries: the container every stage of the pipeline passes around.

A :class:`BatchedDataDict` maps names to values whose first dimension is the batch: torch tensors
of shape ``[batch, ...]`` and python lists of length ``batch``. Token tensors are right-padded
``[batch, seq]``; the true length of every sample (tokens) lives under its own key, e.g.
``input_lengths`` of shape ``[batch]``.

:meth:`BatchedDataDict.shard_by_batch_size` splits a batch into one shard per data-parallel (DP)
rank as :func:`nemo_rl.distributed.shard_planner.plan_shards` decides, and returns a
:class:`ShardedBatch`: the shards and the original row of every row of the concatenated shards,
which :meth:`BatchedDataDict.reorder_data` uses to put results gathered from the shards back
into the original order. Shards made by dynamic batching or sequence packing carry their
:class:`~nemo_rl.distributed.shard_planner.MicroBatchPlan`, which the micro-batch iterators
follow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import torch

from nemo_rl.distributed.shard_planner import (
    DynamicBatchingArgs,
    MicroBatchPlan,
    SequencePackingArgs,
    plan_shards,
)

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class BatchedDataDict(dict[str, Any], Generic[DictT]):
    """A dict of batch-first values: tensors ``[batch, ...]`` and lists of length ``batch``.

    Methods that select rows return new dicts and leave ``self`` unchanged; tensors are indexed
    (views for slices), list elements are shared, not copied.

    Attributes:
        micro_batch_plan: set on shards made by dynamic batching or sequence packing (see
            :meth:`shard_by_batch_size`); carried over by :meth:`slice` when the slice keeps whole
            micro-batches, dropped by every method that reorders rows.
    """

    micro_batch_plan: MicroBatchPlan | None = None

    # ------------------------------------------------------------------ size and construction

    @property
    def size(self) -> int:
        """Batch size (rows); 0 for an empty dict. Raises if values disagree on dim 0."""
        size: int | None = None
        first_key = ""
        for key, value in self.items():
            rows = _batch_len(key, value)
            if size is None:
                size, first_key = rows, key
            elif rows != size:
                raise ValueError(
                    f"batch size mismatch: '{key}' has {rows} rows but '{first_key}' has {size}; "
                    "every value must have the batch as its first dimension with the same size"
                )
        return 0 if size is None else size

    @property
    def micro_batch_indices(self) -> list[list[int]] | None:
        """``[start, end)`` row ranges of the planned micro-batches; None without a plan."""
        plan = self.micro_batch_plan
        return None if plan is None else [[a, b] for a, b in plan.ranges]

    @property
    def micro_batch_lengths(self) -> list[int] | None:
        """Token lengths of the planned micro-batches (MicroBatchPlan.lengths); None if unplanned."""
        plan = self.micro_batch_plan
        return None if plan is None else list(plan.lengths)

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate batches along dim 0.

        Tensors of rank >= 2 whose dim 1 (sequence, tokens) differs are right-padded to the
        longest with ``pad_value_dict[key]`` (default 0); lists are concatenated.
        """
        if not batches:
            raise ValueError("from_batches needs at least one batch")
        keys = list(batches[0].keys())
        for i, batch in enumerate(batches):
            if set(batch.keys()) != set(keys):
                raise ValueError(
                    f"batch {i} has keys {sorted(batch.keys())} but batch 0 has {sorted(keys)}; "
                    "all batches must carry the same keys"
                )
            cls(batch).size  # validates each batch on its own for a precise error
        pads = pad_value_dict or {}
        out = cls()
        for key in keys:
            values = [batch[key] for batch in batches]
            if all(isinstance(v, torch.Tensor) for v in values):
                out[key] = _cat_right_padded(key, values, pads.get(key, 0))
            elif all(isinstance(v, list) for v in values):
                out[key] = [item for v in values for item in v]
            else:
                kinds = sorted({type(v).__name__ for v in values})
                raise TypeError(
                    f"'{key}' has types {kinds} across batches; a key must be a tensor in every "
                    "batch or a list in every batch"
                )
        out.size  # validates the result
        return out

    # ------------------------------------------------------------------ row selection

    def slice(self, start: int, end: int) -> BatchedDataDict[DictT]:
        """Rows ``[start, end)``; keeps the micro-batch plan when no micro-batch is cut."""
        size = self.size
        if not 0 <= start <= end <= size:
            raise ValueError(f"slice [{start}, {end}) is outside the batch of {size} rows")
        out = self._rows(start, end)
        if self.micro_batch_plan is not None:
            out.micro_batch_plan = self.micro_batch_plan.sliced(start, end)
        return out

    def select_indices(self, indices: torch.Tensor | Sequence[int]) -> BatchedDataDict[DictT]:
        """Rows ``indices`` (1-D integer tensor or ints in ``[0, size)``), in that order."""
        idx = _index_list(indices, self.size)
        return self._map(
            lambda t: t[torch.tensor(idx, dtype=torch.long, device=t.device)],
            lambda values: [values[i] for i in idx],
        )

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict[DictT]:
        """Every row repeated ``num_repeats`` times in place: rows a, b -> a, a, b, b for 2."""
        if not isinstance(num_repeats, int) or num_repeats < 1:
            raise ValueError(f"num_repeats must be a positive int, got {num_repeats!r}")
        return self._map(
            lambda t: t.repeat_interleave(num_repeats, dim=0),
            lambda values: [v for v in values for _ in range(num_repeats)],
        )

    def to(self, device: torch.device | str) -> BatchedDataDict[DictT]:
        """A copy with every tensor on ``device``; lists and the micro-batch plan are kept."""
        out = self._map(lambda t: t.to(device), list)
        out.micro_batch_plan = self.micro_batch_plan
        return out

    def chunk(self, rank: int, chunks: int) -> BatchedDataDict[DictT]:
        """The ``rank``-th of ``chunks`` equal contiguous chunks (e.g. a DP rank's rows)."""
        size = self.size
        if chunks < 1 or not 0 <= rank < chunks:
            raise ValueError(f"need 0 <= rank < chunks, got rank={rank}, chunks={chunks}")
        if size % chunks:
            raise ValueError(
                f"batch of {size} rows does not split into {chunks} equal chunks; "
                f"use a batch size that is a multiple of {chunks}"
            )
        step = size // chunks
        return self.slice(rank * step, (rank + 1) * step)

    def get_batch(self, batch_idx: int, batch_size: int) -> BatchedDataDict[DictT]:
        """Rows ``[batch_idx * batch_size, (batch_idx + 1) * batch_size)``."""
        if batch_size < 1 or batch_idx < 0 or (batch_idx + 1) * batch_size > self.size:
            raise ValueError(
                f"batch {batch_idx} of size {batch_size} is outside the batch of {self.size} rows"
            )
        return self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)

    def reorder_data(
        self, reordered_indices: torch.Tensor | Sequence[int]
    ) -> BatchedDataDict[DictT]:
        """Undo a reordering: row ``j`` of ``self`` belongs at original position
        ``reordered_indices[j]``. Pass the ``sorted_indices`` of :meth:`shard_by_batch_size` to
        put results gathered from the shards (concatenated in shard order) back in order.
        """
        size = self.size
        idx = _index_list(reordered_indices, size)
        if len(idx) != size or len(set(idx)) != size:
            raise ValueError(
                f"reordered_indices must be a permutation of range({size}); got {len(idx)} "
                f"indices of which {len(set(idx))} are distinct"
            )
        inverse = [0] * size
        for position, original in enumerate(idx):
            inverse[original] = position
        return self.select_indices(inverse)

    # ------------------------------------------------------------------ sharding

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        sequence_packing_args: SequencePackingArgs | None = None,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
    ) -> ShardedBatch[DictT]:
        """Split the batch into ``shards`` DP shards, global batch by global batch.

        The arguments and the three modes (plain, dynamic batching, sequence packing) are those
        of :func:`~nemo_rl.distributed.shard_planner.plan_shards`; the sequence lengths come from
        ``self[args["input_lengths_key"]]`` and are checked against the sequence dimension of
        ``self[args["input_key"]]``.

        Returns:
            The shards (each with its ``micro_batch_plan`` under dynamic batching or sequence
            packing) and, in every mode, ``sorted_indices`` for :meth:`reorder_data`.

        Raises:
            ValueError: the planner's argument errors, or missing or invalid length keys.
        """
        # Lengths are read only when the planner will use them; every other argument error is
        # the planner's to report.
        budget_args = (
            dynamic_batching_args if dynamic_batching_args is not None else sequence_packing_args
        )
        lengths = None
        if budget_args is not None and self and {"input_key", "input_lengths_key"} <= set(
            budget_args
        ):
            lengths = self._sequence_lengths(
                budget_args["input_key"], budget_args["input_lengths_key"]
            )
        plan = plan_shards(
            self.size,
            shards,
            batch_size,
            allow_uneven_shards,
            sequence_packing_args,
            dynamic_batching_args,
            sequence_lengths=lengths,
        )
        micro_batch_plans = plan.micro_batch_plans or (None,) * shards
        out: list[BatchedDataDict[DictT]] = []
        for rows, micro_batch_plan in zip(plan.rows, micro_batch_plans):
            shard = self.select_indices(rows)
            shard.micro_batch_plan = micro_batch_plan
            out.append(shard)
        return ShardedBatch(out, [i for rows in plan.rows for i in rows])

    def split_global_batches(self) -> list[BatchedDataDict[DictT]]:
        """The global batches of a planned shard, each with its part of the micro-batch plan.

        A rank runs one optimizer step per element. Plain shards have equal global batches per
        rank; use :meth:`get_batch` for them.
        """
        plan = self._require_plan(None)
        bounds = plan.global_batch_offsets
        return [self.slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    # ------------------------------------------------------------------ micro-batch iterators

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[BatchedDataDict[DictT]]:
        """Consecutive micro-batches of ``microbatch_size`` rows; the last may be shorter."""
        if not isinstance(microbatch_size, int) or microbatch_size < 1:
            raise ValueError(f"microbatch_size must be a positive int, got {microbatch_size!r}")
        size = self.size
        for start in range(0, size, microbatch_size):
            yield self._rows(start, min(start + microbatch_size, size))

    def make_microbatch_iterator_with_dynamic_shapes(self) -> Iterator[BatchedDataDict[DictT]]:
        """The planned dynamic micro-batches, in order.

        Tensors whose dim 1 equals the token tensor's (``[batch, seq, ...]``) are cut to the
        micro-batch's padded length (or kept whole when that is longer than ``seq``).
        """
        plan = self._require_plan("dynamic")
        seq_len = self[plan.input_key].shape[1]
        for (start, end), length in zip(plan.ranges, plan.lengths):
            micro_batch = self._rows(start, end)
            micro_batch.cut_sequences(seq_len, length)
            yield micro_batch

    def cut_sequences(self, seq_len: int, length: int) -> None:
        """In place: every tensor ``[batch, seq_len, ...]`` keeps its first ``length``
        positions (a ``length`` beyond ``seq_len`` keeps them all)."""
        for key, value in self.items():
            is_tensor = isinstance(value, torch.Tensor)
            if is_tensor and value.ndim >= 2 and value.shape[1] == seq_len:
                self[key] = value[:, :length]

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """Number of micro-batches :meth:`make_microbatch_iterator_with_dynamic_shapes` yields."""
        return len(self._require_plan("dynamic").ranges)

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[BatchedDataDict[DictT]]:
        """The planned packing bins, in order, each as the (unpacked, padded) rows of its
        samples; the worker concatenates them into one row."""
        plan = self._require_plan("packed")
        for start, end in plan.ranges:
            yield self._rows(start, end)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> int:
        """Number of bins :meth:`make_microbatch_iterator_for_packable_sequences` yields."""
        return len(self._require_plan("packed").ranges)

    # ------------------------------------------------------------------ helpers

    def _map(
        self,
        on_tensor: Callable[[torch.Tensor], torch.Tensor],
        on_list: Callable[[list[Any]], list[Any]],
    ) -> BatchedDataDict[DictT]:
        """A new dict (without plan) applying ``on_tensor`` / ``on_list`` to every value."""
        self.size  # validates
        out: BatchedDataDict[DictT] = type(self)()
        for key, value in self.items():
            out[key] = on_tensor(value) if isinstance(value, torch.Tensor) else on_list(value)
        return out

    def _rows(self, start: int, end: int) -> BatchedDataDict[DictT]:
        return self._map(lambda t: t[start:end], lambda values: values[start:end])

    def _require_plan(self, kind: Literal["dynamic", "packed"] | None) -> MicroBatchPlan:
        plan = self.micro_batch_plan
        if plan is None:
            raise ValueError(
                "this BatchedDataDict has no micro-batch plan; make it with shard_by_batch_size("
                "..., dynamic_batching_args=... or sequence_packing_args=...) and select rows only "
                "with slice/get_batch/split_global_batches on micro-batch boundaries"
            )
        if kind is not None and plan.kind != kind:
            raise ValueError(
                f"this shard was planned for {plan.kind!r} micro-batches, not {kind!r}; use the "
                "iterator that matches the sharding arguments"
            )
        return plan

    def _sequence_lengths(self, input_key: str, lengths_key: str) -> list[int]:
        """Validated per-sample lengths (tokens) from ``lengths_key``."""
        for key in (input_key, lengths_key):
            if key not in self:
                raise ValueError(f"key '{key}' is missing; present keys: {sorted(self.keys())}")
        tokens = self[input_key]
        if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
            raise ValueError(f"'{input_key}' must be a tensor of shape [batch, seq]")
        raw = self[lengths_key]
        if isinstance(raw, torch.Tensor):
            if raw.ndim != 1 or raw.is_floating_point():
                raise ValueError(f"'{lengths_key}' must be a 1-D integer tensor [batch]")
            raw = raw.tolist()
        lengths = [int(n) for n in raw]
        for i, n in enumerate(lengths):
            if not 1 <= n <= tokens.shape[1]:
                raise ValueError(
                    f"'{lengths_key}'[{i}] = {n} is outside [1, {tokens.shape[1]}] (the sequence "
                    f"dimension of '{input_key}'); lengths count the real tokens of each sample"
                )
        return lengths


@dataclass(frozen=True)
class ShardedBatch(Generic[DictT]):
    """What :meth:`BatchedDataDict.shard_by_batch_size` returns, whatever the mode.

    Not a tuple on purpose: passing it where a list of shards is expected fails at once instead
    of being read as two shards.

    Attributes:
        shards: one :class:`BatchedDataDict` per DP rank, in rank order.
        sorted_indices: ``sorted_indices[j]`` is the original row of row ``j`` of the shards
            concatenated in rank order (length = rows of the sharded batch); pass it to
            :meth:`BatchedDataDict.reorder_data` to restore the original order of results.
    """

    shards: list[BatchedDataDict[DictT]]
    sorted_indices: list[int]


# ---------------------------------------------------------------------- small utilities


def _batch_len(key: str, value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.ndim == 0:
            raise TypeError(f"'{key}' is a 0-dim tensor; values need the batch as dimension 0")
        return value.shape[0]
    if isinstance(value, list):
        return len(value)
    raise TypeError(
        f"'{key}' is a {type(value).__name__}; BatchedDataDict values must be torch tensors "
        "[batch, ...] or lists of length batch"
    )


def _cat_right_padded(key: str, values: list[torch.Tensor], pad_value: int | float) -> torch.Tensor:
    """Concatenate along dim 0, right-padding dim 1 of rank >= 2 tensors to the longest."""
    ranks = {v.ndim for v in values}
    if len(ranks) != 1 or len({v.shape[2:] for v in values}) != 1:
        raise ValueError(
            f"'{key}' has shapes {[tuple(v.shape) for v in values]} across batches; only dim 1 "
            "(sequence) may differ"
        )
    if values[0].ndim >= 2:
        longest = max(v.shape[1] for v in values)
        padded = []
        for v in values:
            if v.shape[1] < longest:
                full = v.new_full((v.shape[0], longest, *v.shape[2:]), pad_value)
                full[:, : v.shape[1]] = v
                v = full
            padded.append(v)
        values = padded
    return torch.cat(values, dim=0)


def _index_list(indices: torch.Tensor | Sequence[int], size: int) -> list[int]:
    if isinstance(indices, torch.Tensor):
        if indices.ndim != 1 or indices.is_floating_point() or indices.dtype == torch.bool:
            raise TypeError("indices must be a 1-D integer tensor or a sequence of ints")
        indices = indices.tolist()
    idx = [int(i) for i in indices]
    for i in idx:
        if not 0 <= i < size:
            raise ValueError(f"index {i} is outside [0, {size})")
    return idx
