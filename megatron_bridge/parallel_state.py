"""Start and stop torch.distributed plus megatron-core's model-parallel groups.

Used by tests, the ``megatron-bridge`` CLI and nemo_rl's policy workers: one call sets up the
process group (gloo on CPU, nccl on GPU), megatron's TP/PP/CP/EP groups and the model-parallel RNG
tracker, and on a machine without CUDA applies :mod:`megatron_bridge.cpu_compat` (the one place
it is applied: every process that builds a Megatron model initialises its parallel state first).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_bridge.cpu_compat import (
    apply_cpu_compat,
    define_missing_te_names,
    model_parallel_manual_seed,
)


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (for a rendezvous address)."""
    return find_free_ports(1)[0]


def find_free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free when asked (every socket is
    held until all are chosen, so the system cannot hand out one port twice)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def bound_tcp_store(
    host: str, port: int, world_size: int, is_server: bool, timeout: timedelta
) -> dist.TCPStore:
    """A rendezvous ``TCPStore`` at ``host:port``; the server listens on ``host`` only.

    torch's own store server listens on every interface; here the server's listening socket
    is bound to ``host`` first and handed to it, so only ``host`` (127.0.0.1 for a local run)
    reaches the store. Clients (``is_server=False``) connect to ``host:port``.
    """
    if not is_server:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(world_size * 4)
    except OSError:
        listener.close()
        raise
    return dist.TCPStore(
        host, port, world_size, True, timeout,
        wait_for_workers=False, master_listen_fd=listener.detach(),
    )


def check_parallel_sizes(world_size: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> None:
    """megatron-core's rules for the parallel sizes on ``world_size`` ranks.

    The dense grid is TP x CP x DP x PP; the experts' grid is ETP x EP x EDP x PP with the
    expert tensor-parallel size ETP = TP here, so ``world_size`` must be a multiple of both
    ``tp * pp * cp`` and ``tp * ep * pp`` (the EP ranks come out of the data-parallel and
    context-parallel ranks).

    Raises:
        ValueError: a size < 1 or a ``world_size`` that does not fit, naming the sizes.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if world_size % (tp * pp * cp):
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of tp*pp*cp ({tp}*{pp}*{cp})"
        )
    if world_size % (tp * ep * pp):
        raise ValueError(
            f"world_size ({world_size}) must be a multiple of tp*ep*pp ({tp}*{ep}*{pp}): "
            f"expert parallelism (expert_model_parallel_size ep={ep}) splits the experts over "
            f"data-parallel ranks; use {tp * ep * pp}x as many ranks or a smaller ep"
        )


def initialize_megatron_parallel(
    rank: int,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    master_port: int | None = None,
    master_addr: str = "127.0.0.1",
    seed: int = 1234,
    timeout_s: float = 300.0,
    ep: int = 1,
) -> None:
    """Initialise torch.distributed and megatron-core parallel state for this process.

    Args:
        rank: global rank of this process, in [0, world_size).
        world_size: number of processes; must be a multiple of ``tp * pp * cp`` (the rest is
            data parallelism).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size (GPU/TransformerEngine only; 1 on CPU).
        ep: expert-parallel size (megatron's ``expert_model_parallel_size``); the experts'
            tensor-parallel size is ``tp``. See :func:`check_parallel_sizes`.
        master_port: rendezvous port; defaults to ``$MASTER_PORT``.
        master_addr: rendezvous address (loopback by default); rank 0 serves the
            rendezvous store on this address only.
        seed: base seed for megatron's model-parallel RNG tracker.
        timeout_s: collective timeout in seconds of the default process group and of every
            group megatron makes, so a hung peer fails instead of blocking.

    Raises:
        ValueError: sizes that do not divide ``world_size``, or no port given.
    """
    check_parallel_sizes(world_size, tp, pp, cp, ep)
    if master_port is None:
        if "MASTER_PORT" not in os.environ:
            raise ValueError("master_port is required (or set $MASTER_PORT)")
        master_port = int(os.environ["MASTER_PORT"])
    apply_cpu_compat()
    define_missing_te_names()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=bound_tcp_store(master_addr, master_port, world_size, rank == 0, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        distributed_timeout_minutes=timeout_s / 60,  # megatron's groups: the same bound
    )
    model_parallel_manual_seed(seed)


def collective_device() -> torch.device:
    """Where a tensor must live for a collective on the default backend: the current CUDA
    device under nccl, the CPU under gloo (also when no process group is up)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def destroy_megatron_parallel() -> None:
    """Tear down megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
