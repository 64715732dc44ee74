"""Trainer side of a refit: what each policy rank does (the Megatron worker only wires it up).

The export (``megatron_bridge.export_hf_weights``) is collective over a data-parallel replica's
TP/PP ranks, so every rank of replica 0 runs it, in lockstep, bucket by bucket; only global
rank 0 (the *source*) packs and sends. Ranks of other replicas hold the same weights and do
nothing.

Colocated (IPC): :meth:`RefitSender.start_stream` opens a stream (a new version; one shared
buffer of the stream's size on the source), each :meth:`RefitSender.next_bucket` packs the next
bucket into its window of that buffer, publishes its record there and returns its
:class:`~.ipc.IpcBucket` (:meth:`RefitSender.pack_stream` packs all of them in one call),
:meth:`RefitSender.finish_stream` ends it once the engines have committed or aborted (they load
straight from the buffer); :meth:`RefitSender.close` unlinks the buffer. Not colocated:
:meth:`RefitSender.broadcast` streams everything over the :class:`~.collective.RefitCollective`
joined with :meth:`RefitSender.init_collective`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from nemo_rl.models.generation.refit.buckets import BucketPacker, RefitInfo, StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
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
    """One policy rank's part in refits.

    Args:
        export: starts a fresh export; called on every exporting rank at once.
        exports: this rank takes part in the export (data-parallel replica 0).
        is_source: this rank packs and sends (global rank 0; implies ``exports``).
        device: where the send buffers live (the policy's device).
    """

    def __init__(
        self, export: ExportFn, exports: bool, is_source: bool, device: torch.device
    ) -> None:
        if is_source and not exports:
            raise ValueError("the sending rank must take part in the export")
        self._export = export
        self.exports = exports
        self.is_source = is_source
        self.device = device
        self.version = 0  # refits started; the receivers commit this number
        self.info: RefitInfo | None = None
        self._dtype: torch.dtype | None = None
        self._packer: BucketPacker | None = None
        self._ipc_buffer: IpcBuffer | None = None  # the stream's bytes, see finish_stream
        self._records: BucketRecords | None = None  # the bucket records in _ipc_buffer
        self._send_buffers: list[torch.Tensor] = []  # two buckets, kept, for broadcasts
        self._stream_start = 0.0
        self._stream_end: float | None = None  # when the last bucket was packed
        self._collective: RefitCollective | None = None

    # ------------------------------------------------------------------ refit info

    def prepare_refit_info(self, dtype: torch.dtype | None = None) -> RefitInfo | None:
        """``{hf_name: (shape, dtype)}`` of the exported weights in export order (exporting
        ranks; None elsewhere). Runs one export; later refits export in ``dtype`` too."""
        self._dtype = dtype
        if not self.exports:
            return None
        self.info = {name: (tuple(t.shape), t.dtype) for name, t in self._export(dtype)}
        return self.info

    def _layout(self, bucket_bytes: int) -> StreamLayout:
        if self.info is None:
            raise RuntimeError("call prepare_refit_info() before streaming weights")
        return StreamLayout(self.info, bucket_bytes)

    # ------------------------------------------------------------------ colocated (IPC)

    def start_stream(self, bucket_bytes: int) -> IpcStream | None:
        """Open an IPC stream (a new version, every bucket record cleared); the source
        returns its :class:`~.ipc.IpcStream` (plan, buffer handle, version), others None.

        The previous stream is finished first: call this only once every engine has
        committed or aborted it, since its buffer is about to be overwritten.
        """
        self.finish_stream()
        if not self.exports:
            return None
        layout = self._layout(bucket_bytes)
        self.version += 1
        self._packer = BucketPacker(layout, self._export(self._dtype), self.version)
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
        return IpcStream(layout.plan(), self._ipc_buffer.handle, self.version, bucket_bytes)

    def next_bucket(self, keys: list[str]) -> IpcBucket | None:
        """Export and pack the next bucket (which must carry ``keys``) into its window of the
        stream buffer and publish its record; the source returns its :class:`IpcBucket`,
        other ranks None.

        Raises:
            RefitError: no open stream, ``keys`` are not the next bucket's, or the export
                disagrees with the refit info.
        """
        if not self.exports:
            return None
        packer = self._packer
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

    def pack_stream(self) -> None:
        """Export and pack every remaining bucket of the open stream, publishing each one's
        record as it is packed (engines given the :class:`~.ipc.IpcStream` poll them): one
        call for the whole stream instead of one :meth:`next_bucket` per bucket.

        Raises:
            RefitError: as :meth:`next_bucket`.
        """
        if not self.exports:
            return
        if self._packer is None:
            raise RefitError("no open refit stream: call prepare_weights_for_ipc() first")
        for keys in self._packer.layout.plan()[self._packer.next_index :]:
            self.next_bucket(keys)

    def finish_stream(self) -> dict[str, float] | None:
        """End the open IPC stream (if any) and return the source's timings in seconds
        (``export_s``, ``pack_s``, ``stream_s``: opening to the last bucket packed).

        Call it once the engines have committed or aborted the stream. On CPU the buffer
        stays for the next refit (fresh shared memory costs a page fault per page); a CUDA
        buffer is released, as colocated training needs the memory back.
        """
        packer, self._packer = self._packer, None
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
        self.finish_stream()
        self._close_ipc_buffer()
        self._send_buffers = []
        self.close_collective()

    # ------------------------------------------------------------------ collective

    def init_collective(self, ip: str, port: int, world_size: int, timeout_s: float) -> None:
        """The source joins the refit group as rank 0 (other ranks: nothing to do)."""
        if not self.is_source:
            return
        self.close_collective()
        self._collective = RefitCollective(ip, port, world_size, 0, self.device, timeout_s)

    def broadcast(self, bucket_bytes: int) -> dict[str, float] | None:
        """Stream every bucket over the refit group; the source returns its timings (as
        :meth:`finish_stream`), other ranks None.

        Raises:
            RefitError: no group yet, a broadcast failed, or the export disagrees with the
                refit info.
        """
        if not self.exports:
            return None
        if self.is_source and self._collective is None:
            raise RefitError("no refit group: call init_collective() first")
        layout = self._layout(bucket_bytes)
        self.version += 1
        packer = BucketPacker(layout, self._export(self._dtype), self.version)
        start = time.perf_counter()
        if not self.is_source:
            for index in range(layout.num_buckets):
                packer.advance(index)
            return None
        size = min(bucket_bytes, layout.total_bytes)
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
