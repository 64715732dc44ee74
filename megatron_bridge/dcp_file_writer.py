"""A torch DCP storage writer that holds one written item at a time.

torch's ``FileSystemWriter.write_data`` keeps every tensor it has written, by key, until the
file is done (it needs them for its safetensors format only; pytorch/pytorch#195982): the
last chunk of every checkpoint key stays in memory, and on a GPU every key's host copy.
Writing a checkpoint chunk by chunk (:mod:`megatron_bridge.dist_ckpt_writer`) then holds the
embedding, the output layer and, for a mixture-of-experts model, whose checkpoint keys every
layer on its own, one chunk of every tensor of every layer: memory that grows with the model.

:func:`dcp_file_writer` returns a ``FileSystemWriter`` (one file per rank) whose
``write_data`` asks the planner for each item, writes it and drops it before the next one.
The file's bytes and the metadata are those torch's writer makes with one thread.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU with a storage of exactly its own bytes (``torch.save`` writes a
    tensor's whole storage, so a view of a larger one is copied first, as torch's writer
    does)."""
    tensor = tensor.detach().cpu()
    return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


def dcp_file_writer(path: str | Path, sync_files: bool) -> Any:
    """A DCP ``FileSystemWriter`` writing ``path``'s ``__<rank>_0.distcp`` item by item, holding
    only the item being written (torch's classes are imported here, not at module import).

    Args:
        path: the checkpoint folder.
        sync_files: fsync the tensor file (and torch's ``finish`` the ``.metadata``).
    """
    from torch.distributed.checkpoint import FileSystemWriter
    # _StorageInfo: where an item lies in the files (torch's record; its readers need it).
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class ItemByItemFileWriter(FileSystemWriter):
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
                        torch.save(_compact(data), stream)
                    del data  # before the next item is made: one item in memory at a time
                    length = stream.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
            done: Future = Future()
            done.set_result(results)
            return done

    return ItemByItemFileWriter(path, single_file_per_rank=True, sync_files=sync_files)
