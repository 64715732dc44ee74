"""The non-colocated transport: one process group over the trainer's rank 0 and every engine.

:class:`RefitCollective` builds its own ``TCPStore`` (hosted by group rank 0, the trainer, on a
socket bound to the given address) and a process group constructed directly on it: gloo on CPU
(its pairs bound to the same address), NCCL on GPU. Nothing is registered with
``torch.distributed``'s default group, so the Megatron worker's own groups are untouched and a
vLLM worker needs no default group at all.

Protocol, per bucket, all broadcasts from group rank 0: the header's length (int64 [1]), the
pickled :class:`~.buckets.BucketHeader` (uint8), then the payload. A length of -1 instead means
the sender gave up (its export disagreed with the refit info): receivers stop at once. The
sender packs bucket ``k + 1`` into its second buffer while bucket ``k`` is being broadcast from
the first, and waits for that broadcast before refilling a buffer. A receiver (an engine)
broadcasts each bucket straight into the next slot of its own ring (:mod:`.ring`), once its
readers (the engine's rank processes) have released the bucket that was there, and publishes
it for them to load: the sender's next broadcast waits for the slowest engine, so no engine
ever stages more than its ring. A receiver that finds a bad bucket, or whose readers gave up,
keeps receiving (into scratch memory) to the end of the stream, so the group stays in step,
and raises then.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_bridge.parallel_state import bound_tcp_store
from nemo_rl.models.generation.refit.buckets import (
    BucketHeader,
    BucketPacker,
    StreamLayout,
    check_header,
    verify_payload,
)
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.ring import Ring, synchronize

# Header length that tells the receivers the sender abandoned the stream.
_ABORTED = -1


class RefitCollective:
    """A broadcast group: rank 0 sends the refit stream, ranks 1..world_size-1 receive it.

    Args:
        ip: address of group rank 0's node; rank 0 binds the store there.
        port: free TCP port on that node for the store.
        world_size: 1 + the number of engines.
        rank: this process's rank in the group (0: the trainer).
        device: where this process's buffers live (cpu: gloo; cuda: NCCL).
        timeout_s: seconds any rendezvous or broadcast may take before it fails.

    Raises:
        RefitError: the group could not be formed in time.
    """

    def __init__(
        self,
        ip: str,
        port: int,
        world_size: int,
        rank: int,
        device: torch.device,
        timeout_s: float = 300.0,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"a refit group needs world_size >= 2 (trainer + engines) and 0 <= rank < "
                f"world_size, got world_size={world_size}, rank={rank}"
            )
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.broken = False  # a broadcast failed: the group is unusable, form a new one
        timeout = timedelta(seconds=timeout_s)
        try:
            self._store = bound_tcp_store(ip, port, world_size, rank == 0, timeout)
            self._group = self._make_group(ip, timeout)
        except (RuntimeError, OSError) as err:
            raise RefitError(
                f"rank {rank} could not join the refit group at {ip}:{port} (world size "
                f"{world_size}) within {timeout_s:g} s: {err}"
            ) from err

    def _make_group(self, ip: str, timeout: timedelta) -> dist.ProcessGroup:
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(self._store, self.rank, self.world_size, options)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        address = _own_address(ip, self.rank)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(self._store, self.rank, self.world_size, options)

    # ------------------------------------------------------------------ primitives

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        return self._group.broadcast([tensor], options)

    def _send_header(self, header: BucketHeader | None) -> None:
        """Broadcast ``header``; None tells the receivers the sender gave up (length -1)."""
        if header is None:
            self._broadcast(torch.tensor([_ABORTED], device=self.device)).wait()
            return
        data = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], device=self.device)).wait()
        self._broadcast(data.to(self.device)).wait()

    def _receive_header(self) -> BucketHeader:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length).wait()
        if int(length.item()) == _ABORTED:
            raise RefitError(
                "the sender gave up on the refit stream (its error is in the policy's result)"
            )
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data).wait()
        return pickle.loads(data.cpu().numpy().tobytes())

    # ------------------------------------------------------------------ streams

    def send(self, packer: BucketPacker, buffers: list[torch.Tensor]) -> None:
        """Rank 0: broadcast every bucket ``packer`` fills, alternating the two ``buffers``.

        Raises:
            RefitError: a broadcast failed (a receiver died) or timed out.
        """
        if self.rank != 0:
            raise RuntimeError("only group rank 0 (the trainer) sends the refit stream")
        pending: dist.Work | None = None
        try:
            for index in range(packer.layout.num_buckets):
                buffer = buffers[index % 2]
                try:
                    header = packer.fill(index, buffer)
                except RefitError:  # the export disagrees: release the waiting receivers
                    if pending is not None:
                        pending.wait()
                    self._send_header(None)
                    raise
                synchronize(self.device)
                if pending is not None:
                    pending.wait()
                self._send_header(header)
                pending = self._broadcast(buffer[: header.nbytes])
            if pending is not None:
                pending.wait()
        except RefitError:
            raise
        except RuntimeError as err:
            self.broken = True
            raise RefitError(
                f"broadcasting the refit stream failed (a receiver died or timed out): {err}"
            ) from err

    def receive(
        self,
        layout: StreamLayout,
        ring: Ring,
        started: Callable[[int], None],
        timeout_s: float,
    ) -> None:
        """Ranks >= 1: receive a whole stream into ``ring``, checking and publishing every
        bucket for the ring's readers.

        Args:
            layout: the stream's layout (from this engine's refit info).
            ring: the engine's ring; this process is its writer.
            started: called with the stream's version once its first header arrived.
            timeout_s: seconds the readers may take to release a slot.

        Raises:
            RefitError: a bucket was corrupt or disagreed with the refit info, or the readers
                gave up (raised after the stream ended; the ring is aborted), or the sender
                died or timed out.
        """
        if self.rank == 0:
            raise RuntimeError("group rank 0 sends the refit stream; receivers have rank >= 1")
        first_error: RefitError | None = None
        version: int | None = None

        def fail(err: RefitError) -> None:  # the readers stop now; the group goes on
            nonlocal first_error
            first_error = first_error or err
            if version is not None:
                ring.abort(version)

        try:
            for index in range(layout.num_buckets):
                header = self._receive_header()
                if version is None:
                    version = header.version
                    started(version)
                target = None
                if first_error is None:
                    try:
                        check_header(layout, header, index, version)
                        target = ring.slot_for(index, version, timeout_s)[: header.nbytes]
                    except RefitError as err:
                        fail(err)
                if target is None:  # keep the group in step; discard the bytes
                    target = torch.empty(header.nbytes, dtype=torch.uint8, device=self.device)
                self._broadcast(target).wait()
                if first_error is None:
                    try:
                        verify_payload(header, target)
                        ring.publish(header)
                    except RefitError as err:
                        fail(err)
        except RefitError as err:
            fail(err)
        except RuntimeError as err:
            self.broken = True
            fail(RefitError(
                f"receiving the refit stream failed (the sender died or timed out): {err}"
            ))
        if first_error is not None:
            raise first_error

    def close(self) -> None:
        """Leave the group (idempotent)."""
        group = getattr(self, "_group", None)
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except RuntimeError:
                pass
        self._group = None
        self._store = None


def _own_address(group_ip: str, rank: int) -> str:
    """The address this rank's gloo pairs bind: rank 0's is the group's (its node's); every
    other rank binds its own node's (Ray's address of this node; a process outside Ray joining
    a loopback group binds loopback, else the address its hostname resolves to), since a
    process can only bind addresses of its own machine."""
    if rank == 0:
        return group_ip
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    if group_ip.startswith("127.") or group_ip == "localhost":
        return group_ip
    return socket.gethostbyname(socket.gethostname())
