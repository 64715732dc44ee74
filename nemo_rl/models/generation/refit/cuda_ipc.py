"""Device buffers for colocated refit on GPU, shared between processes by CUDA IPC handles.

The writer allocates a uint8 buffer on its GPU and sends :class:`CudaIpcHandle` (torch's
``reduce_tensor`` output: a rebuild function and its picklable arguments, including the
``cudaIpcMemHandle``, plus the GPU's UUID) through Ray; a reader on the same node maps the same
device memory with no copy. Processes number their visible GPUs differently (a Ray actor sees
its bundle's GPU as ``cuda:0``, the rank processes of a tensor-parallel engine see all of the
engine's GPUs), so the reader finds the buffer's GPU by its UUID among the GPUs it sees and
rebuilds the tensor on that index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


# Position of the device index among the arguments of torch's ``rebuild_cuda_tensor``.
_DEVICE_ARG = 6


@dataclass(frozen=True)
class CudaIpcHandle:
    """What a reader needs to map a :class:`CudaIpcBuffer`: ``rebuild(*args)`` on the GPU
    whose UUID is ``device_uuid``."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    nbytes: int
    device_uuid: str


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``.

    Raises:
        RuntimeError: no GPU this process sees has that UUID.
    """
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == uuid:
            return index
    raise RuntimeError(
        f"the refit buffer lives on GPU {uuid}, which this process does not see "
        f"(CUDA_VISIBLE_DEVICES gives it {torch.cuda.device_count()} GPUs)"
    )


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs CUDA, which this process does not have; CPU tensors use the "
            "shared-memory transport (a buffer on device 'cpu')"
        )


class CudaIpcBuffer:
    """A uint8 CUDA tensor ``[nbytes]`` another process can map.

    Use :meth:`create` (owner) or :meth:`attach` (receiver), not the constructor.
    """

    def __init__(self, tensor: torch.Tensor, owner: bool) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.nbytes = tensor.numel()
        self.owner = owner

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> CudaIpcBuffer:
        """A new buffer of ``nbytes`` on CUDA ``device``.

        Raises:
            RuntimeError: CUDA is not available.
        """
        _require_cuda("a CUDA IPC buffer")
        if nbytes <= 0:
            raise ValueError(f"a CUDA IPC buffer needs nbytes > 0, got {nbytes}")
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), owner=True)

    @classmethod
    def attach(cls, handle: CudaIpcHandle) -> CudaIpcBuffer:
        """Map the buffer another process created (same GPU).

        Raises:
            RuntimeError: CUDA is not available.
        """
        _require_cuda("opening a CUDA IPC handle")
        args = list(handle.args)
        args[_DEVICE_ARG] = local_device_index(handle.device_uuid)
        return cls(handle.rebuild(*args), owner=False)

    @functools.cached_property
    def handle(self) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        assert self.tensor is not None, "the buffer is closed"
        rebuild, args = reduce_tensor(self.tensor)
        uuid = _device_uuid(self.tensor.device.index)
        return CudaIpcHandle(rebuild, tuple(args), self.nbytes, uuid)

    def close(self) -> None:
        """Drop this process's reference (the owner's memory is freed once receivers have
        dropped theirs). Idempotent."""
        self.tensor = None
