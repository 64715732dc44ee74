"""shard_meta_for_dp makes the decisions of BatchedDataDict.shard_by_batch_size from lengths."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nemo_rl.data_plane import KVBatchMeta, shard_meta_for_dp
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.distributed.shard_planner import DynamicBatchingArgs, SequencePackingArgs

ALGORITHMS = ["first_fit_decreasing", "modified_first_fit_decreasing"]


def meta_of(lengths: list[int]) -> KVBatchMeta:
    return KVBatchMeta(
        partition_id="train",
        keys=[f"k{i}" for i in range(len(lengths))],
        sequence_lengths=lengths,
        fields=["input_ids", "input_lengths"],
        tags=[{"row": i} for i in range(len(lengths))],
        extra_info={"pad_to": 64},
    )


def batch_of(lengths: list[int]) -> BatchedDataDict[Any]:
    """The in-memory batch with the same lengths: right-padded ids and a row id per sample."""
    n, longest = len(lengths), max(lengths, default=1)
    return BatchedDataDict(
        input_ids=torch.ones(n, longest, dtype=torch.long),
        input_lengths=torch.tensor(lengths, dtype=torch.long),
        row=torch.arange(n),
    )


def budget_args(mode: str, budget: int, round_to: int, algorithm: str) -> dict[str, Any]:
    common = {"input_key": "input_ids", "input_lengths_key": "input_lengths",
              "max_tokens_per_microbatch": budget, "sequence_length_round": round_to}
    if mode == "dynamic":
        return {"dynamic_batching_args": DynamicBatchingArgs(**common)}
    if mode == "packed":
        return {"sequence_packing_args": SequencePackingArgs(**common, algorithm=algorithm)}
    return {}


def assert_same_sharding(lengths: list[int], shards: int, **kwargs: Any) -> list[KVBatchMeta]:
    """shard_meta_for_dp on the meta equals shard_by_batch_size on the batch (or both raise the
    same error); returns the meta shards."""
    meta = meta_of(lengths)
    try:
        batch_shards = batch_of(lengths).shard_by_batch_size(shards, **kwargs).shards
    except ValueError as err:
        with pytest.raises(ValueError, match=re.escape(str(err))):
            shard_meta_for_dp(meta, shards, **kwargs)
        return []
    meta_shards = shard_meta_for_dp(meta, shards, **kwargs)
    assert len(meta_shards) == len(batch_shards) == shards
    for got, want in zip(meta_shards, batch_shards):
        rows = want["row"].tolist()
        assert got.keys == tuple(f"k{i}" for i in rows)
        assert got.sequence_lengths == tuple(want["input_lengths"].tolist())
        assert got.tags == tuple({"row": i} for i in rows)
        assert got.micro_batch_plan == want.micro_batch_plan
        assert (got.partition_id, got.fields, got.extra_info) == (
            meta.partition_id, meta.fields, meta.extra_info
        )
    # Every sample goes to exactly one rank.
    assert sorted(k for m in meta_shards for k in m.keys) == sorted(meta.keys)
    return meta_shards


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    shards = draw(st.integers(1, 4))
    global_batches = draw(st.integers(1, 3))
    batch_size = draw(st.integers(1, 10))
    seq_len = draw(st.integers(1, 40))
    lengths = draw(
        st.lists(st.integers(1, seq_len), min_size=batch_size * global_batches,
                 max_size=batch_size * global_batches)
    )
    round_to = draw(st.sampled_from([1, 4, 8]))
    longest = -(-max(lengths) // round_to) * round_to
    # Budgets from "one sample per micro-batch" to "everything fits", sometimes too small.
    budget = draw(st.integers(max(1, longest - 4), longest * (batch_size + 1)))
    return {
        "lengths": lengths,
        "shards": shards,
        "batch_size": batch_size,
        "allow_uneven_shards": draw(st.booleans()),
        "mode": draw(st.sampled_from(["plain", "dynamic", "packed"])),
        "budget": budget,
        "round_to": round_to,
        "algorithm": draw(st.sampled_from(ALGORITHMS)),
    }


@settings(max_examples=300, deadline=None)
@given(case=cases())
def test_shard_meta_for_dp_equals_shard_by_batch_size(case: dict[str, Any]) -> None:
    assert_same_sharding(
        case["lengths"],
        case["shards"],
        batch_size=case["batch_size"],
        allow_uneven_shards=case["allow_uneven_shards"],
        **budget_args(case["mode"], case["budget"], case["round_to"], case["algorithm"]),
    )


def test_known_cases_plain_uneven_dynamic_packed() -> None:
    lengths = [5, 1, 3, 8, 2, 7]
    plain = assert_same_sharding(lengths, 2, batch_size=6)
    assert [m.keys for m in plain] == [("k0", "k1", "k2"), ("k3", "k4", "k5")]
    assert all(m.micro_batch_plan is None for m in plain)

    uneven = assert_same_sharding(lengths[:5], 2, allow_uneven_shards=True)
    assert [m.keys for m in uneven] == [("k0", "k1", "k2"), ("k3", "k4")]
    empty_rank = assert_same_sharding([4, 4], 3, allow_uneven_shards=True)
    assert [m.size for m in empty_rank] == [1, 1, 0]

    dynamic = assert_same_sharding(lengths, 2, **budget_args("dynamic", 10, 1, ""))
    # Longest first, dealt round-robin: rank 0 gets 8, 5, 2 and rank 1 gets 7, 3, 1.
    assert [m.keys for m in dynamic] == [("k3", "k0", "k4"), ("k5", "k2", "k1")]
    assert [m.micro_batch_plan.kind for m in dynamic] == ["dynamic", "dynamic"]

    packed = assert_same_sharding(lengths, 2, **budget_args("packed", 12, 1, ALGORITHMS[0]))
    for m in packed:
        assert m.micro_batch_plan is not None and m.micro_batch_plan.kind == "packed"
        assert all(total <= 12 for total in m.micro_batch_plan.lengths)
    assert len(packed[0].micro_batch_plan.ranges) == len(packed[1].micro_batch_plan.ranges)


def test_errors_match_the_in_memory_path() -> None:
    with pytest.raises(ValueError, match="global batch size 3 is not a multiple of shards=2"):
        shard_meta_for_dp(meta_of([1, 2, 3]), 2)
    with pytest.raises(ValueError, match=re.escape("sample 1 has 9 tokens (12 after rounding")):
        shard_meta_for_dp(meta_of([3, 9]), 1, **budget_args("dynamic", 8, 4, ""))
    with pytest.raises(ValueError, match="sequence length 1 is 0; every sample needs at least 1"):
        shard_meta_for_dp(meta_of([3, 0]), 1, **budget_args("packed", 8, 1, ALGORITHMS[1]))
    assert_same_sharding([2, 3, 4], 2, batch_size=2)  # batch_size does not divide the batch
