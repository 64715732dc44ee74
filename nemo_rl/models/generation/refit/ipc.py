"""Shareable ring buffers, chosen by device, and the handles the driver relays.

A ring (:mod:`.ring`) lives in one buffer that every participant maps: a ``/dev/shm`` file on
CPU (:mod:`.shared_memory`), a CUDA IPC allocation on GPU (:mod:`.cuda_ipc`). Both can only be
mapped by processes of the node that made them, so a :class:`RingHandle` carries the Ray node
id of its maker and :func:`attach_ring` refuses a handle from another node with a message
that says so (instead of a missing file, or memory of another machine's GPU). The driver only
relays these handles; the bytes never pass through it.
"""

from __future__ import annotations

import os
import uuid
import weakref
from dataclasses import dataclass, field

import torch

from nemo_rl.models.generation.refit.cuda_ipc import CudaIpcBuffer, CudaIpcHandle
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.ring import Ring, RingSpec
from nemo_rl.models.generation.refit.shared_memory import SharedMemoryBuffer, SharedMemoryHandle

IpcBuffer = SharedMemoryBuffer | CudaIpcBuffer
IpcHandle = SharedMemoryHandle | CudaIpcHandle

# CUDA ring buffers made by this process, by RingHandle.key.
_OWN_CUDA_BUFFERS: weakref.WeakValueDictionary[str, CudaIpcBuffer] = weakref.WeakValueDictionary()

# A process outside Ray (vLLM's rank processes, scripts) names its node with this variable.
NODE_ID_ENV = "NEMO_RL_NODE_ID"


def current_node_id() -> str | None:
    """The Ray node id of this process (a Ray worker or driver), else ``$NEMO_RL_NODE_ID``,
    else None (unknown: node checks are skipped)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return os.environ.get(NODE_ID_ENV)


@dataclass(frozen=True)
class RingHandle:
    """Where a reader finds a ring.

    Attributes:
        buffer: the shareable buffer holding it.
        spec: its shape (slots, slot size, readers).
        node_id: the Ray node it lives on (None: unknown, not checked).
        writer: who writes it, for messages (e.g. "policy rank 8").
        key: names the buffer within its maker's process (a CUDA buffer is mapped there as
            itself: CUDA IPC cannot open a handle in the process that made it).
    """

    buffer: IpcHandle
    spec: RingSpec
    node_id: str | None
    writer: str
    key: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class RingRead:
    """What one engine rank reads: the ring, and its reader index in it."""

    ring: RingHandle
    reader: int


@dataclass(frozen=True)
class IpcStream:
    """A colocated stream a policy rank opened: the ring it writes and the stream's version.

    Attributes:
        ring: the ring's handle.
        version: the refit version every bucket of the stream carries.
        bucket_bytes: the stream's bucket size (with the refit info, its layout).
        plan: per bucket, the names of the tensors it carries.
    """

    ring: RingHandle
    version: int
    bucket_bytes: int
    plan: list[list[str]]


def require_device_memory(nbytes: int, device: torch.device, holder: str) -> None:
    """Refuse a refit ring of ``nbytes`` that ``device`` has no room for, with what to change
    (instead of an out-of-memory error in the middle of a refit). No check on the CPU.

    Raises:
        RefitError: less than ``nbytes`` are free on the CUDA ``device``.
    """
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise RefitError(
            f"the refit's staging ring on {holder} needs {nbytes / 1e9:.2f} GB (two slots as "
            f"large as the largest bucket) and {device} has {free / 1e9:.2f} GB free of "
            f"{total / 1e9:.2f} GB: lower policy.refit_buffer_size_gb (a bucket never holds "
            "less than the largest tensor) or policy.generation.vllm_cfg.gpu_memory_utilization"
        )


def create_ring(spec: RingSpec, device: torch.device, writer: str) -> tuple[IpcBuffer, Ring]:
    """A new ring of ``spec`` on ``device`` (shared memory on CPU, CUDA IPC on GPU), written
    by this process: its buffer (close it to free the ring) and the ring.

    Raises:
        RuntimeError: a CUDA device without CUDA, or no shared-memory directory on CPU.
        RefitError: too little free memory on the CUDA device.
    """
    if device.type == "cpu":
        buffer: IpcBuffer = SharedMemoryBuffer.create(spec.nbytes)
    elif device.type == "cuda":
        require_device_memory(spec.nbytes, device, writer)
        buffer = CudaIpcBuffer.create(spec.nbytes, device)
        assert buffer.tensor is not None
        buffer.tensor.zero_()  # a fresh allocation holds stale words: clear the control words
    else:
        raise ValueError(f"no refit ring for device {device}; use 'cpu' or 'cuda'")
    assert buffer.tensor is not None
    ring = Ring(buffer.tensor, spec)
    ring.start_writing()
    return buffer, ring


def ring_handle(buffer: IpcBuffer, spec: RingSpec, writer: str) -> RingHandle:
    """The handle readers need to map ``buffer`` as a ring of ``spec``."""
    handle = RingHandle(buffer.handle, spec, current_node_id(), writer)
    if isinstance(buffer, CudaIpcBuffer):
        _OWN_CUDA_BUFFERS[handle.key] = buffer
    return handle


def attach_ring(handle: RingHandle) -> tuple[IpcBuffer, Ring]:
    """Map the ring ``handle`` describes: its buffer (close it to unmap) and the ring.

    Raises:
        RefitError: the ring lives on another node than this process, or is gone.
    """
    here = current_node_id()
    if handle.node_id is not None and here is not None and handle.node_id != here:
        raise RefitError(
            f"the refit ring of {handle.writer} lives on node {handle.node_id} and this process "
            f"runs on node {here}: a ring can only be read on its own node (the refit plan "
            "must give every engine a writer on the engine's node)"
        )
    try:
        own = _OWN_CUDA_BUFFERS.get(handle.key)
        if isinstance(handle.buffer, SharedMemoryHandle):
            buffer: IpcBuffer = SharedMemoryBuffer.attach(handle.buffer)
        elif own is not None and own.tensor is not None:  # made here: map it as itself
            buffer = CudaIpcBuffer(own.tensor, owner=False)
        else:
            buffer = CudaIpcBuffer.attach(handle.buffer)
    except RuntimeError as err:
        raise RefitError(f"cannot map the refit ring of {handle.writer}: {err}") from err
    assert buffer.tensor is not None
    return buffer, Ring(buffer.tensor, handle.spec)


class RingMappings:
    """A reader process's mappings of shared-memory rings, kept between refits: the writer
    reuses its ring, and mapping it anew would cost a page fault per page on every refit. A
    mapping is dropped when the process is handed another ring (the writer made a new one);
    CUDA rings, which the writer frees after each stream, are mapped per stream.
    """

    def __init__(self) -> None:
        self._kept: dict[SharedMemoryHandle, tuple[IpcBuffer, Ring]] = {}

    def open(self, handle: RingHandle) -> tuple[Ring, IpcBuffer | None]:
        """The ring ``handle`` names, and the buffer to close after this stream (None: kept)."""
        if not isinstance(handle.buffer, SharedMemoryHandle):
            buffer, ring = attach_ring(handle)
            return ring, buffer
        kept = self._kept.get(handle.buffer)
        if kept is None or kept[1].spec != handle.spec:
            self.close()
            kept = attach_ring(handle)
            self._kept[handle.buffer] = kept
        return kept[1], None

    def close(self) -> None:
        """Drop every kept mapping."""
        for buffer, _ in self._kept.values():
            buffer.close()
        self._kept.clear()
