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
keeps it afterwards. Peak memory: one chunk (the largest is a TP slice of the embedding; an
expert's chunk is one expert's TP slice) plus its HF source rows, and a few kilobytes of
metadata per chunk (its layout entry, write item and write result).

The tensor file is written by :func:`_streaming_file_writer`'s writer, not by torch's
``FileSystemWriter.write_data``, which keeps every tensor it has written, by key, until the
file is done (it needs them for its safetensors format only; pytorch/pytorch#195982). That
held the last chunk of every key: the embedding and output layer of any model, a layer of a
dense model (its layers share keys) and, since a MoE checkpoint keys every layer on its own,
one chunk of every tensor of every layer, growing with the model. The file's bytes and the
metadata are those torch's writer makes with one thread.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from megatron_bridge.checkpoint import write_bridge_files
from megatron_bridge.config import BridgeConfig
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


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of exactly its own bytes (``torch.save`` writes a tensor's
    whole storage, so a view of a larger one is copied first, as torch's writer does)."""
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def _streaming_file_writer(path: Path, sync_files: bool) -> Any:
    """A DCP ``FileSystemWriter`` (single file per rank) whose ``write_data`` keeps nothing
    it has written: each item's data is resolved, written and dropped before the next one
    (torch's classes are imported here, not at module import)."""
    from torch.distributed.checkpoint import FileSystemWriter
    # _StorageInfo: where an item lies in the files (torch's record; the reader needs it).
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class _StreamingFileWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            # torch's writer's order: the byte objects, then the tensors, each in plan order.
            items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
            results = []
            with open(Path(self.path) / name, "wb") as stream:
                for item in items:
                    data = planner.resolve_data(item)
                    offset = stream.tell()
                    if isinstance(data, io.BytesIO):
                        stream.write(data.getbuffer())
                    else:
                        torch.save(_compact(data.detach()), stream)
                    del data  # before the next item is made: one chunk in memory at a time
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
            done: Future = Future()
            done.set_result(results)
            return done

    return _StreamingFileWriter(path, single_file_per_rank=True, sync_files=sync_files)


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
    writer = _streaming_file_writer(ckpt, sync_files)
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
