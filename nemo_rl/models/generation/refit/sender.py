"""Trainer side of a refit: what each policy rank does (the Megatron worker only wires it up).

The export (``megatron_bridge.export_hf_weights``) is collective over a model replica's TP/PP
(and EP) ranks, which run it in lockstep, bucket by bucket, each ending up with the full HF
tensors one group at a time.

Colocated, every rank exports (each replica in its own groups) and the ring writers of the
refit plan (:mod:`.plan`: the lowest policy rank of each node on CPU, every rank on GPU) pack
the buckets into their ring (:mod:`.ring`), from which the engines of their node or device
load them as they arrive: ``prepare_weights_for_ipc`` opens a stream (a new version; the
writers create or reuse their ring and return its handle), ``get_weights_ipc_handles`` exports
and packs buckets (each waits for its slot to be released), ``finish_weights_ipc`` ends the
stream once the engines are done (a CUDA ring is freed; a shared-memory one is kept for the
next refit). Not colocated, the ranks of the first replica export and global rank 0 broadcasts
every bucket over the :class:`~.collective.RefitCollective` joined with ``init_collective``.

A rank whose stream fails (a reader aborted or died, a timeout) keeps consuming the export to
its end without packing, so the ranks it exports with never wait for it in a collective, then
raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping

import torch

from megatron_bridge import dtype_from_name
from nemo_rl.models.generation.refit.buckets import BucketPacker, StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.expert_groups import StackedTensor, group_experts
from nemo_rl.models.generation.refit.interfaces import RefitInfo, RefitSettings
from nemo_rl.models.generation.refit.ipc import IpcBuffer, IpcStream, create_ring, ring_handle
from nemo_rl.models.generation.refit.ring import Ring, RingSpec
from nemo_rl.utils.fault_injection import fault_at

# Starts a fresh export of HF tensors in the given dtype (None: the parameters' dtype).
ExportFn = Callable[[torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]


class RefitSender:
    """One policy rank's part in refits (:class:`~.interfaces.WeightSender`).

    Args:
        export: starts a fresh export; called on every exporting rank at once.
        rank: this rank's global rank (rank 0 sends broadcasts).
        in_first_replica: this rank belongs to the first replica of every parameter (the
            experts' included), whose ranks export for a broadcast.
        device: where the rings and send buffers live (the policy's device).
        settings: bucket size, export dtype, timeout and checksums of every refit.
    """

    def __init__(
        self,
        export: ExportFn,
        rank: int,
        in_first_replica: bool,
        device: torch.device,
        settings: RefitSettings,
    ) -> None:
        if rank == 0 and not in_first_replica:
            raise ValueError("global rank 0 belongs to the first replica")
        self._export = export
        self.rank = rank
        self.in_first_replica = in_first_replica
        self.device = device
        self.settings = settings
        self.version = 0  # streams opened; the engines record the version they loaded
        self.info: RefitInfo | None = None
        self._dtype = None if settings.dtype is None else dtype_from_name(settings.dtype)
        self._open: BucketPacker | None = None  # the open colocated stream
        self._ring: tuple[IpcBuffer, Ring] | None = None  # this rank's ring, when it writes one
        self._writes = False  # this rank writes a ring in the open stream
        self._send_buffers: list[torch.Tensor] = []  # two buckets, kept, for broadcasts
        self._stream_start = 0.0
        self._collective: RefitCollective | None = None

    # ------------------------------------------------------------------ refit info

    def prepare_refit_info(self) -> RefitInfo:
        """``{hf_name: (shape, dtype)}`` of the exported weights in export order, in the
        settings' dtype. Runs one export (every rank, in lockstep)."""
        self.info = {name: (tuple(t.shape), t.dtype) for name, t in self._stream()}
        return self.info

    def _stream(self) -> Iterator[tuple[str, torch.Tensor | StackedTensor]]:
        """A fresh export, each MoE layer's experts stacked as vLLM loads them
        (:mod:`~.expert_groups`: 2 tensors per layer instead of 3 per expert)."""
        return group_experts(self._export(self._dtype))

    def _layout(self) -> StreamLayout:
        if self.info is None:
            raise RefitError("call prepare_refit_info() before streaming weights")
        return StreamLayout(self.info, self.settings.bucket_bytes)

    def _packer(self, layout: StreamLayout) -> BucketPacker:
        self.version += 1
        return BucketPacker(layout, self._stream(), self.version, self.settings.checksums)

    # ------------------------------------------------------------------ colocated (rings)

    def prepare_weights_for_ipc(self, readers: Mapping[int, int]) -> IpcStream | None:
        """Open a colocated stream (a new version, on every rank).

        Args:
            readers: ``{writer rank: number of readers}`` of the refit plan's rings.

        Returns:
            The :class:`~.ipc.IpcStream` of this rank's ring when it writes one, else None.
        """
        self.finish_weights_ipc()
        layout = self._layout()
        self._open = self._packer(layout)
        self._stream_start = time.perf_counter()
        self._writes = self.rank in readers
        if not self._writes:
            return None
        spec = RingSpec.for_layout(layout, readers[self.rank])
        if self._ring is None or self._ring[1].spec != spec:
            self._close_ring()
            self._ring = create_ring(spec, self.device, f"policy rank {self.rank}")
        self._ring[1].start_writing()
        return IpcStream(
            ring_handle(self._ring[0], spec, f"policy rank {self.rank}"),
            self.version, layout.bucket_bytes, layout.plan(),
        )

    def get_weights_ipc_handles(self, keys: list[str]) -> dict[str, float] | None:
        """Export the next buckets of the open stream, which must carry exactly ``keys`` (the
        names of one or more whole buckets, in plan order), and pack them into this rank's
        ring when it writes one, each once its slot is free.

        Returns:
            A ring writer's timings (s): ``export_s``, ``pack_s``, ``stream_s`` (opening the
            stream to its last bucket packed so far); None on other ranks.

        Raises:
            RefitError: no open stream, ``keys`` are not the next buckets', the export
                disagrees with the refit info, or a reader aborted, died or timed out (the
                export is then consumed to its end first).
        """
        packer = self._open
        if packer is None:
            raise RefitError("no open refit stream: call prepare_weights_for_ipc() first")
        indices = _buckets_of(packer, keys)
        try:
            for index in indices:
                if self._writes:
                    self._pack_into_ring(packer, index)
                else:
                    packer.advance(index)
        except RefitError:
            if self._writes:
                assert self._ring is not None
                self._ring[1].abort(packer.version)
            packer.drain()
            raise
        if not self._writes:
            return None
        return {**packer.timings.as_dict(), "stream_s": time.perf_counter() - self._stream_start}

    def _pack_into_ring(self, packer: BucketPacker, index: int) -> None:
        assert self._ring is not None
        ring = self._ring[1]
        slot = ring.slot_for(index, packer.version, self.settings.timeout_s)
        header = packer.fill(index, slot)
        fault = fault_at("refit.pack", version=packer.version, bucket=index, rank=self.rank)
        if fault == "stop":
            raise RefitError(f"fault injected: the writer stopped before bucket {index}")
        if fault == "corrupt":
            slot[0] ^= 0xFF  # after the checksum was taken
        ring.publish(header)

    def finish_weights_ipc(self) -> None:
        """End the open stream (if any), once the engines are done with it. A CUDA ring is
        freed (colocated training needs the memory back); a shared-memory ring is kept for the
        next refit (fresh shared memory costs a page fault per page)."""
        self._open = None
        self._writes = False
        if self.device.type == "cuda":
            self._close_ring()

    def _close_ring(self) -> None:
        if self._ring is not None:
            self._ring[0].close()
            self._ring = None

    def close(self) -> None:
        """Release everything: the open stream, the ring (unlinked), the send buffers and the
        refit group. Idempotent."""
        self.finish_weights_ipc()
        self._close_ring()
        self._send_buffers = []
        self.close_collective()

    # ------------------------------------------------------------------ collective

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """Global rank 0 joins the refit group as its rank 0 (other ranks: nothing to do)."""
        if self.rank != 0:
            return
        self.close_collective()
        self._collective = RefitCollective(
            ip, port, world_size, 0, self.device, self.settings.timeout_s
        )

    def broadcast_weights_for_collective(self) -> dict[str, float] | None:
        """Stream every bucket over the refit group; rank 0 returns its timings (as
        :meth:`get_weights_ipc_handles`), other ranks None.

        Raises:
            RefitError: no group yet, a broadcast failed, or the export disagrees with the
                refit info.
        """
        if not self.in_first_replica:
            return None
        if self.rank == 0 and self._collective is None:
            raise RefitError("no refit group: call init_collective() first")
        layout = self._layout()
        packer = self._packer(layout)
        start = time.perf_counter()
        if self.rank != 0:
            for index in range(layout.num_buckets):
                packer.advance(index)
            return None
        size = layout.slot_bytes
        if [b.numel() for b in self._send_buffers] != [size, size]:
            self._send_buffers = [
                torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        assert self._collective is not None
        try:
            self._collective.send(packer, self._send_buffers)
        except RefitError:
            packer.drain()
            if self._collective.broken:
                self.close_collective()
            raise
        return {**packer.timings.as_dict(), "stream_s": time.perf_counter() - start}

    def close_collective(self) -> None:
        """Leave the refit group (idempotent)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None


def _buckets_of(packer: BucketPacker, keys: list[str]) -> range:
    """The buckets, from the packer's next one, whose names are exactly ``keys``.

    Raises:
        RefitError: ``keys`` are not the names of whole buckets starting at the next one.
    """
    plan = packer.layout.plan()
    first = stop = packer.next_index
    names: list[str] = []
    while stop < len(plan) and len(names) < len(keys):
        names += plan[stop]
        stop += 1
    if list(keys) != names or first == stop:
        raise RefitError(
            f"the stream is at bucket {first} of {len(plan)}, which carries "
            f"{plan[first] if first < len(plan) else 'nothing (the stream is complete)'}; "
            f"{len(keys)} keys starting with {list(keys)[:3]} were requested: request whole "
            "buckets of prepare_weights_for_ipc()'s plan, in order"
        )
    return range(first, stop)
