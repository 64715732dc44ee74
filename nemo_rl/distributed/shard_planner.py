"""The DP shard planner: which rows each data-parallel rank gets, cut into which micro-batches.

:func:`plan_shards` decides from the row count and the sequence lengths alone (no tensors), so
the in-memory path (:meth:`BatchedDataDict.shard_by_batch_size
<nemo_rl.distributed.batched_data_dict.BatchedDataDict.shard_by_batch_size>`) and the data-plane
path (``nemo_rl.data_plane.preshard``, which holds only metadata) make the same decisions. Three
modes:

* plain: every global batch is cut into ``shards`` contiguous slices; shard ``i`` is the
  concatenation of its slice of every global batch;
* dynamic batching (:class:`DynamicBatchingArgs`): samples are sorted by length and grouped into
  padded micro-batches of variable row count under a token budget;
* sequence packing (:class:`SequencePackingArgs`): samples are bin-packed
  (:mod:`nemo_rl.distributed.bin_packing`) into micro-batches that the worker later concatenates
  into one row (``cu_seqlens`` style) under a token budget.

The two budgeted modes reorder samples and give every shard a :class:`MicroBatchPlan`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from nemo_rl.distributed.bin_packing import PACKERS, PackingAlgorithm, descending_order


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
    """Split ``total`` rows into ``shards`` DP shards, global batch by global batch.

    The rows are cut into global batches of ``batch_size`` rows (default: all of them), each
    global batch is divided among the shards, and shard ``i`` concatenates its part of every
    global batch, so rank ``i`` can step through global batches in order.

    Plain (no args): shard ``i`` gets a contiguous slice of each global batch. ``batch_size``
    must be a multiple of ``shards`` unless ``allow_uneven_shards``, in which case slice sizes
    differ by at most one (the first ``batch_size % shards`` shards get one more row; some may be
    empty).

    Dynamic batching: within each global batch, samples are sorted by length (descending, ties by
    index) and dealt round-robin to the shards (balancing tokens). Each shard groups its samples
    greedily, in that order, into micro-batches with ``rows * round_up(longest,
    sequence_length_round) <= max_tokens_per_microbatch``. Shards with fewer micro-batches than
    the most split their micro-batch with the most rows in two halves until all shards have the
    same count, since a rank with fewer micro-batches would hang the others in collectives.
    ``allow_uneven_shards`` works as in plain mode.

    Sequence packing: within each global batch, lengths rounded up to ``sequence_length_round``
    are bin-packed with ``algorithm`` into bins of at most ``max_tokens_per_microbatch`` tokens.
    The bin with the most tokens (among bins of >= 2 samples) is split in two, balancing tokens,
    until the bin count is a positive multiple of ``shards``; bins, largest first, then go to the
    shard with the fewest tokens that still has room for its equal share of bins. Shards
    therefore hold equal bin counts but may hold different numbers of samples; ``batch_size``
    need not be a multiple of ``shards``.

    Args:
        total: rows of the batch.
        shards: number of DP shards (ranks), >= 1.
        batch_size: rows per global batch (one optimizer step); must divide ``total``.
        allow_uneven_shards: let plain and dynamic shards differ by one row per global batch.
        sequence_packing_args, dynamic_batching_args: at most one; selects the mode
            (``input_key`` only names the token tensor in the plans; ``input_lengths_key`` is
            not read here).
        sequence_lengths: true length of every row (tokens, each >= 1, ``total`` of them);
            needed with dynamic batching or sequence packing, ignored otherwise.

    Raises:
        ValueError: both args given, a batch size that does not divide ``total`` or (plain and
            dynamic) is not a multiple of ``shards``, a sample longer than the token budget, too
            few samples to give every shard the same micro-batch count, malformed args, or
            missing or invalid ``sequence_lengths`` in a token-budget mode.
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
    order = descending_order(samples, lengths)
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
    bins = [[samples[p] for p in b] for b in PACKERS[algorithm](sizes, budget)]
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
    for k in descending_order(range(len(bins)), tokens):
        s = min(
            (s for s in range(shards) if len(per_shard[s]) < quota),
            key=lambda s: (shard_tokens[s], s),
        )
        per_shard[s].append(descending_order(bins[k], rounded))
        shard_tokens[s] += tokens[k]
    return per_shard


def _split_balanced(items: list[int], weights: Sequence[int]) -> tuple[list[int], list[int]]:
    """Two non-empty halves of >= 2 items with close total weight (heaviest to lighter half)."""
    halves: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for i in descending_order(items, weights):
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
    if "algorithm" in spec.__annotations__ and args["algorithm"] not in PACKERS:
        raise ValueError(
            f"{name}['algorithm'] = {args['algorithm']!r} is unknown; use one of {sorted(PACKERS)}"
        )
    return args
