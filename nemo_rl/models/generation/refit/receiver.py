"""Engine side of a refit: stage the whole stream, check it, then load it in one go.

Nothing reaches the engine until every bucket has arrived and passed its checks (order,
version, sizes, manifest against the refit info, checksum): :meth:`RefitReceiver.commit` then
hands all tensors to the engine's loader and only then takes the new version. A refit that
fails before that (a missing or corrupt bucket, a sender that died, a stream that disagrees
with the refit info) is discarded and leaves the engine on its previous weights and version.

Staging is one flat buffer of the stream's size (the model's bytes in the export dtype). On
CPU it is kept between refits (no page faults on the next one); on GPU it is freed after each
refit, since colocated training needs that memory back. The sender's two shared buffers stay
mapped between refits too; :meth:`RefitReceiver.close` releases all of it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch

from nemo_rl.models.generation.refit.buckets import RefitInfo, StagingArea, StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.ipc import IpcBuffer, IpcBucket, attach_ipc_buffer, synchronize

logger = logging.getLogger(__name__)

# Loads every (hf_name, tensor) of a refit into the engine; the tensors are views of staging.
LoadFn = Callable[[Iterator[tuple[str, torch.Tensor]]], None]

# Checkpoint tensors an engine recomputes instead of loading (absent from the export).
_NOT_EXPORTED_SUFFIXES = (".rotary_emb.inv_freq",)


class RefitReceiver:
    """One generation engine's part in refits.

    Args:
        load_weights: loads a complete set of HF-named tensors into the engine.
        device: where staging lives (the engine's device).
        expected_shapes: ``{hf_name: shape}`` of the checkpoint the engine was built from;
            the refit info must name the same tensors with the same shapes. None skips
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
        self.expected_shapes = expected_shapes
        self.version = 0  # version of the weights the engine holds (0: its checkpoint)
        self.info: RefitInfo | None = None
        self._layouts: dict[int, StreamLayout] = {}
        self._staging: StagingArea | None = None
        self._spare_buffer: torch.Tensor | None = None
        self._attached: OrderedDict[object, IpcBuffer] = OrderedDict()
        self._receive_s = 0.0
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
        self.abort()
        self.info = dict(info)
        self._layouts = {}

    def _layout(self, bucket_bytes: int) -> StreamLayout:
        if self.info is None:
            raise RefitError("no refit info: call prepare_refit_info() before streaming weights")
        if bucket_bytes not in self._layouts:
            self._layouts[bucket_bytes] = StreamLayout(self.info, bucket_bytes)
        return self._layouts[bucket_bytes]

    def _begin(self, bucket_bytes: int) -> StagingArea:
        if self._staging is not None:
            logger.warning("a refit of version %s was abandoned unfinished", self._staging.version)
            self._discard()
        self._staging = StagingArea(self._layout(bucket_bytes), self._spare_buffer, self.device)
        self._receive_s = 0.0
        return self._staging

    # ------------------------------------------------------------------ colocated (IPC)

    def receive_ipc_bucket(self, bucket: IpcBucket) -> None:
        """Stage one bucket from the sender's shared buffer; returning is the
        acknowledgement that the buffer may be refilled.

        Raises:
            RefitError: the bucket is missing its predecessors, out of order, corrupt, or
                disagrees with the refit info; the refit is discarded.
        """
        tick = time.perf_counter()
        header = bucket.header
        try:
            if header.index == 0:
                staging = self._begin(header.bucket_bytes)
            elif self._staging is None:
                raise RefitError(
                    f"bucket {header.index} of refit version {header.version} arrived with no "
                    "refit in progress: an earlier bucket failed or was never sent"
                )
            else:
                staging = self._staging
            buffer = self._attach(bucket)
            assert buffer.tensor is not None
            staging.receive(header, buffer.tensor)
            synchronize(self.device)
        except Exception as err:
            self._discard()
            if isinstance(err, RefitError):
                raise
            raise RefitError(f"receiving bucket {header.index} failed: {err}") from err
        self._receive_s += time.perf_counter() - tick

    def _attach(self, bucket: IpcBucket) -> IpcBuffer:
        """The mapped buffer of ``bucket``; the sender's two buffers stay mapped between
        refits (mapping anew costs a page fault per page), older ones are dropped."""
        key = bucket.buffer
        if key in self._attached:
            self._attached.move_to_end(key)
        else:
            self._attached[key] = attach_ipc_buffer(bucket.buffer)
            while len(self._attached) > 2:
                self._attached.popitem(last=False)[1].close()
        return self._attached[key]

    # ------------------------------------------------------------------ collective

    def init_collective(
        self, ip: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join the refit group as ``rank`` (1..world_size-1)."""
        self.close_collective()
        self._collective = RefitCollective(ip, port, world_size, rank, self.device, timeout_s)

    def receive_collective(self, bucket_bytes: int) -> None:
        """Stage a whole stream broadcast over the refit group.

        Raises:
            RefitError: no group, or the stream failed its checks or broke off; the refit is
                discarded (and the group left, when it broke).
        """
        if self._collective is None:
            raise RefitError("no refit group: call init_collective() first")
        staging = self._begin(bucket_bytes)
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

    def commit(self) -> dict[str, float | int]:
        """Load the staged refit into the engine and take its version.

        Returns:
            ``version`` (the new one), ``receive_s`` (staging, summed over buckets) and
            ``load_s`` (the engine's load), seconds.

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
        return {"version": self.version, "receive_s": self._receive_s, "load_s": load_s}

    def abort(self) -> None:
        """Drop a refit in progress (idempotent); the engine keeps its weights and version."""
        self._discard()

    def close(self) -> None:
        """Release everything: a refit in progress, the mapped sender buffers, the staging
        memory and the refit group. Idempotent."""
        self._discard()
        for buffer in self._attached.values():
            buffer.close()
        self._attached.clear()
        self._spare_buffer = None
        self.close_collective()

    def _discard(self) -> None:
        if self._staging is not None and self.device.type == "cpu":
            self._spare_buffer = self._staging.buffer
        self._staging = None


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
