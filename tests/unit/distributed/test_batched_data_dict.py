"""Tests of BatchedDataDict: row selection, concatenation, sharding into ShardedBatch and the
micro-batch iterators that follow a shard's plan (the plans themselves: test_shard_planner.py)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nemo_rl.distributed.batched_data_dict import BatchedDataDict, ShardedBatch
from nemo_rl.distributed.shard_planner import plan_shards
from sharding_cases import dynamic_args, mode_kwargs, packing_args, sharding_cases


def make_batch(lengths: list[int], seq_len: int) -> BatchedDataDict[Any]:
    """Distinct tokens per row (0 = padding), a [batch, seq, 2] tensor, row ids and a list."""
    n = len(lengths)
    ids = torch.arange(1, n * seq_len + 1).view(n, seq_len)
    real = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]
    return BatchedDataDict(
        input_ids=ids * real,
        input_lengths=torch.tensor(lengths),
        per_token=torch.arange(n * seq_len * 2, dtype=torch.float32).view(n, seq_len, 2),
        row=torch.arange(n),
        text=[f"sample-{i}" for i in range(n)],
    )


def assert_same(a: BatchedDataDict[Any], b: BatchedDataDict[Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


# ---------------------------------------------------------------------- basic operations


def test_size_mismatch_names_the_keys() -> None:
    batch = BatchedDataDict(tokens=torch.zeros(3, 2), labels=[1, 2])
    with pytest.raises(ValueError, match="'labels' has 2 rows but 'tokens' has 3"):
        _ = batch.size


def test_unsupported_value_type_names_the_key() -> None:
    with pytest.raises(TypeError, match="'score' is a float"):
        _ = BatchedDataDict(tokens=torch.zeros(3), score=1.0).size


def test_from_batches_pads_with_per_key_values() -> None:
    first = {"ids": torch.tensor([[1, 2]]), "mask": torch.tensor([[1, 1]]), "text": ["a"]}
    second = {
        "ids": torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]]),
        "mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "text": ["b", "c"],
    }
    merged = BatchedDataDict.from_batches([first, second], pad_value_dict={"ids": -1})
    assert torch.equal(merged["ids"], torch.tensor([[1, 2, -1, -1], [3, 4, 5, 6], [7, 8, 9, 10]]))
    assert torch.equal(merged["mask"], torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]))
    assert merged["text"] == ["a", "b", "c"]
    assert merged.size == 3


def test_from_batches_rejects_differing_keys_and_mixed_types() -> None:
    with pytest.raises(ValueError, match="batch 1 has keys"):
        BatchedDataDict.from_batches([{"a": [1]}, {"b": [1]}])
    with pytest.raises(TypeError, match="'a' has types"):
        BatchedDataDict.from_batches([{"a": [1]}, {"a": torch.tensor([1])}])


def test_slice_select_repeat_against_explicit_results() -> None:
    batch = BatchedDataDict(x=torch.tensor([[0, 1], [2, 3], [4, 5]]), name=["a", "b", "c"])

    sliced = batch.slice(1, 3)
    assert torch.equal(sliced["x"], torch.tensor([[2, 3], [4, 5]]))
    assert sliced["name"] == ["b", "c"]

    for indices in ([2, 0, 2], torch.tensor([2, 0, 2])):
        selected = batch.select_indices(indices)
        assert torch.equal(selected["x"], torch.tensor([[4, 5], [0, 1], [4, 5]]))
        assert selected["name"] == ["c", "a", "c"]

    repeated = batch.repeat_interleave(2)
    assert torch.equal(
        repeated["x"], torch.tensor([[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]])
    )
    assert repeated["name"] == ["a", "a", "b", "b", "c", "c"]

    with pytest.raises(ValueError, match="index 3 is outside"):
        batch.select_indices([3])


def test_chunk_get_batch_and_fixed_microbatches() -> None:
    batch = BatchedDataDict(x=torch.arange(6), name=list("abcdef"))
    assert batch.chunk(1, 3)["name"] == ["c", "d"]
    assert torch.equal(batch.get_batch(2, 2)["x"], torch.tensor([4, 5]))
    assert [mb["name"] for mb in batch.make_microbatch_iterator(4)] == [list("abcd"), list("ef")]
    with pytest.raises(ValueError, match="multiple of 4"):
        batch.chunk(0, 4)


def test_reorder_data_inverts_a_permutation() -> None:
    batch = BatchedDataDict(x=torch.tensor([10, 11, 12]))
    # Row j of `batch` came from original position order[j].
    order = [2, 0, 1]
    assert torch.equal(batch.reorder_data(order)["x"], torch.tensor([11, 12, 10]))
    with pytest.raises(ValueError, match="permutation"):
        batch.reorder_data([0, 0, 1])


def test_generic_alias_and_pickle_keep_type_and_plan() -> None:
    batch = make_batch([3, 1, 2, 4], seq_len=4)
    shards = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(8, 1)).shards
    restored = pickle.loads(pickle.dumps(shards[0]))
    assert type(restored) is BatchedDataDict
    assert restored.micro_batch_plan == shards[0].micro_batch_plan
    assert_same(restored, shards[0])
    assert BatchedDataDict[dict[str, Any]](x=[1]).size == 1


# ---------------------------------------------------------------------- sharding


def test_plain_sharding_of_known_batch() -> None:
    batch = BatchedDataDict(row=torch.arange(8), name=[f"n{i}" for i in range(8)])
    sharded = batch.shard_by_batch_size(2, batch_size=4)
    assert isinstance(sharded, ShardedBatch)
    # Global batches [0..3] and [4..7]; each split in two contiguous halves.
    assert [s["row"].tolist() for s in sharded.shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sharded.shards[1]["name"] == ["n2", "n3", "n6", "n7"]
    assert sharded.sorted_indices == [0, 1, 4, 5, 2, 3, 6, 7]
    assert all(s.micro_batch_plan is None for s in sharded.shards)


@pytest.mark.parametrize("mode", ["plain", "dynamic", "packed"])
def test_every_mode_returns_a_sharded_batch_that_is_not_a_sequence(mode: str) -> None:
    batch = make_batch([5, 1, 3, 8], seq_len=8)
    case = {"budget": 16, "round_to": 1, "algorithm": "first_fit_decreasing"}
    sharded = batch.shard_by_batch_size(2, **mode_kwargs(case, mode))
    assert type(sharded) is ShardedBatch
    assert len(sharded.shards) == 2 and sorted(sharded.sorted_indices) == [0, 1, 2, 3]
    # Not unpackable or iterable: it cannot be mistaken for a list of two shards.
    with pytest.raises(TypeError):
        iter(sharded)  # type: ignore[call-overload]


def test_budgeted_sharding_reads_and_checks_the_length_keys() -> None:
    batch = make_batch([2, 2], seq_len=2)
    with pytest.raises(ValueError, match=r"key 'input_lengths' is missing"):
        BatchedDataDict(input_ids=batch["input_ids"]).shard_by_batch_size(
            1, dynamic_batching_args=dynamic_args(8, 1)
        )
    batch["input_lengths"] = torch.tensor([2, 3])
    with pytest.raises(ValueError, match=r"'input_lengths'\[1\] = 3 is outside \[1, 2\]"):
        batch.shard_by_batch_size(1, dynamic_batching_args=dynamic_args(8, 1))


@settings(max_examples=50, deadline=None)
@given(case=sharding_cases(), mode=st.sampled_from(["plain", "dynamic", "packed"]))
def test_shards_follow_the_planner_and_reorder_restores_the_batch(
    case: dict[str, Any], mode: str
) -> None:
    batch = make_batch(case["lengths"], case["seq_len"])
    kwargs = mode_kwargs(case, mode)
    sharded = batch.shard_by_batch_size(case["shards"], case["batch_size"], **kwargs)
    plan = plan_shards(
        batch.size, case["shards"], case["batch_size"], sequence_lengths=case["lengths"], **kwargs
    )
    plans = plan.micro_batch_plans or (None,) * case["shards"]
    for shard, rows, mb_plan in zip(sharded.shards, plan.rows, plans, strict=True):
        assert_same(shard, batch.select_indices(rows))
        assert shard.micro_batch_plan == mb_plan
    merged = BatchedDataDict.from_batches(sharded.shards)
    assert merged["row"].tolist() == sharded.sorted_indices
    assert_same(merged.reorder_data(sharded.sorted_indices), batch)


# ---------------------------------------------------------------------- micro-batch iterators


def test_dynamic_iterator_cuts_sequence_tensors_to_the_padded_length() -> None:
    batch = make_batch([5, 1, 3, 8], seq_len=8)
    # Shard 1 holds rows 0 (5 tokens) and 1 (1 token), in two micro-batches (see the planner).
    shard = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(10, 1)).shards[1]
    assert shard.micro_batch_indices == [[0, 1], [1, 2]]
    assert shard.micro_batch_lengths == [5, 1]
    assert shard.get_microbatch_iterator_dynamic_shapes_len() == 2
    micro_batches = list(shard.make_microbatch_iterator_with_dynamic_shapes())
    assert [tuple(mb["input_ids"].shape) for mb in micro_batches] == [(1, 5), (1, 1)]
    assert [tuple(mb["per_token"].shape) for mb in micro_batches] == [(1, 5, 2), (1, 1, 2)]
    assert torch.equal(micro_batches[0]["input_ids"], batch["input_ids"][0:1, :5])
    assert [mb["text"] for mb in micro_batches] == [["sample-0"], ["sample-1"]]


def test_packed_iterator_yields_the_rows_of_each_bin() -> None:
    batch = make_batch([6, 5, 4, 3, 2], seq_len=6)
    shard = batch.shard_by_batch_size(2, sequence_packing_args=packing_args(10, 1)).shards[1]
    bins = list(shard.make_microbatch_iterator_for_packable_sequences())
    assert len(bins) == shard.get_microbatch_iterator_for_packable_sequences_len() == 1
    assert bins[0]["text"] == ["sample-1", "sample-3", "sample-4"]
    assert_same(bins[0], batch.select_indices([1, 3, 4]))


def test_slice_keeps_the_plan_only_on_micro_batch_boundaries() -> None:
    batch = make_batch([5, 1, 3, 8], seq_len=8)
    shard = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(10, 1)).shards[0]
    assert shard.slice(1, 2).micro_batch_indices == [[0, 1]]
    assert shard.slice(1, 2).micro_batch_lengths == [3]
    assert make_batch([1, 1, 1, 1], 1).shard_by_batch_size(
        1, dynamic_batching_args=dynamic_args(4, 1)
    ).shards[0].slice(0, 2).micro_batch_plan is None  # cuts the one micro-batch of 4 rows


def test_plan_errors_and_wrong_iterator() -> None:
    batch = make_batch([2, 2], seq_len=2)
    with pytest.raises(ValueError, match="no micro-batch plan"):
        batch.get_microbatch_iterator_dynamic_shapes_len()
    shards = batch.shard_by_batch_size(1, sequence_packing_args=packing_args(8, 1)).shards
    with pytest.raises(ValueError, match="planned for 'packed'"):
        list(shards[0].make_microbatch_iterator_with_dynamic_shapes())


@settings(max_examples=50, deadline=None)
@given(case=sharding_cases(), mode=st.sampled_from(["dynamic", "packed"]))
def test_iterators_yield_the_planned_rows_of_every_global_batch(
    case: dict[str, Any], mode: str
) -> None:
    batch = make_batch(case["lengths"], case["seq_len"])
    shards = batch.shard_by_batch_size(
        case["shards"], case["batch_size"], **mode_kwargs(case, mode)
    ).shards
    for shard in shards:
        global_batches = shard.split_global_batches()
        assert len(global_batches) == batch.size // case["batch_size"]
        for gb in global_batches:
            assert gb.micro_batch_indices is not None and gb.micro_batch_lengths is not None
            expected = [gb["row"][a:b].tolist() for a, b in gb.micro_batch_indices]
            if mode == "dynamic":
                micro_batches = list(gb.make_microbatch_iterator_with_dynamic_shapes())
                for mb, padded in zip(micro_batches, gb.micro_batch_lengths, strict=True):
                    keep = min(padded, case["seq_len"])
                    assert torch.equal(mb["input_ids"], batch["input_ids"][mb["row"], :keep])
                    assert torch.equal(mb["per_token"], batch["per_token"][mb["row"], :keep])
            else:
                micro_batches = list(gb.make_microbatch_iterator_for_packable_sequences())
                for mb in micro_batches:
                    assert_same(mb, batch.select_indices(mb["row"]))
            assert [mb["row"].tolist() for mb in micro_batches] == expected
