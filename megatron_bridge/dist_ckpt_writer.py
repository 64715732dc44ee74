"""Write a Megatron distributed checkpoint straight from an HF checkpoint, one chunk at a time.

:func:`convert_hf_to_dist_checkpoint` produces the checkpoint that every rank of a TP x PP
(x EP, for a mixture-of-experts model) GPTModel loaded from ``hf_path`` would write with
:func:`~megatron_bridge.checkpoint.save_megatron_checkpoint` (same keys, chunks, dtypes and
values; see :mod:`megatron_bridge.dist_ckpt_layout`), in this one process, without building
the model, without torch.distributed and without importing megatron-core.

It runs torch's DCP save (``__0_0.distcp`` + ``.metadata``) with a planner whose write items
come from the layout. The writer asks the planner for each item's data (``resolve_data``)
right before writing it; the planner then reads that chunk's rows of the HF tensors, applies
the transform (QKV interleave, vocabulary padding), casts it and hands it over, and nothing
keeps it afterwards (the file is written by :func:`~megatron_bridge.dcp_file_writer.
dcp_file_writer`, which holds no item it has written, unlike torch's own writer). Peak
memory: one chunk (the largest is a TP slice of the embedding; an expert's chunk is one
expert's TP slice) plus its HF source rows, and a few kilobytes of metadata per chunk (its
layout entry, write item and write result).
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_bridge.checkpoint import write_bridge_files
from megatron_bridge.config import BridgeConfig
from megatron_bridge.dcp_file_writer import dcp_file_writer
from megatron_bridge.dist_ckpt_layout import ExtraStateObject, TensorChunk, checkpoint_layout
from megatron_bridge.families import ModelDims
from megatron_bridge.load import SafetensorsReader
from megatron_bridge.tensor_check import check_hf_tensors
from megatron_bridge.transforms import split_shard

# megatron-core's files next to the DCP ones: the format description it checks on load, and
# the (empty, for a GPTModel) common state dict.
MEGATRON_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def chunk_data(
    chunk: TensorChunk, reader: SafetensorsReader, dims: ModelDims, tp: int, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of one checkpoint chunk, ``chunk.shape``, read from the HF checkpoint
    (whose tensors :func:`~megatron_bridge.tensor_check.check_hf_tensors` has checked)."""
    mapping = chunk.mapping
    if chunk.part is not None:
        # One half of the fused gate/up: this TP rank's rows of the HF gate or up matrix.
        tensor = split_shard(reader, mapping.hf_names[chunk.part], 0, chunk.tp_rank, tp)
    else:
        tensor = mapping.shard(reader, dims, chunk.tp_rank, tp)
    return tensor.to(dtype).reshape(chunk.shape)


def _extra_state_bytes() -> io.BytesIO:
    """A linear layer's saved ``_extra_state`` as megatron-core serialises it: ``[None]``."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer


def _chunk_save_planner(
    layout: list[TensorChunk | ExtraStateObject],
    dtype: torch.dtype,
    make: Callable[[TensorChunk], torch.Tensor],
) -> Any:
    """A DCP ``SavePlanner`` whose write items are ``layout`` and whose data ``make`` builds
    on demand (torch's planner classes are imported here, not at module import)."""
    from torch.distributed.checkpoint import DefaultSavePlanner, SavePlan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties(dtype=dtype)
    items: list[Any] = []
    chunks: dict[tuple[str, tuple[int, ...]], TensorChunk] = {}
    for entry in layout:
        if isinstance(entry, ExtraStateObject):
            items.append(
                WriteItem(index=MetadataIndex(entry.unique_key), type=WriteItemType.BYTE_IO)
            )
            continue
        offset = torch.Size(entry.offset)
        chunks[(entry.key, tuple(offset))] = entry
        items.append(
            WriteItem(
                index=MetadataIndex(entry.key, offset),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size(entry.shape)),
                    properties=properties,
                    size=torch.Size(entry.global_shape),
                ),
            )
        )

    class ChunkSavePlanner(DefaultSavePlanner):
        def set_up_planner(
            self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
        ) -> None:
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> Any:
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: Any) -> torch.Tensor | io.BytesIO:
            if write_item.type == WriteItemType.BYTE_IO:
                return _extra_state_bytes()
            return make(chunks[(write_item.index.fqn, tuple(write_item.index.offset))])

    return ChunkSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def convert_hf_to_dist_checkpoint(
    hf_path: str | Path,
    ckpt_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    dtype: torch.dtype = torch.float32,
    sync_files: bool = True,
    **bridge_kwargs: Any,
) -> BridgeConfig:
    """Write the dist checkpoint of ``hf_path`` as a TP x PP GPTModel would save it (at any
    expert-parallel size: every expert is its own chunk, whichever rank holds it).

    Args:
        hf_path: HF checkpoint folder (config.json + safetensors).
        ckpt_dir: destination folder; must not exist or be empty.
        tp, pp: the parallel layout whose save this reproduces (TP sets the vocabulary
            padding and the chunks; the loaded checkpoint works at any layout).
        dtype: parameter dtype of the checkpoint; HF tensors are cast to it. The HF
            tensors' own dtype is recorded (``bridge.json`` ``source_dtype``) so the export
            back restores it by default.
        sync_files: fsync the tensor files before writing the metadata (durable against a
            crash of the machine; costs a disk flush of the whole checkpoint).
        **bridge_kwargs: extra :class:`BridgeConfig` settings (vocabulary padding).

    Returns:
        The model's :class:`BridgeConfig`.

    Raises:
        ValueError: TP/PP that do not fit the model, a corrupt file, or tensors that do not
            match the config (missing, misshapen, left over).
        FileNotFoundError: missing shards.
    """
    from torch.distributed.checkpoint import save as dcp_save

    from torch.distributed.checkpoint.api import CheckpointException

    bridge = BridgeConfig.from_hf(hf_path, **bridge_kwargs)
    layout = checkpoint_layout(bridge, tp, pp)
    reader = SafetensorsReader(hf_path)
    check_hf_tensors(reader, bridge)
    dims = bridge.dims(tp)

    def make(chunk: TensorChunk) -> torch.Tensor:
        return chunk_data(chunk, reader, dims, tp, dtype)

    ckpt = Path(ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    writer = dcp_file_writer(ckpt, sync_files)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp_save({}, storage_writer=writer, planner=_chunk_save_planner(layout, dtype, make),
                     no_dist=True)
        except CheckpointException as err:
            # DCP wraps what a rank raised (here: reading the HF files); raise that itself.
            (cause, _), *_ = err.failures.values()
            raise cause from err
    torch.save({}, ckpt / "common.pt")
    (ckpt / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))
    source_dtypes = {reader.dtype(name) for name in reader.names()}
    source_dtype = source_dtypes.pop() if len(source_dtypes) == 1 else None
    write_bridge_files(ckpt, bridge, tp, dtype, hf_path, source_dtype=source_dtype)
    return bridge
