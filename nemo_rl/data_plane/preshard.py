"""DP sharding of a data-plane batch from its metadata alone.

:func:`shard_meta_for_dp` gives each data-parallel rank the keys it must fetch and, under dynamic
batching or sequence packing, its micro-batch plan. It makes exactly the decisions
:meth:`BatchedDataDict.shard_by_batch_size` makes on a batch with the same sequence lengths
(both call :func:`nemo_rl.distributed.shard_planner.plan_shards`), so a worker that fetches
its keys in shard order and attaches the plan gets the shard the in-memory path would have sent.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.shard_planner import (
    DynamicBatchingArgs,
    SequencePackingArgs,
    plan_shards,
)


def shard_meta_for_dp(
    meta: KVBatchMeta,
    shards: int,
    batch_size: Optional[int] = None,
    allow_uneven_shards: bool = False,
    sequence_packing_args: Optional[SequencePackingArgs] = None,
    dynamic_batching_args: Optional[DynamicBatchingArgs] = None,
) -> list[KVBatchMeta]:
    """One meta per DP rank: its keys in shard order, with the micro-batch plan if any.

    Arguments are those of :meth:`BatchedDataDict.shard_by_batch_size`; the sequence lengths
    come from ``meta.sequence_lengths`` (the args' ``input_lengths_key`` is not read). Shards
    keep ``meta``'s partition, fields, tags and a copy of its ``extra_info``. Unlike
    ``shard_by_batch_size`` no reorder indices are returned: results are written back under
    the samples' keys, so the original order never needs restoring.

    Raises:
        ValueError: the argument errors of ``shard_by_batch_size`` (e.g. a batch size that is
            not a multiple of ``shards``, a sample longer than the token budget).
    """
    plan = plan_shards(
        meta.size,
        shards,
        batch_size,
        allow_uneven_shards,
        sequence_packing_args,
        dynamic_batching_args,
        sequence_lengths=meta.sequence_lengths,
    )
    micro_batch_plans = plan.micro_batch_plans or (None,) * shards
    return [
        dataclasses.replace(meta.subset(rows), micro_batch_plan=micro_batch_plan)
        for rows, micro_batch_plan in zip(plan.rows, micro_batch_plans)
    ]
