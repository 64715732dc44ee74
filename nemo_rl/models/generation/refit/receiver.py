"""Engine side of a refit: load a stream from a ring of the engine's node as it arrives.

Implements :class:`~.interfaces.WeightReceiver` in the actor that holds a vLLM engine. Every
rank process of the engine reads its ring (:mod:`.ring`) and loads each bucket's tensors into
its model as soon as the bucket is there and has passed its checks (order, version, size,
manifest against the refit info, checksum when the sender set one); its loaders copy the part
they keep (a tensor-parallel rank: its shard), then the bucket's slot is released for the
next one. Colocated, the ring is the one a policy rank of the engine's node (GPU: of its
device) writes (``update_weights_from_ipc_handles``); over a broadcast, the engine's own ring,
which a thread of this actor fills from the refit group (``update_weights_from_collective``).

Atomic by version. Weights arrive bucket by bucket, so an engine whose load broke off holds a
mix of two versions: it records that (:attr:`RefitReceiver.incomplete`) and refuses to
generate (:meth:`RefitReceiver.require_complete`) until a later refit loads in full; only a
complete load takes the stream's version (:attr:`RefitReceiver.version`). A load that failed
before any tensor reached the engine leaves it on its previous version, still usable.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nemo_rl.models.generation.refit.buckets import StreamLayout
from nemo_rl.models.generation.refit.collective import RefitCollective
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.expert_groups import group_expert_shapes
from nemo_rl.models.generation.refit.interfaces import RefitInfo
from nemo_rl.models.generation.refit.ipc import (
    IpcBuffer,
    IpcStream,
    RingRead,
    create_ring,
    current_node_id,
    ring_handle,
)
from nemo_rl.models.generation.refit.ring import Ring, RingSpec

logger = logging.getLogger(__name__)

# What one rank's load reports: ``path`` ("in_place" or "reload"), ``tensors`` (handed to
# its loaders), ``wait_s`` (waiting for buckets), ``error`` (None, or why it broke off).
LoadReport = dict[str, Any]
# Loads a stream into every rank of the engine: for each rank, the ring it reads and its
# reader index; the refit info and bucket size (the layout); the version; the seconds a bucket
# may take. One report per rank.
LoadStreamFn = Callable[[list[RingRead], RefitInfo, int, int, float], list[LoadReport]]

# Checkpoint tensors an engine recomputes instead of loading (absent from the export).
_NOT_EXPORTED_SUFFIXES = (".rotary_emb.inv_freq",)


class RefitReceiver:
    """One generation engine's part in refits (:class:`~.interfaces.WeightReceiver`).

    Args:
        load_stream: loads a stream from rings into every rank of the engine.
        device: the engine's first device (where its own broadcast ring lives).
        tensor_parallel_size: the engine's ranks (readers of its broadcast ring).
        expected_shapes: ``{hf_name: shape}`` of the checkpoint the engine was built from;
            the refit info must name the same tensors with the same shapes, each MoE
            layer's experts stacked (:func:`~.expert_groups.group_expert_shapes`). None skips
            that check.
        adapters: the streams carry LoRA adapters instead of weights (PEFT's
            ``<module>.lora_A.weight`` ``[r, in]`` and ``<module>.lora_B.weight``
            ``[out, r]``); each is checked against the checkpoint's ``<module>.weight``.
    """

    def __init__(
        self,
        load_stream: LoadStreamFn,
        device: torch.device,
        tensor_parallel_size: int = 1,
        expected_shapes: dict[str, tuple[int, ...]] | None = None,
        adapters: bool = False,
    ) -> None:
        self._load_stream = load_stream
        self.device = device
        self.tensor_parallel_size = tensor_parallel_size
        self.expected_shapes = (
            None if expected_shapes is None else group_expert_shapes(expected_shapes)
        )
        self.adapters = adapters
        self.version = 0  # version of the weights the engine holds in full (0: its checkpoint)
        self.incomplete: int | None = None  # version of a load that broke off part-way
        self.info: RefitInfo | None = None
        self._ring: tuple[IpcBuffer, Ring] | None = None  # the broadcast ring (kept on CPU)
        self._collective: RefitCollective | None = None

    # ------------------------------------------------------------------ refit info

    def prepare_refit_info(self, info: RefitInfo) -> None:
        """Accept the sender's ``{hf_name: (shape, dtype)}``.

        Raises:
            RefitError: the info names other tensors, or other shapes, than the engine's
                checkpoint (a refit would leave stale weights or fail half-way); with
                ``adapters``, an adapter of a linear the checkpoint lacks or of another shape.
        """
        if not info:
            raise RefitError("the refit info is empty: the policy exported no tensors")
        if self.expected_shapes is not None:
            check = _check_adapters_against_checkpoint if self.adapters else _check_against_checkpoint
            check(info, self.expected_shapes)
        self.info = dict(info)

    def _layout(self, bucket_bytes: int) -> StreamLayout:
        if self.info is None:
            raise RefitError("no refit info: call prepare_refit_info() before streaming weights")
        return StreamLayout(self.info, bucket_bytes)

    def require_complete(self) -> None:
        """Refuse to serve while the engine holds the weights of a load that broke off.

        Raises:
            RefitError: the last refit stopped part-way through loading.
        """
        if self.incomplete is not None:
            raise RefitError(
                f"the engine holds a mix of weight versions {self.version} and "
                f"{self.incomplete} (a refit broke off while loading); it generates again "
                "once a refit completes"
            )

    # ------------------------------------------------------------------ loading

    def _load(self, reads: list[RingRead], bucket_bytes: int, version: int,
              timeout_s: float) -> dict[str, Any]:
        """Load stream ``version`` from ``reads`` (one per rank) into the engine; its
        version on success, :attr:`incomplete` when a rank's load broke off part-way.

        Raises:
            RefitError: a rank's load failed (naming the rank and why).
        """
        if len(reads) != self.tensor_parallel_size:
            raise RefitError(
                f"{len(reads)} ring reads for an engine of {self.tensor_parallel_size} ranks"
            )
        assert self.info is not None
        tick = time.perf_counter()
        try:
            reports = self._load_stream(reads, self.info, bucket_bytes, version, timeout_s)
        except Exception as err:  # the ranks themselves failed (their processes died)
            self.incomplete = version
            raise RefitError(f"loading refit version {version} failed: {err}") from err
        failed = [(t, r) for t, r in enumerate(reports) if r.get("error")]
        if failed:
            if any(r.get("tensors", 0) for r in reports):
                self.incomplete = version
            raise RefitError(
                "; ".join(f"rank {t} of the engine: {r['error']}" for t, r in failed)
            )
        self.version = version
        self.incomplete = None
        paths = {r["path"] for r in reports}
        return {
            "version": version,
            "load_s": time.perf_counter() - tick,
            "wait_s": max(float(r["wait_s"]) for r in reports),
            "path": paths.pop() if len(paths) == 1 else sorted(paths),
            "node": current_node_id(),
            "rings": [(read.ring.writer, read.ring.node_id) for read in reads],
        }

    # ------------------------------------------------------------------ colocated

    def update_weights_from_ipc_handles(
        self, streams: Sequence[tuple[IpcStream, int]], timeout_s: float
    ) -> dict[str, Any]:
        """Load a colocated stream: rank ``t`` of the engine reads ``streams[t]`` (the stream
        of the ring of its node or device, and its reader index in that ring).

        Returns:
            ``version``, ``load_s`` (the whole load), ``wait_s`` (of it, waiting for buckets;
            slowest rank), ``path`` (how the engine loaded: "in_place" or "reload"),
            ``node`` (this engine's node) and ``rings`` (writer and node of each rank's ring).

        Raises:
            RefitError: the streams disagree on the version, a ring lives on another node, or
                the load failed (see :meth:`require_complete`).
        """
        versions = {stream.version for stream, _ in streams}
        sizes = {stream.bucket_bytes for stream, _ in streams}
        if len(versions) != 1 or len(sizes) != 1:
            raise RefitError(
                f"the engine's rings carry versions {sorted(versions)} with bucket sizes "
                f"{sorted(sizes)}: one stream has one version and bucket size"
            )
        here = current_node_id()
        for stream, _ in streams:
            if stream.ring.node_id is not None and here is not None and stream.ring.node_id != here:
                raise RefitError(
                    f"the engine on node {here} was given the ring of {stream.ring.writer} on "
                    f"node {stream.ring.node_id}: an engine only reads rings of its own node"
                )
        reads = [RingRead(stream.ring, reader) for stream, reader in streams]
        return self._load(reads, sizes.pop(), versions.pop(), timeout_s)

    # ------------------------------------------------------------------ collective

    def init_collective(
        self, ip: str, port: int, world_size: int, rank: int, timeout_s: float
    ) -> None:
        """Join the refit group as ``rank`` (1..world_size-1)."""
        self.close_collective()
        self._collective = RefitCollective(ip, port, world_size, rank, self.device, timeout_s)

    def update_weights_from_collective(self, bucket_bytes: int, timeout_s: float) -> dict[str, Any]:
        """Receive a broadcast stream into the engine's own ring (a thread of this actor) and
        load it from there (the engine's ranks) as it arrives; returns as
        :meth:`update_weights_from_ipc_handles`.

        Raises:
            RefitError: no group, the stream failed its checks or broke off (the group is
                left when it broke), or the load failed.
        """
        if self._collective is None:
            raise RefitError("no refit group: call init_collective() first")
        collective = self._collective
        layout = self._layout(bucket_bytes)
        ring = self._broadcast_ring(RingSpec.for_layout(layout, self.tensor_parallel_size))
        started: queue.Queue[int | BaseException] = queue.Queue()
        errors: list[RefitError] = []

        def receive() -> None:
            try:
                collective.receive(layout, ring[1], started.put, timeout_s)
            except RefitError as err:
                errors.append(err)
                started.put(err)  # a failure before the first header: nothing to load

        thread = threading.Thread(target=receive, name="refit-receive", daemon=True)
        thread.start()
        try:
            first = started.get(timeout=timeout_s)
            if isinstance(first, BaseException):
                raise first
            handle = ring_handle(ring[0], ring[1].spec, "this engine's broadcast receiver")
            reads = [RingRead(handle, t) for t in range(self.tensor_parallel_size)]
            try:
                result = self._load(reads, bucket_bytes, first, timeout_s)
            except RefitError as err:
                ring[1].abort(first)  # the receiver stops filling the ring
                raise err
        except queue.Empty:
            raise RefitError(f"no refit stream arrived within {timeout_s:g} s") from None
        finally:
            thread.join()
            if collective.broken:
                self.close_collective()
            if self.device.type == "cuda":
                self._close_ring()
        if errors:
            raise errors[0]
        return result

    def _broadcast_ring(self, spec: RingSpec) -> tuple[IpcBuffer, Ring]:
        if self._ring is None or self._ring[1].spec != spec:
            self._close_ring()
            self._ring = create_ring(spec, self.device, "this engine's broadcast receiver")
        self._ring[1].start_writing()
        return self._ring

    def _close_ring(self) -> None:
        if self._ring is not None:
            self._ring[0].close()
            self._ring = None

    def close_collective(self) -> None:
        """Leave the refit group (idempotent)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None

    def close(self) -> None:
        """Release the ring and the refit group. Idempotent."""
        self._close_ring()
        self.close_collective()


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


# An adapter's tensor and the weight it adapts have the same size along this axis (A: the
# input, B: the output).
_SHARED_AXIS = {".lora_A.weight": 1, ".lora_B.weight": 0}
_ADAPTER_SUFFIXES = tuple(_SHARED_AXIS)


def _check_adapters_against_checkpoint(
    info: RefitInfo, expected: dict[str, tuple[int, ...]]
) -> None:
    """Every tensor of ``info`` is an adapter (``<module>.lora_A.weight`` ``[r, in]`` or
    ``<module>.lora_B.weight`` ``[out, r]``) of a 2-D ``<module>.weight`` ``[out, in]`` of the
    checkpoint."""
    problems = []
    for name, (shape, _) in info.items():
        suffix = next((s for s in _ADAPTER_SUFFIXES if name.endswith(s)), None)
        weight = None if suffix is None else expected.get(name.removesuffix(suffix) + ".weight")
        if suffix is None or weight is None or len(weight) != 2 or len(shape) != 2:
            problems.append(f"{name} {tuple(shape)} adapts no linear weight of the checkpoint")
        elif shape[_SHARED_AXIS[suffix]] != weight[_SHARED_AXIS[suffix]]:
            problems.append(f"{name} {tuple(shape)} does not fit its weight {tuple(weight)}")
    if problems:
        raise RefitError(
            "the policy's adapters do not match the engine's checkpoint ("
            + "; ".join(problems[:5])
            + "); build the engine from the policy's base model"
        )
