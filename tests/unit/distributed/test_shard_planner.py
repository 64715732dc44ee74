"""Tests of plan_shards: DP shard rows and micro-batch plans from sequence lengths alone."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from nemo_rl.distributed.shard_planner import MicroBatchPlan, ShardPlan, plan_shards
from sharding_cases import dynamic_args, mode_kwargs, packing_args, round_up, sharding_cases

# ---------------------------------------------------------------------- plain


def test_plain_plan_of_known_batch() -> None:
    # Global batches [0..3] and [4..7]; each split in two contiguous halves.
    assert plan_shards(8, 2, batch_size=4) == ShardPlan(
        rows=((0, 1, 4, 5), (2, 3, 6, 7)), micro_batch_plans=None
    )


def test_plain_uneven_shards() -> None:
    with pytest.raises(ValueError, match="not a multiple of shards=2; .* allow_uneven_shards"):
        plan_shards(5, 2)
    assert plan_shards(5, 2, allow_uneven_shards=True).rows == ((0, 1, 2), (3, 4))
    assert plan_shards(2, 3, allow_uneven_shards=True).rows == ((0,), (1,), ())


def test_batch_size_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="use a batch_size that divides 6"):
        plan_shards(6, 1, batch_size=4)


# ---------------------------------------------------------------------- dynamic batching


def test_dynamic_batching_known_plan() -> None:
    lengths = [5, 1, 3, 8]
    # Sorted by length: rows 3 (8), 0 (5), 2 (3), 1 (1); dealt round-robin -> [3, 2] and [0, 1].
    # Shard 0: 2 rows * 8 > 10, so two micro-batches. Shard 1: 2 rows * 5 <= 10 fits one, but is
    # split so both ranks run two.
    plan = plan_shards(4, 2, dynamic_batching_args=dynamic_args(10, 1), sequence_lengths=lengths)
    assert plan == ShardPlan(
        rows=((3, 2), (0, 1)),
        micro_batch_plans=(
            MicroBatchPlan("dynamic", ((0, 1), (1, 2)), (8, 3), "input_ids", (0, 2)),
            MicroBatchPlan("dynamic", ((0, 1), (1, 2)), (5, 1), "input_ids", (0, 2)),
        ),
    )
    # Rounding to 4: rows 3 and 2 pad to 8 (2 * 8 <= 16), rows 0 and 1 pad to 8 as well.
    plan = plan_shards(4, 2, dynamic_batching_args=dynamic_args(16, 4), sequence_lengths=lengths)
    assert plan.micro_batch_plans is not None
    assert [p.lengths for p in plan.micro_batch_plans] == [(8,), (8,)]
    assert [p.ranges for p in plan.micro_batch_plans] == [((0, 2),), ((0, 2),)]


def test_dynamic_batching_overlong_sample_raises() -> None:
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens \(12 after rounding.*=8; raise"):
        plan_shards(2, 1, dynamic_batching_args=dynamic_args(8, 4), sequence_lengths=[3, 9])


def test_dynamic_batching_too_few_samples_for_equal_micro_batch_counts() -> None:
    # Longest first, dealt round-robin: shard 0 gets rows 0 (9) and 2 (1), which a budget of 9
    # puts in two micro-batches; shard 1 gets row 1 alone and cannot split it to match.
    with pytest.raises(ValueError, match="DP shard 1 has 1 samples in global batch 0"):
        plan_shards(
            3, 2, allow_uneven_shards=True, dynamic_batching_args=dynamic_args(9, 1),
            sequence_lengths=[9, 9, 1],
        )


# ---------------------------------------------------------------------- sequence packing


def test_packing_known_plan_and_bin_splitting() -> None:
    lengths = [6, 5, 4, 3, 2]
    plan = plan_shards(5, 2, sequence_packing_args=packing_args(10, 1), sequence_lengths=lengths)
    assert plan == ShardPlan(
        rows=((0, 2), (1, 3, 4)),
        micro_batch_plans=(
            MicroBatchPlan("packed", ((0, 2),), (10,), "input_ids", (0, 2)),
            MicroBatchPlan("packed", ((0, 3),), (10,), "input_ids", (0, 3)),
        ),
    )
    # A budget of 100 packs everything into one bin; two shards need two, so it is split in
    # halves of 6+3+2 = 11 and 5+4 = 9 tokens.
    plan = plan_shards(5, 2, sequence_packing_args=packing_args(100, 1), sequence_lengths=lengths)
    assert plan.rows == ((0, 3, 4), (1, 2))
    assert plan.micro_batch_plans is not None
    assert [p.lengths for p in plan.micro_batch_plans] == [(11,), (9,)]


def test_packing_overlong_sample_names_index_and_budget() -> None:
    with pytest.raises(
        ValueError, match=r"sample 1 has 20 tokens .* max_tokens_per_microbatch=16; raise"
    ):
        plan_shards(3, 1, sequence_packing_args=packing_args(16, 1), sequence_lengths=[3, 20, 4])


def test_packing_cannot_give_every_shard_a_bin() -> None:
    with pytest.raises(ValueError, match="cannot form a multiple of shards=2"):
        plan_shards(3, 2, sequence_packing_args=packing_args(8, 1), sequence_lengths=[8, 8, 8])


# ---------------------------------------------------------------------- argument errors


DYNAMIC = {"dynamic_batching_args": dynamic_args(8, 1)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {**DYNAMIC, "sequence_packing_args": packing_args(8, 1)},
            "at most one of sequence_packing_args and dynamic_batching_args",
        ),
        ({"sequence_packing_args": dynamic_args(8, 1)}, r"missing \['algorithm'\]"),
        ({"sequence_packing_args": packing_args(8, 1, "best_fit")}, "'best_fit' is unknown"),
        ({"dynamic_batching_args": dynamic_args(0, 1)}, r"\['max_tokens_per_microbatch'\] must"),
        ({**DYNAMIC, "sequence_lengths": None}, "pass sequence_lengths"),
        ({**DYNAMIC, "sequence_lengths": [2]}, "got 1 sequence lengths for a batch of 2 rows"),
        ({**DYNAMIC, "sequence_lengths": [2, 0]}, "sequence length 1 is 0"),
        ({"shards": 0}, "shards must be a positive int"),
    ],
)
def test_argument_errors_name_the_field(kwargs: dict[str, Any], message: str) -> None:
    call: dict[str, Any] = {"shards": 1, "sequence_lengths": [2, 2], **kwargs}
    with pytest.raises(ValueError, match=message):
        plan_shards(2, **call)


# ---------------------------------------------------------------------- properties


@settings(max_examples=50, deadline=None)
@given(case=sharding_cases())
def test_plain_shard_takes_its_slice_of_every_global_batch(case: dict[str, Any]) -> None:
    total, batch_size, shards = len(case["lengths"]), case["batch_size"], case["shards"]
    plan = plan_shards(total, shards, batch_size)
    local = batch_size // shards
    assert plan.micro_batch_plans is None
    for s, rows in enumerate(plan.rows):
        assert rows == tuple(
            start + s * local + j for start in range(0, total, batch_size) for j in range(local)
        )


@settings(max_examples=50, deadline=None)
@given(case=sharding_cases(), mode=st.sampled_from(["dynamic", "packed"]))
def test_micro_batch_plans_respect_budget_and_cover_every_sample(
    case: dict[str, Any], mode: str
) -> None:
    lengths, budget, round_to = case["lengths"], case["budget"], case["round_to"]
    plan = plan_shards(
        len(lengths), case["shards"], case["batch_size"], sequence_lengths=lengths,
        **mode_kwargs(case, mode),
    )
    assert plan.micro_batch_plans is not None
    seen: list[int] = []
    counts_per_shard = []
    for rows, mb_plan in zip(plan.rows, plan.micro_batch_plans):
        assert mb_plan.kind == mode and mb_plan.input_key == "input_ids"
        # Micro-batches tile the shard's rows in order, without gaps.
        bounds = [a for a, _ in mb_plan.ranges] + [mb_plan.ranges[-1][1]]
        assert bounds[0] == 0 and bounds[-1] == len(rows)
        assert all(a < b for a, b in mb_plan.ranges)
        assert [b for _, b in mb_plan.ranges[:-1]] == bounds[1:-1]
        for (a, b), length in zip(mb_plan.ranges, mb_plan.lengths):
            group = rows[a:b]
            if mode == "dynamic":
                assert length == round_up(max(lengths[i] for i in group), round_to)
                assert len(group) * length <= budget
            else:
                assert length == sum(round_up(lengths[i], round_to) for i in group) <= budget
        # Global batches start at micro-batch boundaries and hold only their own samples.
        offsets = mb_plan.global_batch_offsets
        assert len(offsets) == len(lengths) // case["batch_size"] + 1
        assert set(offsets) <= set(bounds)
        counts = []
        for g, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            assert all(i // case["batch_size"] == g for i in rows[a:b])
            counts.append(sum(1 for start, _ in mb_plan.ranges if a <= start < b))
        counts_per_shard.append(counts)
        seen.extend(rows)
    assert sorted(seen) == list(range(len(lengths)))
    # Every rank runs the same number of micro-batches in every global batch.
    assert all(counts == counts_per_shard[0] for counts in counts_per_shard)
