"""Engine side of a refit: check the whole stream where it lies, then load it in one go.

Implements :class:`~.interfaces.WeightReceiver`. Nothing reaches the engine until every
bucket has arrived and passed its checks (order, version, sizes, manifest against the refit
info, checksum when the sender set one): ``commit_weight_update`` then
hands all tensors to the engine's loader and only then takes the new version. A refit that
fails before that (a missing or corrupt bucket, a sender that died, a stream that disagrees
with the refit info) is discarded and leaves the engine on its previous weights and version.

Where the stream lies. Colocated, in the sender's shared buffer of the stream's size: each
bucket is checked in place (one read), as its message arrives
(``update_weights_from_ipc_handles``) or as soon as its record in the buffer says it is
packed (``receive_weights_ipc_stream``, one call for the whole stream), and the
loader gets views of that buffer, so the bytes are copied once, by the sender, before the
engine's own load. The sender writes the buffer
again only in its next stream, which the driver opens after every engine has committed or
aborted this one. Over a broadcast, in a staging buffer of the stream's size owned by the
engine. On CPU the mapping of the sender's buffer and the staging buffer are kept between
refits (no page faults on the next one); on GPU both are dropped after each refit, since
colocated training needs that memory back. :meth:`RefitReceiver.close` releases all of it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from nemo_rl.models.generation.refit.buckets import BucketHeader, StagingArea, StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.expert_groups import group_expert_shapes
from nemo_rl.models.generation.refit.interfaces import RefitInfo, SenderOutcome
from nemo_rl.models.generation.refit.ipc import (
    BucketRecords,
    IpcBucket,
    IpcBuffer,
    IpcHandle,
    IpcStream,
    attach_ipc_buffer,
    require_device_memory,
    synchronize,
)

logger = logging.getLogger(__name__)

# Loads every (hf_name, tensor) of a refit into the engine; the tensors are views of the
# stream buffer (the sender's shared buffer or the engine's staging).
LoadFn = Callable[[Iterator[tuple[str, torch.Tensor]]], None]

# Waiting for a bucket record that is not there yet: in a CUDA buffer the record is read back
# to back for the first _SPIN_S seconds (a GPU packs a bucket in a fraction of a millisecond,
# less than one sleep; in CPU shared memory the sender packs with the same cores, which
# spinning would take from it), then every _POLL_S seconds; the sender's future is
# asked every _OUTCOME_S seconds (a Ray call: a few per second keep the engine's core free
# for the sender).
_SPIN_S = 0.002
_POLL_S = 0.0005
_OUTCOME_S = 0.05

# Checkpoint tensors an engine recomputes instead of loading (absent from the export).
_NOT_EXPORTED_SUFFIXES = (".rotary_emb.inv_freq",)


class RefitReceiver:
    """One generation engine's part in refits (:class:`~.interfaces.WeightReceiver`).

    Args:
        load_weights: loads a complete set of HF-named tensors into the engine.
        device: the engine's device (where broadcast staging is allocated).
        expected_shapes: ``{hf_name: shape}`` of the checkpoint the engine was built from;
            the refit info must name the same tensors with the same shapes, each MoE
            layer's experts stacked (:func:`~.expert_groups.group_expert_shapes`). None skips
            that check.
    """

    def __init__(
        self,
        load_weights: LoadFn,
        device: torch.device,
        expected_shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self._load_weights = load_weights
        self.device = device
        # as the sender streams them: each MoE layer's experts stacked (expert_groups)
        self.expected_shapes = (
            None if expected_shapes is None else group_expert_shapes(expected_shapes)
        )
        self.version = 0  # version of the weights the engine holds (0: its checkpoint)
        self.info: RefitInfo | None = None
        self._layouts: dict[int, StreamLayout] = {}
        self._staging: StagingArea | None = None
        self._staging_buffer: torch.Tensor | None = None  # broadcasts land here (kept on CPU)
        self._attached: tuple[IpcHandle, IpcBuffer] | None = None  # the sender's buffer
        self._receive_s = 0.0
        self._attach_s = 0.0  # mapping the sender's buffer in this refit (0: mapping kept)
        self._collective: RefitCollective | None = None

    # ------------------------------------------------------------------ refit info

    def prepare_refit_info(self, info: RefitInfo) -> None:
        """Accept the sender's ``{hf_name: (shape, dtype)}``.

        Raises:
            RefitError: the info names other tensors, or other shapes, than the engine's
                checkpoint (a refit would leave stale weights or fail half-way).
        """
        if not info:
            raise RefitError("the refit info is empty: the policy exported no tensors")
        if self.expected_shapes is not None:
            _check_against_checkpoint(info, self.expected_shapes)
        self.abort_weight_update()
        self.info = dict(info)
        self._layouts = {}

    def _layout(self, bucket_bytes: int) -> StreamLayout:
        if self.info is None:
            raise RefitError("no refit info: call prepare_refit_info() before streaming weights")
        if bucket_bytes not in self._layouts:
            self._layouts[bucket_bytes] = StreamLayout(self.info, bucket_bytes)
        return self._layouts[bucket_bytes]

    def _begin(self, bucket_bytes: int, buffer: torch.Tensor) -> StagingArea:
        if self._staging is not None:
            logger.warning("a refit of version %s was abandoned unfinished", self._staging.version)
            self._discard()
        self._staging = StagingArea(self._layout(bucket_bytes), buffer)
        self._receive_s = 0.0
        return self._staging

    # ------------------------------------------------------------------ colocated (IPC)

    def update_weights_from_ipc_handles(self, bucket: IpcBucket) -> None:
        """Check one bucket where the sender wrote it, in its shared buffer (no copy).

        Raises:
            RefitError: the bucket is missing its predecessors, out of order, in another
                buffer than the stream's first bucket, corrupt, or disagrees with the refit
                info; the refit is discarded.
        """
        tick = time.perf_counter()
        header = bucket.header
        try:
            if header.index == 0:
                staging = self._begin(header.bucket_bytes, self._attach(bucket.buffer))
            elif self._staging is None:
                raise RefitError(
                    f"bucket {header.index} of refit version {header.version} arrived with no "
                    "refit in progress: an earlier bucket failed or was never sent"
                )
            elif self._attached is None or bucket.buffer != self._attached[0]:
                raise RefitError(
                    f"bucket {header.index} of refit version {header.version} lies in another "
                    "shared buffer than bucket 0: a stream keeps its bytes in one buffer"
                )
            else:
                staging = self._staging
            staging.destination(header)
            synchronize(self.device)
            staging.verify(header)
        except Exception as err:
            self._discard()
            if isinstance(err, RefitError):
                raise
            raise RefitError(f"receiving bucket {header.index} failed: {err}") from err
        self._receive_s += time.perf_counter() - tick

    def receive_weights_ipc_stream(
        self, stream: IpcStream, sender: SenderOutcome | Sequence[Any], timeout_s: float
    ) -> None:
        """Check every bucket of ``stream`` where the sender writes it, as soon as its record
        says it is packed (polled in the shared buffer: no message per bucket).

        Args:
            stream: the stream the sender opened (buffer handle, version, bucket size).
            sender: what became of the sender, asked every :data:`_OUTCOME_S` seconds while a
                bucket is not there yet: a function returning None while it is still packing,
                else a description (e.g. "failed: ..."); or ``[ref]``, the Ray future of its
                packing (in a list, so that Ray hands over the future, not its result).
            timeout_s: seconds any one bucket may take to appear.

        Raises:
            RefitError: a bucket never appeared (the sender failed, died or timed out), is
                corrupt, or disagrees with the refit info; the refit is discarded.
        """
        sender_outcome = sender if callable(sender) else lambda: _task_outcome(sender[0])
        index = 0
        try:
            buffer = self._attach(stream.buffer)
            staging = self._begin(stream.bucket_bytes, buffer)
            records = BucketRecords(buffer, staging.layout)
            for index in range(staging.layout.num_buckets):
                header = _await_record(
                    records, index, sender_outcome, timeout_s,
                    _SPIN_S if buffer.device.type == "cuda" else 0.0,
                )
                tick = time.perf_counter()  # receive_s: checking, not waiting for the sender
                if header.version != stream.version:
                    raise RefitError(
                        f"bucket {index} belongs to refit version {header.version}, the stream "
                        f"opened version {stream.version}"
                    )
                staging.destination(header)
                staging.verify(header)
                self._receive_s += time.perf_counter() - tick
        except Exception as err:
            self._discard()
            if isinstance(err, RefitError):
                raise
            raise RefitError(f"receiving bucket {index} failed: {err}") from err

    def _attach(self, handle: IpcHandle) -> torch.Tensor:
        """The sender's buffer ``handle`` as a uint8 tensor; the mapping is kept (on CPU
        between refits, as mapping anew costs a page fault per page) until the sender
        switches to another buffer."""
        self._attach_s = 0.0
        if self._attached is None or self._attached[0] != handle:
            self._detach()
            tick = time.perf_counter()
            self._attached = (handle, attach_ipc_buffer(handle))
            self._attach_s = time.perf_counter() - tick
        tensor = self._attached[1].tensor
        assert tensor is not None
        return tensor

    def _detach(self) -> None:
        if self._attached is not None:
            self._attached[1].close()
            self._attached = None

    # ------------------------------------------------------------------ collective

    def init_collective(
        self, ip: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join the refit group as ``rank`` (1..world_size-1)."""
        self.close_collective()
        self._collective = RefitCollective(ip, port, world_size, rank, self.device, timeout_s)

    def update_weights_from_collective(self, bucket_bytes: int) -> None:
        """Stage a whole stream broadcast over the refit group.

        Raises:
            RefitError: no group, or the stream failed its checks or broke off; the refit is
                discarded (and the group left, when it broke).
        """
        if self._collective is None:
            raise RefitError("no refit group: call init_collective() first")
        layout = self._layout(bucket_bytes)
        buffer = self._staging_buffer
        if buffer is None or buffer.numel() < layout.total_bytes:
            require_device_memory(layout.total_bytes, self.device, "each generation engine")
            buffer = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            self._staging_buffer = buffer
        staging = self._begin(bucket_bytes, buffer)
        self._attach_s = 0.0  # nothing to map over a broadcast
        tick = time.perf_counter()
        try:
            self._collective.receive(staging)
        except RefitError:
            self._discard()
            if self._collective.broken:
                self.close_collective()
            raise
        self._receive_s = time.perf_counter() - tick

    def close_collective(self) -> None:
        """Leave the refit group (idempotent)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    # ------------------------------------------------------------------ commit / abort

    def commit_weight_update(self) -> dict[str, float | int]:
        """Load the staged refit into the engine and take its version.

        Returns:
            ``version`` (the new one), ``receive_s`` (receiving and checking the buckets,
            summed), ``attach_s`` (mapping the sender's buffer, colocated; 0 when the mapping
            was kept from the previous refit or over a broadcast) and ``load_s`` (the
            engine's load), seconds.

        Raises:
            RefitError: nothing staged, the stream is incomplete (the engine is untouched and
                keeps its version), or the engine's loader failed.
        """
        staging = self._staging
        if staging is None:
            raise RefitError("no staged refit to commit (it failed or was aborted)")
        try:
            tensors = staging.tensors()
        except RefitError:
            self._discard()
            raise
        tick = time.perf_counter()
        try:
            self._load_weights(tensors)
        except Exception as err:
            self._discard()
            raise RefitError(
                f"the engine failed to load refit version {staging.version}; it may hold a "
                f"mix of old and new weights until a refit succeeds: {err}"
            ) from err
        load_s = time.perf_counter() - tick
        assert staging.version is not None
        self.version = staging.version
        self._discard()
        return {"version": self.version, "receive_s": self._receive_s,
                "attach_s": self._attach_s, "load_s": load_s}

    def abort_weight_update(self) -> None:
        """Drop a refit in progress (idempotent); the engine keeps its weights and version."""
        self._discard()

    def close(self) -> None:
        """Release everything: a refit in progress, the mapping of the sender's buffer, the
        staging memory and the refit group. Idempotent."""
        self._discard()
        self._detach()
        self._staging_buffer = None
        self.close_collective()

    def _discard(self) -> None:
        self._staging = None
        if self.device.type == "cuda":  # the sender frees its buffer once no one maps it
            self._detach()


def _task_outcome(ref: Any) -> str | None:
    """None while the Ray task behind ``ref`` runs, else how it ended."""
    import ray

    if not ray.wait([ref], timeout=0)[0]:
        return None
    try:
        ray.get(ref)
    except Exception as err:  # the task's error or its worker's death
        return f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return "finished"


def _await_record(
    records: BucketRecords,
    index: int,
    sender_outcome: SenderOutcome,
    timeout_s: float,
    spin_s: float,
) -> BucketHeader:
    """Bucket ``index``'s header once the sender published it: the record is read back to
    back for ``spin_s`` seconds, then every :data:`_POLL_S` seconds; the sender's outcome
    (a Ray call) every :data:`_OUTCOME_S`.

    Raises:
        RefitError: the sender ended (``sender_outcome``) without publishing it, or
            ``timeout_s`` passed.
    """
    start = last_asked = time.perf_counter()
    while (header := records.read(index)) is None:
        now = time.perf_counter()
        if now - last_asked >= _OUTCOME_S:
            last_asked = now
            outcome = sender_outcome()
            if outcome is not None:
                header = records.read(index)  # published just before the sender ended
                if header is not None:
                    return header
                raise RefitError(f"bucket {index} was never packed: the sender {outcome}")
        if now - start > timeout_s:
            raise RefitError(f"bucket {index} was not packed within {timeout_s:g} s")
        if now - start >= spin_s:
            time.sleep(_POLL_S)
    return header


def _check_against_checkpoint(info: RefitInfo, expected: dict[str, tuple[int, ...]]) -> None:
    missing = [
        n for n in expected if n not in info and not n.endswith(_NOT_EXPORTED_SUFFIXES)
    ]
    unknown = [n for n in info if n not in expected]
    reshaped = [
        f"{n} {tuple(info[n][0])} vs {tuple(expected[n])}"
        for n in info
        if n in expected and tuple(info[n][0]) != tuple(expected[n])
    ]
    problems = []
    if missing:
        problems.append(f"missing from the refit info: {missing[:5]}")
    if unknown:
        problems.append(f"not in the engine's checkpoint: {unknown[:5]}")
    if reshaped:
        problems.append(f"shapes differ (refit vs checkpoint): {reshaped[:5]}")
    if problems:
        raise RefitError(
            "the policy's exported weights do not match the engine's checkpoint ("
            + "; ".join(problems)
            + "); build the engine from the policy's model"
        )
