"""Batch tensors <-> per-sample columns, and the data_plane config's client factories."""

from __future__ import annotations

import re

import pytest
import torch

from nemo_rl.data_plane import DataPlaneError, InProcessDataPlane, KVBatchMeta, shard_meta_for_dp
from nemo_rl.data_plane.columns import (
    GLOBAL_FORWARD_PAD_SEQLEN,
    PAD_VALUE_DICT,
    read_columns,
    stamp_pad_seqlen,
    to_columns,
    write_columns,
)
from nemo_rl.data_plane.config import DataPlaneConfig, attach_data_plane, start_data_plane
from nemo_rl.distributed.shard_planner import DynamicBatchingArgs

LENGTHS = [3, 5, 1, 4]


def stored_batch() -> tuple[InProcessDataPlane, KVBatchMeta, dict[str, torch.Tensor]]:
    """A store holding a right-padded token field, a 2-D token field and a sample field."""
    plane = InProcessDataPlane()
    plane.register_partition("train")
    meta = KVBatchMeta(
        "train", [f"k{i}" for i in range(4)], LENGTHS, extra_info={PAD_VALUE_DICT: {"ids": 9}}
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.full((4, 6), 9, dtype=torch.long)
    mask = torch.zeros(4, 6)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(0, 9, (n,), generator=g)
        mask[row, 1:n] = 1.0
    fields = {
        "ids": ids,
        "mask": mask,
        "hidden": torch.randn(4, 6, 2, generator=g),
        "scalar": torch.tensor([0.5, -1.0, 2.0, 0.0]),
    }
    return plane, write_columns(plane, meta, fields), fields


def test_token_fields_are_read_back_at_the_batch_length_with_pad_values() -> None:
    plane, meta, fields = stored_batch()
    assert meta.fields == ("ids", "mask", "hidden", "scalar")
    stored = plane.get("train", ["k1", "k2"], ["ids", "hidden", "scalar"])
    assert [t.shape for t in stored["ids"]] == [(6,), (6,)]  # the writer's padded rows
    assert [t.shape for t in stored["hidden"]] == [(6, 2), (6, 2)]
    assert [t.shape for t in stored["scalar"]] == [(), ()]

    batch = read_columns(plane, meta, ["ids", "mask", "scalar"])
    # S = the longest sample (5), not the writer's padded width (6)
    assert meta.extra_info[GLOBAL_FORWARD_PAD_SEQLEN] == 5
    assert torch.equal(batch["ids"], fields["ids"][:, :5])  # padded with 9 from extra_info
    assert torch.equal(batch["mask"], fields["mask"][:, :5])
    assert torch.equal(batch["scalar"], fields["scalar"])
    assert batch.micro_batch_plan is None
    # an explicit pad value wins over the meta's, other fields keep theirs (0 for "hidden");
    # what the writer had past a sample's length ("hidden" is random there) never shows
    batch = read_columns(plane, meta, ["ids", "hidden"], pad_value_dict={"ids": -1})
    assert batch["ids"][2, 1:].tolist() == [-1] * 4
    for row, n in enumerate(LENGTHS):
        assert torch.equal(batch["hidden"][row, :n], fields["hidden"][row, :n])
        assert not batch["hidden"][row, n:].any()


def test_shards_read_at_the_stamped_global_length_with_their_plan() -> None:
    plane, meta, fields = stored_batch()
    assert stamp_pad_seqlen(meta) == 5 and stamp_pad_seqlen(meta) == 5  # idempotent
    args = DynamicBatchingArgs(
        input_key="ids", input_lengths_key="len", max_tokens_per_microbatch=8,
        sequence_length_round=1,
    )
    shards = shard_meta_for_dp(meta, 2, dynamic_batching_args=args)
    for shard in shards:
        batch = read_columns(plane, shard, ["ids"])
        rows = [meta.keys.index(k) for k in shard.keys]
        assert torch.equal(batch["ids"], fields["ids"][rows, :5])  # 5 although shard is shorter
        assert batch.micro_batch_plan == shard.micro_batch_plan is not None


def test_errors_name_the_field_and_samples() -> None:
    plane, meta, _ = stored_batch()
    with pytest.raises(ValueError, match=r"token field 'ids' has 4 positions but samples \['k1'\]"):
        to_columns(meta, {"ids": torch.zeros(4, 4)})
    short = KVBatchMeta(
        "train", meta.keys, LENGTHS, meta.fields, extra_info={GLOBAL_FORWARD_PAD_SEQLEN: 4}
    )
    with pytest.raises(ValueError, match=re.escape(
        "samples ['k1'] of partition 'train' are longer than the batch's "
        "global_forward_pad_seqlen=4"
    )):
        read_columns(plane, short, ["ids"])
    plane.put("train", ["k0"], {"scalar": [torch.ones(2)]})
    with pytest.raises(ValueError, match="'scalar' of partition 'train' mixes per-sample scalars"):
        read_columns(plane, meta, ["scalar"])
    with pytest.raises(ValueError, match="empty batch of partition 'train'"):
        read_columns(plane, meta.subset([]), ["ids"])


def test_config_builds_the_backends_clients() -> None:
    cfg = DataPlaneConfig(backend="in_process")
    assert isinstance(start_data_plane(cfg), InProcessDataPlane)
    with pytest.raises(DataPlaneError, match="set data_plane.backend='transfer_queue'"):
        attach_data_plane(cfg.model_dump())
    with pytest.raises(ValueError, match="backend"):
        DataPlaneConfig.model_validate({"backend": "redis"})
