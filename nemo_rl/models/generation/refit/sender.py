"""Trainer side of a refit: what each policy rank does (the Megatron worker only wires it up).

The export (``megatron_bridge.export_hf_weights``) is collective over a data-parallel replica's
TP/PP ranks, so every rank of replica 0 runs it, in lockstep, bucket by bucket; only global
rank 0 (the *source*) packs and sends. Ranks of other replicas hold the same weights and do
nothing.

Implements :class:`~.interfaces.WeightSender` (the verbs are documented there). Colocated:
``prepare_weights_for_ipc`` opens a stream (a new version; one shared buffer of the stream's
size on the source), each ``get_weights_ipc_handles`` packs the next bucket into its window of
that buffer, publishes its record there and returns its :class:`~.ipc.IpcBucket`
(``stream_weights_ipc`` packs all of them in one call), ``finish_weights_ipc`` ends it once the
engines have committed or aborted (they load straight from the buffer); :meth:`close` unlinks
the buffer. Not colocated: ``broadcast_weights_for_collective`` streams everything over the
:class:`~.collective.RefitCollective` joined with ``init_collective``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from megatron_bridge import dtype_from_name
from nemo_rl.models.generation.refit.buckets import BucketPacker, StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.expert_groups import StackedTensor, group_experts
from nemo_rl.models.generation.refit.interfaces import RefitInfo, RefitSettings
from nemo_rl.models.generation.refit.ipc import (
    BucketRecords,
    IpcBucket,
    IpcBuffer,
    IpcStream,
    create_ipc_buffer,
    stream_buffer_bytes,
    synchronize,
)

# Starts a fresh export of HF tensors in the given dtype (None: the parameters' dtype).
ExportFn = Callable[[torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]


class RefitSender:
    """One policy rank's part in refits (:class:`~.interfaces.WeightSender`).

    Args:
        export: starts a fresh export; called on every exporting rank at once.
        exports: this rank takes part in the export (data-parallel replica 0 of every
            parameter, the experts' included: with expert parallelism the EP ranks of the
            first expert replica).
        is_source: this rank packs and sends (global rank 0; implies ``exports``).
        device: where the send buffers live (the policy's device).
        settings: bucket size, export dtype, timeout and checksums of every refit.
    """

    def __init__(
        self,
        export: ExportFn,
        exports: bool,
        is_source: bool,
        device: torch.device,
        settings: RefitSettings,
    ) -> None:
        if is_source and not exports:
            raise ValueError("the sending rank must take part in the export")
        self._export = export
        self.exports = exports
        self.is_source = is_source
        self.device = device
        self.settings = settings
        self.version = 0  # refits started; the receivers commit this number
        self.info: RefitInfo | None = None
        self._dtype = None if settings.dtype is None else dtype_from_name(settings.dtype)
        self._open: BucketPacker | None = None  # the open IPC stream
        self._ipc_buffer: IpcBuffer | None = None  # the stream's bytes, see finish_weights_ipc
        self._records: BucketRecords | None = None  # the bucket records in _ipc_buffer
        self._send_buffers: list[torch.Tensor] = []  # two buckets, kept, for broadcasts
        self._stream_start = 0.0
        self._stream_end: float | None = None  # when the last bucket was packed
        self._collective: RefitCollective | None = None

    # ------------------------------------------------------------------ refit info

    def prepare_refit_info(self) -> RefitInfo | None:
        """``{hf_name: (shape, dtype)}`` of the exported weights in export order (exporting
        ranks; None elsewhere), in the settings' dtype. Runs one export."""
        if not self.exports:
            return None
        self.info = {name: (tuple(t.shape), t.dtype) for name, t in self._stream()}
        return self.info

    def _stream(self) -> Iterator[tuple[str, torch.Tensor | StackedTensor]]:
        """A fresh export, each MoE layer's experts stacked as vLLM loads them
        (:mod:`~.expert_groups`: 2 tensors per layer instead of 3 per expert)."""
        return group_experts(self._export(self._dtype))

    def _layout(self) -> StreamLayout:
        if self.info is None:
            raise RuntimeError("call prepare_refit_info() before streaming weights")
        return StreamLayout(self.info, self.settings.bucket_bytes)

    def _packer(self, layout: StreamLayout) -> BucketPacker:
        self.version += 1
        return BucketPacker(
            layout, self._stream(), self.version, self.settings.checksums
        )

    # ------------------------------------------------------------------ colocated (IPC)

    def prepare_weights_for_ipc(self) -> IpcStream | None:
        """Open an IPC stream (a new version, every bucket record cleared); the source
        returns its :class:`~.ipc.IpcStream` (plan, buffer handle, version), others None.

        The previous stream is finished first: call this only once every engine has
        committed or aborted it, since its buffer is about to be overwritten.
        """
        self.finish_weights_ipc()
        if not self.exports:
            return None
        layout = self._layout()
        self._open = self._packer(layout)
        self._stream_start = time.perf_counter()
        self._stream_end = None
        if not self.is_source:
            return None
        nbytes = stream_buffer_bytes(layout)
        if self._ipc_buffer is None or self._ipc_buffer.nbytes != nbytes:
            self._close_ipc_buffer()
            self._ipc_buffer = create_ipc_buffer(nbytes, self.device)
        assert self._ipc_buffer.tensor is not None
        self._records = BucketRecords(self._ipc_buffer.tensor, layout)
        self._records.clear()
        return IpcStream(
            layout.plan(), self._ipc_buffer.handle, self.version, layout.bucket_bytes
        )

    def get_weights_ipc_handles(self, keys: list[str]) -> IpcBucket | None:
        """Export and pack the next bucket (which must carry ``keys``) into its window of the
        stream buffer and publish its record; the source returns its :class:`IpcBucket`,
        other ranks None.

        Raises:
            RefitError: no open stream, ``keys`` are not the next bucket's, or the export
                disagrees with the refit info.
        """
        if not self.exports:
            return None
        packer = self._open
        if packer is None or packer.done:
            raise RefitError("no open refit stream: call prepare_weights_for_ipc() first")
        index = packer.next_index
        expected = packer.layout.bucket_names(index)
        if list(keys) != expected:
            raise RefitError(
                f"bucket {index} carries {expected}, but {list(keys)} were requested; request "
                "the buckets of prepare_weights_for_ipc() in order"
            )
        if not self.is_source:
            packer.advance(index)
            return None
        assert self._ipc_buffer is not None and self._ipc_buffer.tensor is not None
        assert self._records is not None
        start, stop = packer.layout.span(index)
        header = packer.fill(index, self._ipc_buffer.tensor[start:stop])
        synchronize(self.device)
        self._records.publish(header)
        if packer.done:
            self._stream_end = time.perf_counter()
        return IpcBucket(header, self._ipc_buffer.handle)

    def stream_weights_ipc(self) -> None:
        """Export and pack every remaining bucket of the open stream, publishing each one's
        record as it is packed (engines given the :class:`~.ipc.IpcStream` poll them): one
        call for the whole stream instead of one :meth:`get_weights_ipc_handles` per bucket.

        Raises:
            RefitError: as :meth:`get_weights_ipc_handles`.
        """
        if not self.exports:
            return
        if self._open is None:
            raise RefitError("no open refit stream: call prepare_weights_for_ipc() first")
        for keys in self._open.layout.plan()[self._open.next_index :]:
            self.get_weights_ipc_handles(keys)

    def finish_weights_ipc(self) -> dict[str, float] | None:
        """End the open IPC stream (if any) and return the source's timings in seconds
        (``export_s``, ``pack_s``, ``stream_s``: opening to the last bucket packed).

        Call it once the engines have committed or aborted the stream. On CPU the buffer
        stays for the next refit (fresh shared memory costs a page fault per page); a CUDA
        buffer is released, as colocated training needs the memory back.
        """
        packer, self._open = self._open, None
        if self.device.type == "cuda":
            self._close_ipc_buffer()
        if packer is None or not self.is_source:
            return None
        end = time.perf_counter() if self._stream_end is None else self._stream_end
        return {**packer.timings.as_dict(), "stream_s": end - self._stream_start}

    def _close_ipc_buffer(self) -> None:
        self._records = None
        if self._ipc_buffer is not None:
            self._ipc_buffer.close()
            self._ipc_buffer = None

    def close(self) -> None:
        """Release everything: the open stream, the IPC buffer (unlinked), the send
        buffers and the refit group. Idempotent."""
        self.finish_weights_ipc()
        self._close_ipc_buffer()
        self._send_buffers = []
        self.close_collective()

    # ------------------------------------------------------------------ collective

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        """The source joins the refit group as rank 0 (other ranks: nothing to do)."""
        if not self.is_source:
            return
        self.close_collective()
        self._collective = RefitCollective(
            ip, port, world_size, 0, self.device, self.settings.timeout_s
        )

    def broadcast_weights_for_collective(self) -> dict[str, float] | None:
        """Stream every bucket over the refit group; the source returns its timings (as
        :meth:`finish_weights_ipc`), other ranks None.

        Raises:
            RefitError: no group yet, a broadcast failed, or the export disagrees with the
                refit info.
        """
        if not self.exports:
            return None
        if self.is_source and self._collective is None:
            raise RefitError("no refit group: call init_collective() first")
        layout = self._layout()
        packer = self._packer(layout)
        start = time.perf_counter()
        if not self.is_source:
            for index in range(layout.num_buckets):
                packer.advance(index)
            return None
        size = min(layout.bucket_bytes, layout.total_bytes)
        if [b.numel() for b in self._send_buffers] != [size, size]:
            self._send_buffers = [
                torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        assert self._collective is not None
        try:
            self._collective.send(packer, self._send_buffers)
        except RefitError:
            if self._collective.broken:
                self.close_collective()
            raise
        return {**packer.timings.as_dict(), "stream_s": time.perf_counter() - start}

    def close_collective(self) -> None:
        """Leave the refit group (idempotent)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None
