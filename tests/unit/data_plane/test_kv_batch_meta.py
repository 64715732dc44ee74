"""KVBatchMeta: construction checks and the metadata-only row/field/tag operations."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from nemo_rl.data_plane import KVBatchMeta
from nemo_rl.distributed.shard_planner import MicroBatchPlan


def make_meta(n: int = 4, partition_id: str = "train") -> KVBatchMeta:
    return KVBatchMeta(
        partition_id=partition_id,
        keys=[f"s{i}" for i in range(n)],
        sequence_lengths=torch.arange(1, n + 1),
        fields=["input_ids", "input_lengths"],
        tags=[{"group": i // 2} for i in range(n)],
        extra_info={"step": 3},
    )


def test_construction_normalises_and_defaults() -> None:
    meta = make_meta()
    assert meta.keys == ("s0", "s1", "s2", "s3") and len(meta) == meta.size == 4
    assert meta.sequence_lengths == (1, 2, 3, 4)
    assert all(type(n) is int for n in meta.sequence_lengths)
    assert meta.fields == ("input_ids", "input_lengths")
    bare = KVBatchMeta("val", ["a", "b"], [5, 0])
    assert bare.tags == ({}, {}) and bare.fields == () and bare.extra_info == {}
    assert bare.micro_batch_plan is None
    assert pickle.loads(pickle.dumps(meta)) == meta


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"partition_id": ""}, "KVBatchMeta.partition_id must be a non-empty str, got ''"),
        ({"keys": ["a", "b", "a"]}, "KVBatchMeta.keys must be unique; repeated: ['a']"),
        ({"keys": ["a", ""]}, "KVBatchMeta.keys must be non-empty strs; got ['']"),
        (
            {"sequence_lengths": [1, 2]},
            "KVBatchMeta has 3 keys but 2 sequence_lengths; give one length (tokens) per key",
        ),
        ({"sequence_lengths": [1, -2, 3]}, "KVBatchMeta.sequence_lengths must be >= 0; (row, "
         "length) [(1, -2)]"),
        ({"sequence_lengths": [1, 2.5, 3]}, "KVBatchMeta.sequence_lengths must be ints, got 2.5"),
        (
            {"sequence_lengths": torch.ones(3)},
            "KVBatchMeta.sequence_lengths must be a 1-D integer tensor [batch], got torch.float32 "
            "of shape (3,)",
        ),
        ({"fields": ["x", "x"]}, "KVBatchMeta.fields must be unique; repeated: ['x']"),
        ({"tags": [{}]}, "KVBatchMeta has 3 keys but 1 tags; give one dict per key"),
        ({"tags": [{}, {1: 2}, {}]}, "KVBatchMeta.tags[1] keys must be strs; got [1]"),
        (
            {"micro_batch_plan": MicroBatchPlan("dynamic", ((0, 2),), (8,), "input_ids", (0, 2))},
            "KVBatchMeta.micro_batch_plan covers 2 rows but the meta has 3 keys",
        ),
    ],
)
def test_construction_errors(kwargs: dict, message: str) -> None:
    args = {"partition_id": "train", "keys": ["a", "b", "c"], "sequence_lengths": [1, 2, 3]}
    with pytest.raises(ValueError, match=re.escape(message)):
        KVBatchMeta(**{**args, **kwargs})


def test_subset_and_slice_select_rows_and_copy_extra_info() -> None:
    meta = make_meta(6)
    picked = meta.subset([4, 0, 2])
    assert picked.keys == ("s4", "s0", "s2")
    assert picked.sequence_lengths == (5, 1, 3)
    assert picked.tags == ({"group": 2}, {"group": 0}, {"group": 1})
    assert picked.fields == meta.fields and picked.extra_info == {"step": 3}
    picked.extra_info["pad"] = 8  # a derived meta owns its extra_info
    assert meta.extra_info == {"step": 3}
    assert meta.slice(1, 3).keys == ("s1", "s2")
    assert meta.slice(2, 2).size == 0
    with pytest.raises(ValueError, match=re.escape("indices [6] are outside a batch of 6 rows")):
        meta.subset([6])
    with pytest.raises(ValueError, match="subset indices repeat"):
        meta.subset([1, 1])
    with pytest.raises(ValueError, match=re.escape("slice [4, 7) is outside a batch of 6 rows")):
        meta.slice(4, 7)


def test_slice_keeps_plan_only_on_micro_batch_boundaries() -> None:
    plan = MicroBatchPlan("dynamic", ((0, 2), (2, 3), (3, 4)), (8, 4, 4), "input_ids", (0, 3, 4))
    meta = KVBatchMeta("train", ["a", "b", "c", "d"], [8, 7, 4, 2], micro_batch_plan=plan)
    assert meta.slice(0, 3).micro_batch_plan == MicroBatchPlan(
        "dynamic", ((0, 2), (2, 3)), (8, 4), "input_ids", (0, 3)
    )
    assert meta.slice(1, 3).micro_batch_plan is None  # cuts the first micro-batch
    assert meta.subset([0, 1, 2, 3]).micro_batch_plan is None


def test_concat_joins_rows_and_checks_compatibility() -> None:
    meta = make_meta(4)
    joined = KVBatchMeta.concat([meta.slice(2, 4), meta.slice(0, 2)])
    assert joined.keys == ("s2", "s3", "s0", "s1")
    assert joined.sequence_lengths == (3, 4, 1, 2)
    assert joined.tags[0] == {"group": 1} and joined.extra_info == {"step": 3}

    other = KVBatchMeta("val", ["v"], [1], fields=meta.fields)
    with pytest.raises(ValueError, match="cannot concat metas of partitions 'train' .* and 'val'"):
        KVBatchMeta.concat([meta, other])
    narrow = meta.slice(0, 1).select_fields(["input_ids"])
    with pytest.raises(ValueError, match=re.escape("meta 1 has fields ['input_ids'] but meta 0")):
        KVBatchMeta.concat([meta.slice(1, 2), narrow])
    clash = KVBatchMeta("train", ["z"], [1], fields=meta.fields, extra_info={"step": 4})
    with pytest.raises(ValueError, match=re.escape("extra_info['step'] differs between metas")):
        KVBatchMeta.concat([meta, clash])
    with pytest.raises(ValueError, match="repeated: \\['s0'\\]"):
        KVBatchMeta.concat([meta, meta.slice(0, 1)])
    with pytest.raises(ValueError, match="needs at least one meta"):
        KVBatchMeta.concat([])


def test_with_fields_select_fields_and_stamp_tags() -> None:
    meta = make_meta(3)
    grown = meta.with_fields(["advantages", "input_ids", "advantages"])
    assert grown.fields == ("input_ids", "input_lengths", "advantages")
    assert meta.fields == ("input_ids", "input_lengths")  # unchanged
    assert grown.select_fields(["advantages", "input_ids"]).fields == ("advantages", "input_ids")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "fields ['logprobs'] are not stored for this batch of partition 'train' (it has "
            "['input_ids', 'input_lengths'])"
        ),
    ):
        meta.select_fields(["input_ids", "logprobs"])

    stamped = meta.stamp_tags({"reward": 1.0})
    assert stamped.tags == tuple({"group": i // 2, "reward": 1.0} for i in range(3))
    per_sample = stamped.stamp_tags([{"reward": 0.5}, {}, {"group": 9}])
    assert per_sample.tags == ({"group": 0, "reward": 0.5}, {"group": 0, "reward": 1.0},
                               {"group": 9, "reward": 1.0})
    assert meta.tags[0] == {"group": 0}  # unchanged
    with pytest.raises(ValueError, match="stamp_tags got 1 tag dicts for a batch of 3"):
        meta.stamp_tags([{"x": 1}])
