"""Device buffers for colocated refit on GPU, shared between processes by CUDA IPC handles.

The sender allocates a uint8 buffer on its GPU and sends :class:`CudaIpcHandle` (torch's
``reduce_tensor`` output: a rebuild function and its picklable arguments, including the
``cudaIpcMemHandle``) through Ray; a receiver on the same GPU maps the same device memory with
no copy. The handle names the device by its index in the sender's process, so both processes
must see the GPU under the same index (true for colocated Ray actors, which each see their
bundle's GPU as ``cuda:0``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CudaIpcHandle:
    """What a receiver needs to map a :class:`CudaIpcBuffer`: ``rebuild(*args)``."""

    rebuild: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    nbytes: int


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
        return cls(handle.rebuild(*handle.args), owner=False)

    @functools.cached_property
    def handle(self) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        assert self.tensor is not None, "the buffer is closed"
        rebuild, args = reduce_tensor(self.tensor)
        return CudaIpcHandle(rebuild, tuple(args), self.nbytes)

    def close(self) -> None:
        """Drop this process's reference (the owner's memory is freed once receivers have
        dropped theirs). Idempotent."""
        self.tensor = None
