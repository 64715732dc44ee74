"""A policy rank's reads and writes of the data plane (the TQPolicy path).

Every rank of a data-parallel replica fetches the replica's shard by key (the ranks of a replica
need the same rows); only the replica leader, the rank whose result the in-memory path returns
(last pipeline stage, tensor- and context-parallel rank 0), writes results back, under the
same keys.
"""

from __future__ import annotations

from typing import Optional

import torch

from nemo_rl.data_plane.columns import read_columns, write_columns
from nemo_rl.data_plane.interfaces import DataPlaneClient
from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict


def is_replica_leader() -> bool:
    """Whether this rank writes its replica's results: last PP stage, TP rank 0, CP rank 0."""
    from megatron.core import parallel_state

    return (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_context_parallel_rank() == 0
    )


def fetch_batch(client: DataPlaneClient, meta: KVBatchMeta) -> BatchedDataDict:
    """``meta.fields`` of ``meta``'s samples as the batch the in-memory path would have sent.

    Token fields are padded to the batch's global forward pad length; the micro-batch plan of
    ``meta`` is attached. A per-sample ``advantages`` field ``[B]`` (the driver writes one
    scalar per sample) becomes the loss's ``[B, S]`` form, ``advantages[:, None] * token_mask``,
    as the in-memory ``grpo_advantages`` computes it.
    """
    batch = read_columns(client, meta, meta.fields)
    if "advantages" in batch and batch["advantages"].ndim == 1:
        if "token_mask" not in batch:
            raise ValueError(
                "per-sample advantages need 'token_mask' [batch, seq] in the same fetch; add it "
                f"to the meta's fields (it has {list(meta.fields)})"
            )
        batch["advantages"] = batch["advantages"][:, None] * batch["token_mask"]
    return batch


def write_back(
    client: DataPlaneClient, meta: KVBatchMeta, name: str, values: Optional[torch.Tensor]
) -> None:
    """On the replica leader, put ``values`` ``[B, S]`` (token field) as ``name`` under
    ``meta``'s keys; other ranks (``values`` None off the last stage) write nothing."""
    if values is not None and is_replica_leader():
        write_columns(client, meta, {name: values})
