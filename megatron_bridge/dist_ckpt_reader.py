"""Stream HF-layout tensors out of a Megatron distributed checkpoint, one tensor at a time.

A ``torch_dist`` checkpoint stores every Megatron tensor whole (TP slices, pipeline stages and
expert-parallel ranks' experts are chunks of one global tensor), so the HF tensors can be
rebuilt from it without building a model: :func:`checkpoint_hf_weights` reads one Megatron
tensor (one layer or one expert of a stacked tensor) at a time, whatever TP/PP/EP layout wrote
it, turns it into HF tensors with the TP=1 transforms and yields them. Peak memory: one
Megatron tensor; no process group and no megatron-core import.

The files are torch DCP's: ``.metadata`` (read with DCP's ``FileSystemReader``) maps each chunk
to a byte range of a ``.distcp`` file holding it as ``torch.save`` output. Chunks are loaded
here directly (``torch.load`` through a window on the file, which reads the bytes straight
into the new tensor); a region that is exactly one stored chunk is that loaded tensor, with no
further copy (DCP's own ``read_data`` always copies into a destination tensor).

A training checkpoint (model and optimizer saved together, as nemo_rl's policy saves them)
is read the same way: megatron-core keys every optimizer tensor under ``optimizer.``
(:data:`OPTIMIZER_KEY_PREFIX`), and those are not model tensors.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_bridge.checkpoint import read_lora_spec
from megatron_bridge.config import BridgeConfig
from megatron_bridge.dist_ckpt_layout import TensorChunk, tensor_chunks
from megatron_bridge.lora import LoraSpec
from megatron_bridge.lora_targets import ADAPTER_PARAMS, ADAPTER_SUFFIX, LoraTarget

# Prefix of the keys megatron-core's optimizers give their sharded state (Adam moments, fp32
# master copies) in a dist checkpoint saved with the model.
OPTIMIZER_KEY_PREFIX = "optimizer."


class _FileWindow(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file as a seekable read-only file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        size = max(0, min(len(view), self._length - self._pos))
        done = 0
        while done < size:
            got = os.preadv(self._fd, [view[done:size]], self._start + self._pos + done)
            if got == 0:
                raise ValueError("dist checkpoint file ends inside a stored tensor (truncated?)")
            done += got
        self._pos += done
        return done


class DistCheckpointReader:
    """Reads any region of any tensor of a ``torch_dist`` checkpoint folder.

    Raises (on construction):
        FileNotFoundError: no ``.metadata`` in ``ckpt_dir``.
        ValueError: an unreadable ``.metadata``.
    """

    def __init__(self, ckpt_dir: str | Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = Path(ckpt_dir)
        if not (self.path / ".metadata").is_file():
            raise FileNotFoundError(f"{self.path} has no .metadata: not a dist checkpoint")
        try:
            self.metadata = FileSystemReader(self.path).read_metadata()
        except Exception as err:  # unpickling a damaged file raises anything
            raise ValueError(
                f"{self.path}/.metadata is unreadable (corrupt or truncated?): "
                f"{type(err).__name__}: {err}"
            ) from err
        self._fds: dict[str, int] = {}

    def check_files(self) -> None:
        """Check that every file the metadata points into exists and is long enough.

        Raises:
            ValueError: a missing or truncated ``.distcp`` file, named with its sizes.
        """
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for name, end in sorted(needed.items()):
            file = self.path / name
            if not file.is_file():
                raise ValueError(f"{self.path} is incomplete: {name} is missing")
            size = file.stat().st_size
            if size < end:
                raise ValueError(
                    f"{file} is truncated: {size} bytes, the checkpoint's metadata needs {end}"
                )

    def close(self) -> None:
        """Close the checkpoint files."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _stored(self, key: str) -> Any:
        stored = self.metadata.state_dict_metadata.get(key)
        if stored is None or not hasattr(stored, "chunks"):
            raise KeyError(f"tensor {key!r} not found in dist checkpoint {self.path}")
        return stored

    def shape(self, key: str) -> tuple[int, ...]:
        """The whole stored shape of tensor ``key``."""
        return tuple(self._stored(key).size)

    def _load(self, storage_index: Any) -> torch.Tensor:
        """One stored chunk, as written."""
        info = self.metadata.storage_data[storage_index]
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{self.path}: stream transforms {info.transform_descriptors} "
                             f"are not supported")
        if info.relative_path not in self._fds:
            self._fds[info.relative_path] = os.open(self.path / info.relative_path, os.O_RDONLY)
        window = _FileWindow(self._fds[info.relative_path], info.offset, info.length)
        return torch.load(window, map_location="cpu", weights_only=True)

    def read(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of tensor ``key``, in its stored dtype.

        Raises:
            KeyError: no tensor ``key`` in the checkpoint.
            ValueError: the region is outside the stored tensor or not fully stored.
        """
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        stored = self._stored(key)
        if len(offset) != len(stored.size) or any(
            o + s > size for o, s, size in zip(offset, shape, stored.size)
        ):
            raise ValueError(
                f"{key}: region at {offset} of shape {shape} is outside the stored tensor of "
                f"shape {tuple(stored.size)}"
            )
        region = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
        items = create_read_items_for_chunk_list(key, stored, [region])
        if sum(math.prod(item.lengths) for item in items) != math.prod(shape):
            raise ValueError(f"{key}: the checkpoint does not hold all of region {offset} {shape}")
        if len(items) == 1 and stored.chunks[items[0].storage_index.index].sizes == region.sizes:
            return self._load(items[0].storage_index)  # the region is exactly one stored chunk
        out = torch.empty(shape, dtype=stored.properties.dtype)
        for item in items:
            source, target = self._load(item.storage_index), out
            for dim, length in enumerate(item.lengths):
                source = source.narrow(dim, item.storage_offsets[dim], length)
                target = target.narrow(dim, item.dest_offsets[dim], length)
            target.copy_(source)
        return out


@torch.no_grad()
def checkpoint_hf_weights(
    ckpt_dir: str | Path, bridge: BridgeConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor of a Megatron dist checkpoint.

    Same names, order and values as :func:`megatron_bridge.export_hf_weights` on the loaded
    model (vocabulary padding dropped; tied embeddings yield no lm_head). A checkpoint with
    LoRA adapters (``lora.json``) is exported merged, like the live model: each adapted
    linear's weight is ``W + scale * B A`` (in float32, then the stored dtype).

    Args:
        ckpt_dir: a checkpoint written by :func:`~megatron_bridge.checkpoint.
            save_megatron_checkpoint` or :func:`~megatron_bridge.dist_ckpt_writer.
            convert_hf_to_dist_checkpoint`, or a training checkpoint holding the model's
            tensors with its optimizer's (skipped) and a ``bridge.json``.
        bridge: its :class:`BridgeConfig` (:func:`~megatron_bridge.checkpoint.
            checkpoint_bridge`), which carries the saved vocabulary padding.
        dtype: cast to this dtype; None keeps the stored one.

    Yields:
        HF name and a contiguous CPU tensor (a view of the Megatron tensor it comes from
        where the HF tensor is a contiguous piece of it).

    Raises:
        ValueError: a stored tensor's shape differs from the one ``bridge`` implies, or the
            checkpoint holds tensors ``bridge`` does not produce.
        KeyError: a tensor missing from the checkpoint.
    """
    reader = DistCheckpointReader(ckpt_dir)
    lora = read_lora_spec(ckpt_dir)
    dims = bridge.dims(1)
    # Each Megatron tensor's whole region: one chunk at TP=1 (two for a fused gate/up).
    plan = [(mapping, tensor_chunks(mapping, bridge, 1, 0)) for mapping in bridge.plan()]
    stored = {
        k
        for k, md in reader.metadata.state_dict_metadata.items()
        if hasattr(md, "chunks") and not k.startswith(OPTIMIZER_KEY_PREFIX)
    }
    produced = {chunks[0].key for _, chunks in plan}
    if lora is not None:
        produced |= {
            _adapter_key(chunks[0].key, ab) for _, chunks in plan for ab in ("lora_A", "lora_B")
        }
    leftover = sorted(stored - produced)
    if leftover:
        reader.close()
        raise ValueError(
            f"{ckpt_dir} holds tensors that the config in bridge.json does not produce, so the "
            f"export would drop them: {leftover}"
        )
    try:
        for mapping, chunks in plan:
            key, expected = chunks[0].key, chunks[0].global_shape
            if reader.shape(key) != expected:
                raise ValueError(
                    f"{ckpt_dir}: tensor {key} has shape {reader.shape(key)}, the config in "
                    f"bridge.json implies {expected}"
                )
            # Without the stacking axis; at TP=1 a region is often one stored chunk, loaded
            # without a copy (a fused gate/up's halves are stored as separate chunks).
            parts = [reader.read(key, c.offset, c.shape).reshape(c.shape[c.stacked :])
                     for c in chunks]
            if lora is not None:
                parts = _merged_parts(reader, lora, mapping.megatron_name, chunks, parts)
            tensors = parts if mapping.kind == "gate_up" else mapping.unshard(parts, dims)
            if dtype is not None:
                tensors = [t.to(dtype) for t in tensors]
            yield from zip(mapping.hf_names, tensors)
    finally:
        reader.close()


def _adapter_key(weight_key: str, tensor: str) -> str:
    """The checkpoint key of the adapter ``tensor`` (lora_A / lora_B) of the linear whose
    weight is stored under ``weight_key``."""
    return f"{weight_key.removesuffix('.weight')}{ADAPTER_SUFFIX}.{tensor}"


def _merged_parts(
    reader: DistCheckpointReader,
    lora: LoraSpec,
    megatron_name: str,
    chunks: list[TensorChunk],
    parts: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``parts`` (a whole TP=1 Megatron weight, or its gate and up halves) with the adapter of
    its linear folded in; unchanged when the linear has none."""
    target = next((t for t in lora.targets if f"{t.module_name()}.weight" == megatron_name), None)
    if target is None:
        return parts
    a, b = (_read_adapter(reader, lora, target, chunks[0].key, ab).float() for ab in ADAPTER_PARAMS)
    b_parts = b.chunk(len(parts))  # a gated fc1's B: gate rows, then up rows, as its weight
    scale = lora.settings.scale
    return [(w.float() + scale * bp @ a).to(w.dtype) for w, bp in zip(parts, b_parts)]


def _read_adapter(
    reader: DistCheckpointReader, lora: LoraSpec, target: LoraTarget, weight_key: str, tensor: str
) -> torch.Tensor:
    """The whole (TP=1) ``lora_A`` ``[r, in]`` or ``lora_B`` ``[out, r]`` of ``target``, whose
    linear's weight is stored under ``weight_key``: one layer of the stacked adapter tensor."""
    key = _adapter_key(weight_key, tensor)
    shape = reader.shape(key)
    index, _ = lora.stack_index(target)
    return reader.read(key, (index, 0, 0), (1, *shape[1:]))[0]


@torch.no_grad()
def checkpoint_lora_weights(
    ckpt_dir: str | Path, bridge: BridgeConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft_name, tensor)`` for every LoRA adapter of a Megatron dist checkpoint, in
    PEFT's layout: the names and values :func:`~megatron_bridge.lora_weights.
    export_lora_weights` yields on the loaded model (``<hf module>.lora_A.weight`` ``[r, in]``
    and ``.lora_B.weight`` ``[out, r]`` per HF projection; a fused q/k/v or gate/up adapter's
    ``A`` repeated per projection, its ``B`` split by rows as the fused weight splits).

    Args:
        ckpt_dir: a checkpoint with ``lora.json``.
        bridge: its :class:`BridgeConfig` (:func:`~megatron_bridge.checkpoint.
            checkpoint_bridge`).
        dtype: cast to this dtype; None keeps the stored one.

    Raises:
        ValueError: the checkpoint holds no adapters.
        KeyError: an adapter tensor missing from the checkpoint.
    """
    lora = read_lora_spec(ckpt_dir)
    if lora is None:
        raise ValueError(f"{ckpt_dir} holds no LoRA adapters (no lora.json)")
    reader = DistCheckpointReader(ckpt_dir)
    plan = {m.megatron_name: m for m in bridge.plan()}
    dims = bridge.dims(1)
    try:
        for target in sorted(lora.targets):
            mapping = plan[f"{target.module_name()}.weight"]
            key = tensor_chunks(mapping, bridge, 1, 0)[0].key
            a, b = (_read_adapter(reader, lora, target, key, ab) for ab in ADAPTER_PARAMS)
            if dtype is not None:
                a, b = a.to(dtype), b.to(dtype)
            # A column-parallel linear's B has its weight's rows (q/k/v, gate/up fused); a
            # row-parallel linear's A has its weight's columns (one projection).
            if target.parallel == "column":
                pairs = [(a, part) for part in mapping.unshard([b], dims)]
            else:
                pairs = [(mapping.unshard([a], dims)[0], b)]
            for name, (a_part, b_part) in zip(mapping.hf_names, pairs, strict=True):
                module = name.removesuffix(".weight")
                yield f"{module}.lora_A.weight", a_part.contiguous()
                yield f"{module}.lora_B.weight", b_part.contiguous()
    finally:
        reader.close()
