"""Two-process tests that set up one parallel layout after another: their rendezvous ports, and
the spawn that runs both ranks and collects what each returns.

Ports picked when such a test starts may be taken by the time a later layout binds its
rendezvous store (gloo's own connections, and every other process on the machine, draw from the
same ephemeral range): ``OSError: [Errno 98] Address already in use``. Instead each layout's
ranks agree on the next layout's port while their process group is still up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_bridge.parallel_state import find_free_port


def next_layout_port() -> int:
    """A TCP port free now, chosen by rank 0 and sent to every rank of the current process
    group; call it before the layout's group is destroyed."""
    port = [find_free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return int(port[0])


@contextlib.contextmanager
def gloo_ranks(rank: int, port: int, world_size: int = 2) -> Iterator[None]:
    """The default process group of ``world_size`` gloo ranks meeting at 127.0.0.1:``port``
    (60 s timeout), destroyed on exit."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_rank(
    rank: int, worker: Callable[[int, str, str, int], Any], model_path: str, out_dir: str, port: int
) -> None:
    torch.save(worker(rank, model_path, out_dir, port), Path(out_dir) / f"rank{rank}.pt")


def run_two_ranks(
    worker: Callable[[int, str, str, int], Any], model_path: str | Path, out_dir: Path
) -> list[Any]:
    """Run ``worker(rank, model_path, out_dir, port)`` in two spawned processes (``port``: the
    first layout's rendezvous port, the same on both); what each returned, by rank (also saved
    as ``out_dir/rank<r>.pt``)."""
    args = (worker, str(model_path), str(out_dir), find_free_port())
    mp.spawn(_run_rank, args=args, nprocs=2, join=True)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]
