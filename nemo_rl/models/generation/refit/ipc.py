"""The colocated transport: the sender's stream buffer, chosen by device, and the message the
driver relays.

The sender holds one buffer of the whole stream (``StreamLayout.total_bytes``) and packs bucket
``k`` into its window ``StreamLayout.span(k)``; each engine maps the same buffer, checks every
bucket in place and, at commit, loads straight from it, so each byte is copied once (by the
sender) before the engine's own load. The sender refills the buffer only in its next stream,
after every engine has committed or aborted this one. CPU buffers are ``/dev/shm`` files
(:mod:`.shared_memory`), CUDA buffers are CUDA IPC allocations (:mod:`.cuda_ipc`). The driver
only relays control messages, never the bytes: an :class:`IpcStream` (the buffer's handle and
the stream's version) when the stream opens, and, bucket by bucket, :class:`IpcBucket`
messages when it is driven one bucket at a time.

Bucket records. After the stream's bytes the buffer holds one :class:`BucketRecords` entry per
bucket: the sender writes bucket ``k``'s header fields there once its bytes are packed, and
the word saying the record is complete last. An engine given the whole stream at once polls
these records instead of receiving one message per bucket, so the stream costs one call on
each side instead of one per bucket. The stream opens with every record cleared, so a record
always belongs to the stream being read; an engine that reads a record before the bytes it
describes are visible fails that bucket's checksum (an error, never a silent load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_rl.models.generation.refit.buckets import BucketHeader, StreamLayout
from nemo_rl.models.generation.refit.cuda_ipc import CudaIpcBuffer, CudaIpcHandle
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.shared_memory import SharedMemoryBuffer, SharedMemoryHandle

IpcBuffer = SharedMemoryBuffer | CudaIpcBuffer
IpcHandle = SharedMemoryHandle | CudaIpcHandle


@dataclass(frozen=True)
class IpcBucket:
    """One bucket of a colocated refit: its header and the stream buffer it lies in (at
    ``StreamLayout.span(header.index)``)."""

    header: BucketHeader
    buffer: IpcHandle


@dataclass(frozen=True)
class IpcStream:
    """An open colocated stream, as the sender announces it to the driver and the engines.

    Attributes:
        plan: per bucket, the names of the tensors (or pieces) it carries.
        buffer: the stream buffer (bytes, then :class:`BucketRecords`).
        version: the refit version every bucket of the stream carries.
        bucket_bytes: the stream's bucket size in bytes.
    """

    plan: list[list[str]]
    buffer: IpcHandle
    version: int
    bucket_bytes: int


# One record per bucket: version, index, num_buckets, bucket_bytes, nbytes, checksum, then
# ``index + 1`` once the others are written, then 1 if the checksum is set; 64 bytes (a cache
# line).
_RECORD_WORDS = 8
_COMPLETE = 6
_HAS_CHECKSUM = 7
_INT64_RANGE = 1 << 64


def stream_buffer_bytes(layout: StreamLayout) -> int:
    """Size of a stream buffer for ``layout``: the stream's bytes, then its bucket records."""
    return layout.total_bytes + layout.num_buckets * _RECORD_WORDS * 8


class BucketRecords:
    """The per-bucket records at the end of a stream buffer (see the module docstring).

    Args:
        buffer: uint8 [:func:`stream_buffer_bytes` of ``layout``], the stream buffer.
        layout: the stream's layout.

    Raises:
        RefitError: ``buffer`` is not of the layout's size (the two sides disagree on the
            refit info or the bucket size).
    """

    def __init__(self, buffer: torch.Tensor, layout: StreamLayout) -> None:
        if buffer.numel() != stream_buffer_bytes(layout):
            raise RefitError(
                f"the stream buffer holds {buffer.numel()} bytes, the refit info with buckets of "
                f"{layout.bucket_bytes} bytes needs {stream_buffer_bytes(layout)}: both sides "
                "need the same refit info and bucket size"
            )
        self.layout = layout
        self._words = buffer[layout.total_bytes :].view(torch.int64).view(-1, _RECORD_WORDS)

    def clear(self) -> None:
        """Mark every bucket as not yet packed (the sender, when a stream opens)."""
        self._words.zero_()
        synchronize(self._words.device)

    def publish(self, header: BucketHeader) -> None:
        """Record ``header`` (the sender, once the bucket's bytes are in place), the
        completion word last."""
        record = self._words[header.index]
        checksum = header.checksum or 0
        signed = checksum - _INT64_RANGE if checksum >= 1 << 63 else checksum
        fields = (
            header.version, header.index, header.num_buckets, header.bucket_bytes,
            header.nbytes, signed,
        )
        record[:_COMPLETE].copy_(torch.tensor(fields, dtype=torch.int64))
        record[_HAS_CHECKSUM] = int(header.checksum is not None)
        synchronize(self._words.device)
        record[_COMPLETE] = header.index + 1
        synchronize(self._words.device)

    def read(self, index: int) -> BucketHeader | None:
        """Bucket ``index``'s header once the sender has published it (its manifest is the
        layout's), else None."""
        record = self._words[index]
        if int(record[_COMPLETE].item()) != index + 1:  # read first: the fields follow it
            return None
        version, got, num_buckets, bucket_bytes, nbytes, checksum = record[:_COMPLETE].tolist()
        has_checksum = bool(record[_HAS_CHECKSUM].item())
        return BucketHeader(
            version, got, num_buckets, bucket_bytes, nbytes,
            checksum % _INT64_RANGE if has_checksum else None, self.layout.manifest(index),
        )


def require_device_memory(nbytes: int, device: torch.device, holder: str) -> None:
    """Refuse a refit buffer of ``nbytes`` that ``device`` has no room for, with what to change
    (instead of an out-of-memory error in the middle of a refit). No check on the CPU.

    Raises:
        RefitError: less than ``nbytes`` are free on the CUDA ``device``.
    """
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise RefitError(
            f"the refit needs a buffer of the whole weight stream on {holder} ({nbytes / 1e9:.2f} "
            f"GB in the engines' precision) and {device} has {free / 1e9:.2f} GB free of "
            f"{total / 1e9:.2f} GB: export in a smaller dtype "
            "(policy.generation.vllm_cfg.precision), lower "
            "policy.generation.vllm_cfg.gpu_memory_utilization, or shard the policy over more "
            "GPUs; refits hold the whole stream until every bucket has been checked"
        )


def create_ipc_buffer(nbytes: int, device: torch.device) -> IpcBuffer:
    """A shareable uint8 buffer on ``device``: shared memory on CPU, CUDA IPC on GPU.

    Raises:
        RuntimeError: a CUDA device without CUDA, or no ``/dev/shm`` on CPU.
        RefitError: too little free memory on the CUDA device.
    """
    if device.type == "cpu":
        return SharedMemoryBuffer.create(nbytes)
    if device.type == "cuda":
        require_device_memory(nbytes, device, "the sending policy rank")
        return CudaIpcBuffer.create(nbytes, device)
    raise ValueError(f"no IPC transport for device {device}; use 'cpu' or 'cuda'")


def attach_ipc_buffer(handle: IpcHandle) -> IpcBuffer:
    """Map the buffer ``handle`` describes (created by another process on this node)."""
    if isinstance(handle, SharedMemoryHandle):
        return SharedMemoryBuffer.attach(handle)
    return CudaIpcBuffer.attach(handle)


def synchronize(device: torch.device) -> None:
    """Wait until queued copies on ``device`` are done (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
