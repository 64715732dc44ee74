"""The colocated transport: the sender's stream buffer, chosen by device, and the message the
driver relays.

The sender holds one buffer of the whole stream (``StreamLayout.total_bytes``) and packs bucket
``k`` into its window ``StreamLayout.span(k)``; each engine maps the same buffer, checks every
bucket in place and, at commit, loads straight from it, so each byte is copied once (by the
sender) before the engine's own load. The sender refills the buffer only in its next stream,
after every engine has committed or aborted this one. CPU buffers are ``/dev/shm`` files
(:mod:`.shared_memory`), CUDA buffers are CUDA IPC allocations (:mod:`.cuda_ipc`). The driver
only relays :class:`IpcBucket` messages: a header and a handle, never the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_rl.models.generation.refit.buckets import BucketHeader
from nemo_rl.models.generation.refit.cuda_ipc import CudaIpcBuffer, CudaIpcHandle
from nemo_rl.models.generation.refit.shared_memory import SharedMemoryBuffer, SharedMemoryHandle

IpcBuffer = SharedMemoryBuffer | CudaIpcBuffer
IpcHandle = SharedMemoryHandle | CudaIpcHandle


@dataclass(frozen=True)
class IpcBucket:
    """One bucket of a colocated refit: its header and the stream buffer it lies in (at
    ``StreamLayout.span(header.index)``)."""

    header: BucketHeader
    buffer: IpcHandle


def create_ipc_buffer(nbytes: int, device: torch.device) -> IpcBuffer:
    """A shareable uint8 buffer on ``device``: shared memory on CPU, CUDA IPC on GPU.

    Raises:
        RuntimeError: a CUDA device without CUDA, or no ``/dev/shm`` on CPU.
    """
    if device.type == "cpu":
        return SharedMemoryBuffer.create(nbytes)
    if device.type == "cuda":
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
