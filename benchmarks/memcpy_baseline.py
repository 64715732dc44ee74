"""The baseline the refit benchmarks divide by: ``dst.copy_(src)`` of the same bytes, in the
benchmark's own process and run (memcpy on CPU, a device-to-device copy on GPU)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads (None: as they are)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Memcpy:
    """``dst.copy_(src)`` bandwidth for ``nbytes`` between two warm buffers on ``device``."""

    def __init__(self, nbytes: int, device: torch.device = torch.device("cpu")) -> None:
        self.nbytes, self.device = nbytes, device
        self.src = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def bandwidth(self, threads: int | None = None, repeats: int = 3) -> float:
        """Bytes/s with ``threads`` torch threads (None: the process's), best of ``repeats``."""
        best = float("inf")
        with torch_threads(threads):
            for _ in range(repeats):
                synchronize(self.device)
                tick = time.perf_counter()
                self.dst.copy_(self.src)
                synchronize(self.device)
                best = min(best, time.perf_counter() - tick)
        return self.nbytes / best
