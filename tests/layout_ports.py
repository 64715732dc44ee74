"""Rendezvous ports for two-process tests that set up one parallel layout after another.

Ports picked when such a test starts may be taken by the time a later layout binds its
rendezvous store (gloo's own connections, and every other process on the machine, draw from the
same ephemeral range): ``OSError: [Errno 98] Address already in use``. Instead each layout's
ranks agree on the next layout's port while their process group is still up.
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_bridge.parallel_state import find_free_port


def next_layout_port() -> int:
    """A TCP port free now, chosen by rank 0 and sent to every rank of the current process
    group; call it before the layout's group is destroyed."""
    port = [find_free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return int(port[0])
