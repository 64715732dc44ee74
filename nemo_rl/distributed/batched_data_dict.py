"""Batch-first dictionaries and how they are split across data-parallel (DP) ranks.

A :class:`BatchedDataDict` maps names to values whose first dimension is the batch: torch tensors
of shape ``[batch, ...]`` and python lists of length ``batch``. Token tensors are right-padded
``[batch, seq]``; the true length of every sample (tokens) lives under its own key, e.g.
``input_lengths`` of shape ``[batch]``.

:meth:`BatchedDataDict.shard_by_batch_size` splits a batch into one shard per DP rank in one of
three modes:

* plain: every global batch is cut into ``shards`` contiguous slices; shard ``i`` is the
  concatenation of its slice of every global batch;
* dynamic batching (:class:`DynamicBatchingArgs`): samples are sorted by length and grouped into
  padded micro-batches of variable row count under a token budget;
* sequence packing (:class:`SequencePackingArgs`): samples are bin-packed into micro-batches that
  the worker later concatenates into one row (``cu_seqlens`` style) under a token budget.

The two budgeted modes reorder samples and attach a :class:`MicroBatchPlan` to every shard. They
return the global sample indices in shard order as well, and :meth:`BatchedDataDict.reorder_data`
uses them to put results gathered from the shards back into the original order.

:func:`plan_shards` makes the same decisions from the row count and the sequence lengths alone,
for callers that hold only metadata (``nemo_rl.data_plane.preshard``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypedDict, TypeVar

import torch

DictT = TypeVar("DictT", bound=Mapping[str, Any])

PackingAlgorithm = Literal["first_fit_decreasing", "modified_first_fit_decreasing"]


class DynamicBatchingArgs(TypedDict):
    """Settings of dynamic batching (padded micro-batches of variable row count)."""

    # Key of the right-padded token tensor [batch, seq]; tensors whose dim 1 equals its dim 1 are
    # cut to the micro-batch's padded length when iterating.
    input_key: str
    # Key of the true sequence lengths [batch] (tokens, each >= 1).
    input_lengths_key: str
    # Token budget of one micro-batch: rows * padded length (tokens) must not exceed it.
    max_tokens_per_microbatch: int
    # A micro-batch's padded length is its longest sample rounded up to a multiple of this (tokens).
    sequence_length_round: int


class SequencePackingArgs(TypedDict):
    """Settings of sequence packing (samples concatenated into one row per micro-batch)."""

    # Key of the right-padded token tensor [batch, seq].
    input_key: str
    # Key of the true sequence lengths [batch] (tokens, each >= 1).
    input_lengths_key: str
    # Token budget of one packed micro-batch: the sum of its samples' rounded lengths (tokens).
    max_tokens_per_microbatch: int
    # Bin-packing heuristic; see first_fit_decreasing / modified_first_fit_decreasing.
    algorithm: PackingAlgorithm
    # Every sample's length is rounded up to a multiple of this before packing (tokens).
    sequence_length_round: int


@dataclass(frozen=True)
class MicroBatchPlan:
    """How one DP shard is cut into micro-batches by dynamic batching or sequence packing.

    Attributes:
        kind: ``"dynamic"`` (padded micro-batches) or ``"packed"`` (bins packed into one row).
        ranges: ``[start, end)`` row ranges of the shard, one per micro-batch, contiguous and in
            row order.
        lengths: per micro-batch, in tokens: for ``"dynamic"`` the padded sequence length (a
            multiple of ``sequence_length_round``); for ``"packed"`` the packed row length, i.e.
            the sum of the samples' lengths each rounded up to ``sequence_length_round``.
        input_key: key of the ``[batch, seq]`` token tensor the plan was made for.
        global_batch_offsets: row offsets at which global batches start, followed by the number
            of rows (length = number of global batches + 1). No micro-batch crosses one.
    """

    kind: Literal["dynamic", "packed"]
    ranges: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]
    input_key: str
    global_batch_offsets: tuple[int, ...]

    def sliced(self, start: int, end: int) -> MicroBatchPlan | None:
        """The plan of rows ``[start, end)``, or None when the slice cuts through a micro-batch."""
        kept = [k for k, (a, b) in enumerate(self.ranges) if a < end and b > start]
        if not kept or any(self.ranges[k][0] < start or self.ranges[k][1] > end for k in kept):
            return None
        inner = {o - start for o in self.global_batch_offsets if start < o < end}
        return MicroBatchPlan(
            kind=self.kind,
            ranges=tuple((self.ranges[k][0] - start, self.ranges[k][1] - start) for k in kept),
            lengths=tuple(self.lengths[k] for k in kept),
            input_key=self.input_key,
            global_batch_offsets=tuple(sorted(inner | {0, end - start})),
        )


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
        ``reordered_indices[j]``. Pass the indices :meth:`shard_by_batch_size` returned to put
        results gathered from the shards (concatenated in shard order) back in original order.
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
    ) -> list[BatchedDataDict[DictT]] | tuple[list[BatchedDataDict[DictT]], list[int]]:
        """Split the batch into ``shards`` DP shards, global batch by global batch.

        The batch is cut into global batches of ``batch_size`` rows (default: the whole batch),
        each global batch is divided among the shards, and shard ``i`` concatenates its part of
        every global batch, so rank ``i`` can step through global batches in order.

        Plain (no args): shard ``i`` gets a contiguous slice of each global batch. Returns the
        list of shards. ``batch_size`` must be a multiple of ``shards`` unless
        ``allow_uneven_shards``, in which case slice sizes differ by at most one (the first
        ``batch_size % shards`` shards get one more row; some may be empty).

        Dynamic batching: within each global batch, samples are sorted by length (descending,
        ties by index) and dealt round-robin to the shards (balancing tokens). Each shard groups
        its samples greedily, in that order, into micro-batches with
        ``rows * round_up(longest, sequence_length_round) <= max_tokens_per_microbatch``. Shards
        with fewer micro-batches than the most split their micro-batch with the most rows in two
        halves until all shards have the same count, since a rank with fewer micro-batches would
        hang the others in collectives. ``allow_uneven_shards`` works as in plain mode.

        Sequence packing: within each global batch, lengths rounded up to
        ``sequence_length_round`` are bin-packed with ``algorithm`` into bins of at most
        ``max_tokens_per_microbatch`` tokens. The bin with the most tokens (among bins of >= 2
        samples) is split in two, balancing tokens, until the bin count is a positive multiple of
        ``shards``; bins, largest first, then go to the shard with the fewest tokens that still
        has room for its equal share of bins. Shards therefore hold equal bin counts but may hold
        different numbers of samples; ``batch_size`` need not be a multiple of ``shards``.

        Returns:
            Plain: ``list`` of shards. Dynamic batching or sequence packing: ``(shards,
            sorted_indices)`` where ``sorted_indices[j]`` is the original row of row ``j`` of
            the shards concatenated in order, for :meth:`reorder_data`. Each shard then carries a
            :class:`MicroBatchPlan` in ``micro_batch_plan``.
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
        if plan.micro_batch_plans is None:
            return [self.select_indices(rows) for rows in plan.rows]
        out: list[BatchedDataDict[DictT]] = []
        for rows, micro_batch_plan in zip(plan.rows, plan.micro_batch_plans):
            shard = self.select_indices(rows)
            shard.micro_batch_plan = micro_batch_plan
            out.append(shard)
        return out, [i for rows in plan.rows for i in rows]

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
            for key, value in micro_batch.items():
                is_tensor = isinstance(value, torch.Tensor)
                if is_tensor and value.ndim >= 2 and value.shape[1] == seq_len:
                    micro_batch[key] = value[:, :length]
            yield micro_batch

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


# ---------------------------------------------------------------------- bin packing


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity``: largest first, each into the first bin with room.

    Returns bins as lists of item positions in ``sizes``.
    """
    _check_fits(sizes, capacity)
    bins: list[list[int]] = []
    loads: list[int] = []
    _first_fit(bins, loads, _descending(range(len(sizes)), sizes), sizes, capacity)
    return bins


def modified_first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Pack items into bins of ``capacity`` with a variant of Johnson and Garey's modified FFD.

    Items are classed by size ``s`` relative to ``C = capacity``: large ``s > C/2``, medium
    ``C/3 < s <= C/2``, small ``C/6 < s <= C/3``, tiny the rest.

    1. Every large item opens its own bin, largest first.
    2. From the fullest large bin to the emptiest, each receives the largest medium item that
       still fits (at most one fits next to a large item).
    3. From the emptiest large bin to the fullest, if the two smallest remaining small items fit
       together, the bin receives the smallest, then the largest small item that still fits.
    4. All remaining items, largest first, go first-fit into the bins, opening new ones as needed.

    Every placement checks the capacity, so no bin exceeds it. Returns bins as lists of item
    positions in ``sizes``.
    """
    _check_fits(sizes, capacity)
    order = _descending(range(len(sizes)), sizes)
    large = [i for i in order if 2 * sizes[i] > capacity]
    medium = [i for i in order if 3 * sizes[i] > capacity >= 2 * sizes[i]]
    small = [i for i in order if 6 * sizes[i] > capacity >= 3 * sizes[i]]
    tiny = [i for i in order if capacity >= 6 * sizes[i]]
    bins = [[i] for i in large]
    loads = [sizes[i] for i in large]

    def place_largest_fitting(b: int, candidates: list[int]) -> None:
        for position, i in enumerate(candidates):  # candidates are in descending size
            if loads[b] + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                del candidates[position]
                return

    for b in range(len(bins)):
        place_largest_fitting(b, medium)
    for b in reversed(range(len(bins))):
        if len(small) < 2:
            break
        if loads[b] + sizes[small[-1]] + sizes[small[-2]] <= capacity:
            smallest = small.pop()
            bins[b].append(smallest)
            loads[b] += sizes[smallest]
            place_largest_fitting(b, small)
    _first_fit(bins, loads, _descending(medium + small + tiny, sizes), sizes, capacity)
    return bins


_PACKERS: dict[str, Callable[[Sequence[int], int], list[list[int]]]] = {
    "first_fit_decreasing": first_fit_decreasing,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}


def _first_fit(
    bins: list[list[int]],
    loads: list[int],
    items: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
) -> None:
    """Put each item into the first bin with room, opening a new bin when none has (in place)."""
    for i in items:
        for b, load in enumerate(loads):
            if load + sizes[i] <= capacity:
                bins[b].append(i)
                loads[b] += sizes[i]
                break
        else:
            bins.append([i])
            loads.append(sizes[i])


def _check_fits(sizes: Sequence[int], capacity: int) -> None:
    for i, size in enumerate(sizes):
        if size > capacity:
            raise ValueError(f"item {i} of size {size} does not fit a bin of capacity {capacity}")


def _descending(items: Sequence[int] | range, weights: Sequence[int]) -> list[int]:
    """Items by descending weight, ties by ascending item."""
    return sorted(items, key=lambda i: (-weights[i], i))


# ---------------------------------------------------------------------- micro-batch planning


@dataclass(frozen=True)
class ShardPlan:
    """Which rows each DP shard gets, in order, and how each shard is cut into micro-batches.

    Attributes:
        rows: per shard, the batch rows (indices into the sharded batch) in shard order.
        micro_batch_plans: per shard, its :class:`MicroBatchPlan` under dynamic batching or
            sequence packing; None in plain mode.
    """

    rows: tuple[tuple[int, ...], ...]
    micro_batch_plans: tuple[MicroBatchPlan, ...] | None


def plan_shards(
    total: int,
    shards: int,
    batch_size: int | None = None,
    allow_uneven_shards: bool = False,
    sequence_packing_args: SequencePackingArgs | None = None,
    dynamic_batching_args: DynamicBatchingArgs | None = None,
    sequence_lengths: Sequence[int] | None = None,
) -> ShardPlan:
    """The DP sharding of :meth:`BatchedDataDict.shard_by_batch_size`, from sizes alone.

    Args:
        total: rows of the batch.
        shards, batch_size, allow_uneven_shards, sequence_packing_args, dynamic_batching_args:
            as in :meth:`BatchedDataDict.shard_by_batch_size` (``input_key`` of the args only
            names the token tensor in the plans; ``input_lengths_key`` is not read).
        sequence_lengths: true length of every row (tokens, each >= 1, ``total`` of them);
            needed with dynamic batching or sequence packing, ignored otherwise.

    Raises:
        ValueError: on the argument errors listed by ``shard_by_batch_size``, or missing or
            invalid ``sequence_lengths`` in a token-budget mode.
    """
    if sequence_packing_args is not None and dynamic_batching_args is not None:
        raise ValueError("pass at most one of sequence_packing_args and dynamic_batching_args")
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    if total == 0:
        raise ValueError("cannot shard an empty batch")
    batch_size = total if batch_size is None else batch_size
    if batch_size < 1 or total % batch_size:
        raise ValueError(
            f"batch of {total} rows does not split into global batches of {batch_size}; "
            f"use a batch_size that divides {total}"
        )
    if sequence_packing_args is None and batch_size % shards and not allow_uneven_shards:
        raise ValueError(
            f"global batch size {batch_size} is not a multiple of shards={shards}; use a "
            f"multiple of {shards} or pass allow_uneven_shards=True"
        )
    starts = range(0, total, batch_size)

    if sequence_packing_args is None and dynamic_batching_args is None:
        per_shard: list[list[int]] = [[] for _ in range(shards)]
        for gb_start in starts:
            global_batch = range(gb_start, gb_start + batch_size)
            for s, part in enumerate(_split_evenly(global_batch, shards)):
                per_shard[s].extend(part)
        return ShardPlan(rows=tuple(tuple(r) for r in per_shard), micro_batch_plans=None)

    if dynamic_batching_args is not None:
        args: Mapping[str, Any] = _checked_args(dynamic_batching_args, DynamicBatchingArgs)
        kind: Literal["dynamic", "packed"] = "dynamic"
    else:
        args = _checked_args(sequence_packing_args, SequencePackingArgs)
        kind = "packed"
    lengths = _checked_lengths(sequence_lengths, total)
    budget = args["max_tokens_per_microbatch"]
    round_to = args["sequence_length_round"]
    rounded = [_round_up(n, round_to) for n in lengths]
    for i, n in enumerate(rounded):
        if n > budget:
            raise ValueError(
                f"sample {i} has {lengths[i]} tokens ({n} after rounding up to a multiple of "
                f"sequence_length_round={round_to}), more than max_tokens_per_microbatch="
                f"{budget}; raise max_tokens_per_microbatch to at least {n}"
            )

    # Per shard: global row indices in shard order, micro-batch row ranges, their lengths.
    rows: list[list[int]] = [[] for _ in range(shards)]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(shards)]
    mb_lengths: list[list[int]] = [[] for _ in range(shards)]
    offsets: list[list[int]] = [[0] for _ in range(shards)]
    for gb_index, gb_start in enumerate(starts):
        samples = list(range(gb_start, gb_start + batch_size))
        if kind == "dynamic":
            groups = _dynamic_groups(samples, lengths, rounded, budget, shards, gb_index)
        else:
            groups = _packed_groups(samples, rounded, budget, args["algorithm"], shards, gb_index)
        for s, shard_groups in enumerate(groups):
            for group in shard_groups:
                start = len(rows[s])
                rows[s].extend(group)
                ranges[s].append((start, len(rows[s])))
                if kind == "dynamic":
                    mb_lengths[s].append(max(rounded[i] for i in group))
                else:
                    mb_lengths[s].append(sum(rounded[i] for i in group))
            offsets[s].append(len(rows[s]))

    return ShardPlan(
        rows=tuple(tuple(r) for r in rows),
        micro_batch_plans=tuple(
            MicroBatchPlan(
                kind=kind,
                ranges=tuple(ranges[s]),
                lengths=tuple(mb_lengths[s]),
                input_key=args["input_key"],
                global_batch_offsets=tuple(offsets[s]),
            )
            for s in range(shards)
        ),
    )


def _checked_lengths(sequence_lengths: Sequence[int] | None, total: int) -> list[int]:
    """``sequence_lengths`` as ints, checked to be ``total`` lengths of >= 1 token."""
    if sequence_lengths is None:
        raise ValueError(
            "dynamic batching and sequence packing need the length (tokens) of every sample; "
            "pass sequence_lengths"
        )
    lengths = [int(n) for n in sequence_lengths]
    if len(lengths) != total:
        raise ValueError(f"got {len(lengths)} sequence lengths for a batch of {total} rows")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence length {i} is {n}; every sample needs at least 1 token")
    return lengths


def _dynamic_groups(
    samples: list[int],
    lengths: Sequence[int],
    rounded: Sequence[int],
    budget: int,
    shards: int,
    gb_index: int,
) -> list[list[list[int]]]:
    """Per shard, the micro-batches (lists of sample indices) of one global batch."""
    order = _descending(samples, lengths)
    per_shard: list[list[list[int]]] = []
    for s in range(shards):
        groups: list[list[int]] = []
        for i in order[s::shards]:
            # Samples come longest first, so a group's padded length is that of its first sample.
            if groups and (len(groups[-1]) + 1) * rounded[groups[-1][0]] <= budget:
                groups[-1].append(i)
            else:
                groups.append([i])
        per_shard.append(groups)
    target = max(len(groups) for groups in per_shard)
    for s, groups in enumerate(per_shard):
        while len(groups) < target:
            k = max(range(len(groups)), key=lambda k: len(groups[k]), default=None)
            if k is None or len(groups[k]) < 2:
                raise ValueError(_too_few_samples(s, gb_index, sum(map(len, groups)), target))
            half = (len(groups[k]) + 1) // 2
            groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
    return per_shard


def _packed_groups(
    samples: list[int],
    rounded: Sequence[int],
    budget: int,
    algorithm: str,
    shards: int,
    gb_index: int,
) -> list[list[list[int]]]:
    """Per shard, the packing bins (lists of sample indices) of one global batch."""
    sizes = [rounded[i] for i in samples]
    bins = [[samples[p] for p in b] for b in _PACKERS[algorithm](sizes, budget)]
    tokens = [sum(rounded[i] for i in b) for b in bins]
    while len(bins) < shards or len(bins) % shards:
        splittable = [k for k in range(len(bins)) if len(bins[k]) >= 2]
        if not splittable:
            target = -(-len(bins) // shards) * shards
            raise ValueError(
                f"global batch {gb_index} has {len(samples)} samples, which cannot form a "
                f"multiple of shards={shards} packing bins ({target} needed, one sample per bin at "
                f"most {len(bins)}); use a global batch size that is a multiple of {shards}"
            )
        k = max(splittable, key=lambda k: tokens[k])
        first, second = _split_balanced(bins[k], rounded)
        bins[k : k + 1] = [first, second]
        tokens[k : k + 1] = [sum(rounded[i] for i in first), sum(rounded[i] for i in second)]
    quota = len(bins) // shards
    per_shard: list[list[list[int]]] = [[] for _ in range(shards)]
    shard_tokens = [0] * shards
    for k in _descending(range(len(bins)), tokens):
        s = min(
            (s for s in range(shards) if len(per_shard[s]) < quota),
            key=lambda s: (shard_tokens[s], s),
        )
        per_shard[s].append(_descending(bins[k], rounded))
        shard_tokens[s] += tokens[k]
    return per_shard


def _split_balanced(items: list[int], weights: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two non-empty halves of >= 2 items with close total weight (heaviest to lighter half)."""
    halves: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for i in _descending(items, weights):
        h = 0 if totals[0] <= totals[1] else 1
        halves[h].append(i)
        totals[h] += weights[i]
    return halves


def _too_few_samples(shard: int, gb_index: int, samples: int, target: int) -> str:
    return (
        f"DP shard {shard} has {samples} samples in global batch {gb_index} but every shard needs "
        f"{target} micro-batches of at least one sample; use a larger global batch size, a "
        "multiple of the number of shards, or a larger max_tokens_per_microbatch"
    )


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


def _split_evenly(items: range, parts: int) -> list[range]:
    """``parts`` contiguous ranges whose sizes differ by at most one, larger ones first."""
    base, extra = divmod(len(items), parts)
    out = []
    start = items.start
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _checked_args(args: Mapping[str, Any] | None, spec: type) -> Mapping[str, Any]:
    """Validate a DynamicBatchingArgs / SequencePackingArgs mapping."""
    assert args is not None
    name = spec.__name__
    missing = [k for k in spec.__annotations__ if k not in args]
    if missing:
        raise ValueError(f"{name} is missing {missing}; it needs {list(spec.__annotations__)}")
    for key in ("max_tokens_per_microbatch", "sequence_length_round"):
        if not isinstance(args[key], int) or args[key] < 1:
            raise ValueError(f"{name}['{key}'] must be a positive int (tokens), got {args[key]!r}")
    if "algorithm" in spec.__annotations__ and args["algorithm"] not in _PACKERS:
        raise ValueError(
            f"{name}['algorithm'] = {args['algorithm']!r} is unknown; use one of {sorted(_PACKERS)}"
        )
    return args
