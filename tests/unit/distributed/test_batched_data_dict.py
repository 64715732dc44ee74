"""Tests of BatchedDataDict: row selection, concatenation, sharding and micro-batch plans."""

import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nemo_rl.distributed.batched_data_dict import (
    BatchedDataDict,
    DynamicBatchingArgs,
    SequencePackingArgs,
    first_fit_decreasing,
    modified_first_fit_decreasing,
)


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


def dynamic_args(budget: int, round_to: int) -> DynamicBatchingArgs:
    return DynamicBatchingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        max_tokens_per_microbatch=budget,
        sequence_length_round=round_to,
    )


def packing_args(
    budget: int, round_to: int, algorithm: str = "first_fit_decreasing"
) -> SequencePackingArgs:
    return SequencePackingArgs(
        input_key="input_ids",
        input_lengths_key="input_lengths",
        max_tokens_per_microbatch=budget,
        algorithm=algorithm,  # type: ignore[typeddict-item]
        sequence_length_round=round_to,
    )


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


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
    shards, _ = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(8, 1))
    restored = pickle.loads(pickle.dumps(shards[0]))
    assert type(restored) is BatchedDataDict
    assert restored.micro_batch_plan == shards[0].micro_batch_plan
    assert_same(restored, shards[0])
    assert BatchedDataDict[dict[str, Any]](x=[1]).size == 1


# ---------------------------------------------------------------------- plain sharding


def test_plain_sharding_of_known_batch() -> None:
    batch = BatchedDataDict(row=torch.arange(8), name=[f"n{i}" for i in range(8)])
    shards = batch.shard_by_batch_size(2, batch_size=4)
    assert isinstance(shards, list)
    # Global batches [0..3] and [4..7]; each split in two contiguous halves.
    assert [s["row"].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert shards[1]["name"] == ["n2", "n3", "n6", "n7"]


def test_plain_uneven_sharding() -> None:
    batch = BatchedDataDict(row=torch.arange(5))
    with pytest.raises(ValueError, match="not a multiple of shards=2"):
        batch.shard_by_batch_size(2)
    shards = batch.shard_by_batch_size(2, allow_uneven_shards=True)
    assert [s["row"].tolist() for s in shards] == [[0, 1, 2], [3, 4]]


def test_batch_size_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="use a batch_size that divides 6"):
        BatchedDataDict(row=torch.arange(6)).shard_by_batch_size(1, batch_size=4)


# ---------------------------------------------------------------------- dynamic batching


def test_dynamic_batching_known_plan() -> None:
    batch = make_batch([5, 1, 3, 8], seq_len=8)
    # Sorted by length: rows 3 (8), 0 (5), 2 (3), 1 (1); dealt round-robin -> [3, 2] and [0, 1].
    shards, order = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(10, 1))
    assert order == [3, 2, 0, 1]
    assert [s["row"].tolist() for s in shards] == [[3, 2], [0, 1]]
    # Shard 0: 2 rows * 8 > 10, so two micro-batches. Shard 1: 2 rows * 5 <= 10 fits one, but is
    # split so both ranks run two.
    assert shards[0].micro_batch_indices == [[0, 1], [1, 2]]
    assert shards[0].micro_batch_lengths == [8, 3]
    assert shards[1].micro_batch_indices == [[0, 1], [1, 2]]
    assert shards[1].micro_batch_lengths == [5, 1]
    micro_batches = list(shards[1].make_microbatch_iterator_with_dynamic_shapes())
    assert [tuple(mb["input_ids"].shape) for mb in micro_batches] == [(1, 5), (1, 1)]
    assert [tuple(mb["per_token"].shape) for mb in micro_batches] == [(1, 5, 2), (1, 1, 2)]
    assert torch.equal(micro_batches[0]["input_ids"], batch["input_ids"][0:1, :5])

    # Rounding to 4: rows 3 and 2 pad to 8 (2 * 8 <= 16), rows 0 and 1 pad to 8 as well.
    shards, _ = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic_args(16, 4))
    assert [s.micro_batch_lengths for s in shards] == [[8], [8]]
    assert shards[0].get_microbatch_iterator_dynamic_shapes_len() == 1


def test_dynamic_batching_overlong_sample_raises() -> None:
    batch = make_batch([3, 9], seq_len=9)
    with pytest.raises(ValueError, match=r"sample 1 has 9 tokens \(12 after rounding.*=8; raise"):
        batch.shard_by_batch_size(1, dynamic_batching_args=dynamic_args(8, 4))


# ---------------------------------------------------------------------- sequence packing


def test_first_fit_decreasing_known_bins() -> None:
    assert first_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]


def test_modified_first_fit_decreasing_known_bins() -> None:
    # Capacity 60: 40 and 31 are large, 14 and 13 small, 6 tiny. FFD puts 14 with 40; MFFD
    # puts the two small items (smallest first) with 31, the emptiest large bin.
    sizes = [40, 31, 14, 13, 6]
    assert first_fit_decreasing(sizes, 60) == [[0, 2, 4], [1, 3]]
    assert modified_first_fit_decreasing(sizes, 60) == [[0, 4], [1, 3, 2]]


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=40),
    extra=st.integers(0, 40),
    algorithm=st.sampled_from([first_fit_decreasing, modified_first_fit_decreasing]),
)
def test_bin_packing_respects_capacity_and_places_every_item_once(sizes, extra, algorithm) -> None:
    capacity = max(sizes) + extra
    bins = algorithm(sizes, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(b and sum(sizes[i] for i in b) <= capacity for b in bins)


def test_packing_known_plan_and_bin_splitting() -> None:
    batch = make_batch([6, 5, 4, 3, 2], seq_len=6)
    shards, order = batch.shard_by_batch_size(2, sequence_packing_args=packing_args(10, 1))
    assert order == [0, 2, 1, 3, 4]
    assert [s.micro_batch_indices for s in shards] == [[[0, 2]], [[0, 3]]]
    assert [s.micro_batch_lengths for s in shards] == [[10], [10]]
    bins = list(shards[1].make_microbatch_iterator_for_packable_sequences())
    assert len(bins) == shards[1].get_microbatch_iterator_for_packable_sequences_len() == 1
    assert bins[0]["text"] == ["sample-1", "sample-3", "sample-4"]

    # A budget of 100 packs everything into one bin; two shards need two, so it is split in
    # halves of 6+3+2 = 11 and 5+4 = 9 tokens.
    shards, order = batch.shard_by_batch_size(2, sequence_packing_args=packing_args(100, 1))
    assert order == [0, 3, 4, 1, 2]
    assert [s.micro_batch_lengths for s in shards] == [[11], [9]]


def test_packing_overlong_sample_names_index_and_budget() -> None:
    batch = make_batch([3, 20, 4], seq_len=20)
    with pytest.raises(
        ValueError, match=r"sample 1 has 20 tokens .* max_tokens_per_microbatch=16; raise"
    ):
        batch.shard_by_batch_size(1, sequence_packing_args=packing_args(16, 1))


def test_packing_cannot_give_every_shard_a_bin() -> None:
    batch = make_batch([8, 8, 8], seq_len=8)
    with pytest.raises(ValueError, match="cannot form a multiple of shards=2"):
        batch.shard_by_batch_size(2, sequence_packing_args=packing_args(8, 1))


def test_plan_errors_and_wrong_iterator() -> None:
    batch = make_batch([2, 2], seq_len=2)
    with pytest.raises(ValueError, match="no micro-batch plan"):
        batch.get_microbatch_iterator_dynamic_shapes_len()
    shards, _ = batch.shard_by_batch_size(1, sequence_packing_args=packing_args(8, 1))
    with pytest.raises(ValueError, match="planned for 'packed'"):
        list(shards[0].make_microbatch_iterator_with_dynamic_shapes())
    with pytest.raises(ValueError, match=r"missing \['algorithm'\]"):
        wrong_args: Any = dynamic_args(8, 1)
        batch.shard_by_batch_size(1, sequence_packing_args=wrong_args)


# ---------------------------------------------------------------------- properties


@st.composite
def sharding_cases(draw: st.DrawFn) -> dict[str, Any]:
    shards = draw(st.integers(1, 4))
    per_shard = draw(st.integers(1, 4))
    global_batches = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 24))
    total = shards * per_shard * global_batches
    # Mostly short or mostly long samples, so budgets split shards into differing counts.
    short = st.integers(1, max(1, seq_len // 4))
    length = st.one_of(short, st.integers(1, seq_len), st.integers((seq_len + 1) // 2, seq_len))
    lengths = draw(st.lists(length, min_size=total, max_size=total))
    round_to = draw(st.sampled_from([1, 4, 8]))
    longest = round_up(max(lengths), round_to)
    budget = longest * draw(st.integers(1, per_shard + 1)) + draw(st.integers(0, longest))
    return {
        "shards": shards,
        "batch_size": shards * per_shard,
        "seq_len": seq_len,
        "lengths": lengths,
        "round_to": round_to,
        "budget": budget,
        "algorithm": draw(
            st.sampled_from(["first_fit_decreasing", "modified_first_fit_decreasing"])
        ),
    }


def shard_in_mode(batch: BatchedDataDict[Any], case: dict[str, Any], mode: str):
    if mode == "dynamic":
        return batch.shard_by_batch_size(
            case["shards"], case["batch_size"],
            dynamic_batching_args=dynamic_args(case["budget"], case["round_to"]),
        )
    return batch.shard_by_batch_size(
        case["shards"], case["batch_size"],
        sequence_packing_args=packing_args(case["budget"], case["round_to"], case["algorithm"]),
    )


@settings(max_examples=50, deadline=None)
@given(case=sharding_cases(), mode=st.sampled_from(["plain", "dynamic", "packed"]))
def test_shard_concat_reorder_is_identity(case: dict[str, Any], mode: str) -> None:
    batch = make_batch(case["lengths"], case["seq_len"])
    if mode == "plain":
        shards = batch.shard_by_batch_size(case["shards"], case["batch_size"])
        local = case["batch_size"] // case["shards"]
        for s, shard in enumerate(shards):
            expected = [
                start + s * local + j
                for start in range(0, batch.size, case["batch_size"])
                for j in range(local)
            ]
            assert shard["row"].tolist() == expected
        order = [i for shard in shards for i in shard["row"].tolist()]
    else:
        shards, order = shard_in_mode(batch, case, mode)
    merged = BatchedDataDict.from_batches(shards)
    assert merged["row"].tolist() == order
    assert_same(merged.reorder_data(order), batch)


@settings(max_examples=50, deadline=None)
@given(case=sharding_cases(), mode=st.sampled_from(["dynamic", "packed"]))
def test_micro_batch_plans_respect_budget_and_cover_every_sample(
    case: dict[str, Any], mode: str
) -> None:
    batch = make_batch(case["lengths"], case["seq_len"])
    lengths, budget, round_to = case["lengths"], case["budget"], case["round_to"]
    shards, _ = shard_in_mode(batch, case, mode)

    seen: list[int] = []
    per_global_batch_counts = []
    for shard in shards:
        global_batches = shard.split_global_batches()
        assert len(global_batches) == batch.size // case["batch_size"]
        per_global_batch_counts.append([len(gb.micro_batch_indices) for gb in global_batches])
        for g, gb in enumerate(global_batches):
            if mode == "dynamic":
                micro_batches = list(gb.make_microbatch_iterator_with_dynamic_shapes())
                for mb, padded in zip(micro_batches, gb.micro_batch_lengths):
                    rows = mb["row"].tolist()
                    assert len(rows) * padded <= budget and padded % round_to == 0
                    assert max(lengths[i] for i in rows) <= padded  # no real token is cut
                    keep = min(padded, case["seq_len"])
                    assert torch.equal(mb["input_ids"], batch["input_ids"][rows, :keep])
            else:
                micro_batches = list(gb.make_microbatch_iterator_for_packable_sequences())
                for mb, packed in zip(micro_batches, gb.micro_batch_lengths):
                    rows = mb["row"].tolist()
                    assert packed == sum(round_up(lengths[i], round_to) for i in rows) <= budget
                    assert_same(mb, batch.select_indices(rows))
            assert all(mb.size >= 1 for mb in micro_batches)
            rows_of_gb = [i for mb in micro_batches for i in mb["row"].tolist()]
            # Micro-batches stay inside their global batch.
            assert all(i // case["batch_size"] == g for i in rows_of_gb)
            seen.extend(rows_of_gb)
    assert sorted(seen) == list(range(batch.size))
    # Every rank runs the same number of micro-batches in every global batch.
    assert all(counts == per_global_batch_counts[0] for counts in per_global_batch_counts)
