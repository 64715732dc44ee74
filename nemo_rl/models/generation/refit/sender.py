"""Trainer side of a refit: what each policy rank does (the Megatron worker only wires it up).

The export (``megatron_bridge.export_hf_weights``) is collective over a data-parallel replica's
TP/PP ranks, so every rank of replica 0 runs it, in lockstep, bucket by bucket; only global
rank 0 (the *source*) packs and sends. Ranks of other replicas hold the same weights and do
nothing.

Colocated (IPC): :meth:`RefitSender.start_stream` opens a stream (a new version; two buffers on
the source, made once and reused by later refits), each :meth:`RefitSender.next_bucket` packs
the next bucket into buffer ``k % 2`` and returns its :class:`~.ipc.IpcBucket`,
:meth:`RefitSender.finish_stream` ends it; :meth:`RefitSender.close` unlinks the buffers. Not
colocated: :meth:`RefitSender.broadcast` streams everything over the
:class:`~.collective.RefitCollective` joined with :meth:`RefitSender.init_collective`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from nemo_rl.models.generation.refit.buckets import BucketPacker, RefitInfo, StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.ipc import IpcBuffer, IpcBucket, create_ipc_buffer, synchronize

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
        self._ipc_buffers: list[IpcBuffer] = []  # kept between refits, see finish_stream
        self._send_buffers: list[torch.Tensor] = []  # the same for broadcasts
        self._stream_start = 0.0
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

    def start_stream(self, bucket_bytes: int) -> list[list[str]] | None:
        """Open an IPC stream; returns the names per bucket on the source (None elsewhere).

        An unfinished earlier stream is closed first.
        """
        self.finish_stream()
        if not self.exports:
            return None
        layout = self._layout(bucket_bytes)
        self.version += 1
        self._packer = BucketPacker(layout, self._export(self._dtype), self.version)
        self._stream_start = time.perf_counter()
        if not self.is_source:
            return None
        size = min(bucket_bytes, layout.total_bytes)
        if [b.nbytes for b in self._ipc_buffers] != [size, size]:
            self._close_ipc_buffers()
            self._ipc_buffers = [create_ipc_buffer(size, self.device) for _ in range(2)]
        return layout.plan()

    def next_bucket(self, keys: list[str]) -> IpcBucket | None:
        """Export and pack the next bucket (which must carry ``keys``); the source returns
        its :class:`IpcBucket`, other ranks None.

        The caller must not request bucket ``k + 2`` before every receiver has acknowledged
        bucket ``k``: both use the same buffer.

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
        buffer = self._ipc_buffers[index % 2]
        assert buffer.tensor is not None
        header = packer.fill(index, buffer.tensor)
        synchronize(self.device)
        return IpcBucket(header, buffer.handle)

    def finish_stream(self) -> dict[str, float] | None:
        """End the open IPC stream (if any) and return the source's timings in seconds
        (``export_s``, ``pack_s``, ``stream_s``). The two buffers stay for the next refit
        (fresh shared memory costs a page fault per page); :meth:`close` releases them."""
        packer, self._packer = self._packer, None
        if packer is None or not self.is_source:
            return None
        return {**packer.timings.as_dict(), "stream_s": time.perf_counter() - self._stream_start}

    def _close_ipc_buffers(self) -> None:
        for buffer in self._ipc_buffers:
            buffer.close()
        self._ipc_buffers = []

    def close(self) -> None:
        """Release everything: the open stream, the IPC buffers (unlinked), the send
        buffers and the refit group. Idempotent."""
        self.finish_stream()
        self._close_ipc_buffers()
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
