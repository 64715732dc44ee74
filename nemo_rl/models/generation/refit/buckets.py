"""Cut a stream of HF-named tensors into buckets of whole tensors, pack them, check them.

The stream is laid out once, from the refit info (``{hf_name: (shape, dtype)}`` in export
order): tensors are placed one after another, each at a multiple of :data:`ALIGNMENT` bytes,
into buckets of at most ``bucket_bytes``; a tensor that does not fit in the current bucket
starts the next one, and a tensor larger than ``bucket_bytes`` has a bucket of its own. So a
bucket always holds whole tensors, which an engine can load as soon as the bucket arrives, and
the largest bucket (:attr:`StreamLayout.slot_bytes`: at most ``max(bucket_bytes, largest
tensor)``) sizes the staging slots of :mod:`.ring`.

Each bucket travels with a :class:`BucketHeader`: the refit version, its index and the bucket
count, its length, optionally a 64-bit additive checksum of its bytes, and its manifest (where
each tensor lies in it). Both sides build the same :class:`StreamLayout` from the refit info;
the sender checks every exported tensor against it and the receiver checks every header against
it (:func:`check_header`), so a stream that disagrees with the refit info is refused, not
loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.expert_groups import StackedTensor
from nemo_rl.models.generation.refit.interfaces import RefitInfo

# Byte alignment of every tensor in the stream (and of bucket sizes): covers every dtype's
# element size and keeps staged tensors aligned for vectorised loads.
ALIGNMENT = 64
# CPU packing: bytes one thread copies (and sums) at a time, small enough to stay in cache
# between the copy and the sum; threads per pack, the caller included (the policy process is
# otherwise idle during a refit).
CHUNK_BYTES = 4 * 1024**2
PACK_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))

_MASK64 = (1 << 64) - 1


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def bucket_checksum(data: torch.Tensor) -> int:
    """64-bit additive checksum: the sum of ``data``'s little-endian 8-byte words, mod 2**64.

    Args:
        data: uint8 tensor [nbytes], nbytes a multiple of 8, 8-byte aligned (any device).

    One read at memory speed (torch's sum, on the tensor's device); catches flipped, zeroed,
    stale and truncated bytes; not a cryptographic hash, and blind to 8-byte words swapped in
    place. Runs with torch-function handling off: a plain sum with no device argument, which a
    torch-function mode (the CPU compatibility layer's) would pass through unchanged at the
    cost of a Python call.
    """
    with torch._C.DisableTorchFunction():
        nbytes = data.numel()
        if nbytes % 8:
            raise ValueError(f"checksummed data must be a multiple of 8 bytes, got {nbytes}")
        if nbytes == 0:
            return 0
        # int64 addition wraps in two's complement: the sum mod 2**64 in any order
        return int(data.view(torch.int64).sum().item()) & _MASK64


def copy_pieces(
    dest: torch.Tensor, pieces: list[tuple[int, torch.Tensor]], checksums: bool
) -> int | None:
    """Copy each ``(offset, src)`` piece to ``dest[offset:]``; the :func:`bucket_checksum` of
    ``dest`` when ``checksums`` (bytes between pieces must already be zero), else None.

    On CPU the pieces are cut into :data:`CHUNK_BYTES` chunks that :data:`PACK_THREADS` threads
    (this one and helpers) take in turn, each copying a chunk and summing it while it is in
    cache, with numpy (single-threaded kernels that release the GIL: torch's would each start
    their own OpenMP team, which stalls when other work holds a core). Elsewhere (CUDA) torch
    copies each piece and sums the bucket on the device, one host sync per bucket.

    Args:
        dest: uint8 [n], 8-byte aligned, the bucket.
        pieces: ``offset`` (a multiple of 8) and ``src`` uint8 bytes, in order, not overlapping.
    """
    if dest.device.type != "cpu":
        for offset, src in pieces:
            dest[offset : offset + src.numel()].copy_(src)
        return bucket_checksum(dest) if checksums else None
    out = dest.numpy()
    chunks = iter([
        (offset + lo, src[lo : lo + CHUNK_BYTES].detach().numpy())
        for offset, src in pieces
        for lo in range(0, src.numel(), CHUNK_BYTES)
    ])  # next() on a shared iterator is atomic under the GIL

    def work() -> int:
        total = 0
        for start, chunk in chunks:
            stop = start + chunk.size
            np.copyto(out[start:stop], chunk)
            if checksums:  # the chunk's words, its zero tail up to the next word included
                words = out[start : -(-stop // 8) * 8].view(np.uint64)
                total += int(words.sum(dtype=np.uint64))
        return total

    helpers = [_pack_pool().submit(work) for _ in range(PACK_THREADS - 1)]
    total = work() + sum(h.result() for h in helpers)
    return total & _MASK64 if checksums else None


@functools.cache
def _pack_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max(1, PACK_THREADS - 1), thread_name_prefix="refit-pack")


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in the stream: bucket ``bucket``, bytes ``[offset, offset + nbytes)``
    of it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class BucketHeader:
    """Everything a receiver needs to place and check one bucket.

    Attributes:
        version: refit version the bucket belongs to.
        index: position of the bucket in the stream (0-based).
        num_buckets: buckets in the whole stream.
        nbytes: length of the bucket's payload in bytes (a multiple of :data:`ALIGNMENT`).
        checksum: :func:`bucket_checksum` of the payload; None when the sender does not
            checksum (``policy.refit_checksums: false``, the default).
        manifest: the tensors in the payload, in stream order.
    """

    version: int
    index: int
    num_buckets: int
    nbytes: int
    checksum: int | None
    manifest: tuple[TensorSlot, ...]


class StreamLayout:
    """Byte layout of a refit stream: which bucket each tensor goes in, and where.

    Args:
        info: ``{hf_name: (shape, dtype)}`` in the order the sender exports them.
        bucket_bytes: the most bytes a bucket holds unless a single tensor is larger; a
            positive multiple of :data:`ALIGNMENT`.

    Raises:
        ValueError: empty ``info`` or a bad ``bucket_bytes``.
    """

    def __init__(self, info: RefitInfo, bucket_bytes: int) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or (
            bucket_bytes <= 0 or bucket_bytes % ALIGNMENT
        ):
            raise ValueError(
                f"bucket_bytes={bucket_bytes!r} must be a positive multiple of {ALIGNMENT} "
                f"bytes, e.g. {256 * 1024**2} (256 MiB)"
            )
        if not info:
            raise ValueError("the refit info is empty: the policy exported no tensors")
        self.bucket_bytes = bucket_bytes
        slots: list[TensorSlot] = []
        sizes = [0]  # bytes used in each bucket so far (aligned)
        for name, (shape, dtype) in info.items():
            shape = tuple(int(d) for d in shape)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if sizes[-1] and sizes[-1] + nbytes > bucket_bytes:
                sizes.append(0)  # does not fit: the next bucket
            slots.append(TensorSlot(name, shape, dtype, len(sizes) - 1, sizes[-1], nbytes))
            sizes[-1] = _align(sizes[-1] + nbytes)
        self.slots: tuple[TensorSlot, ...] = tuple(slots)
        # an empty tensor still needs its bucket to exist: at least the alignment unit
        self.bucket_sizes: tuple[int, ...] = tuple(max(s, ALIGNMENT) for s in sizes)
        self.num_buckets: int = len(sizes)
        self.total_bytes: int = sum(self.bucket_sizes)
        self._manifests: list[tuple[TensorSlot, ...]] = [() for _ in sizes]
        for slot in slots:
            self._manifests[slot.bucket] += (slot,)

    @property
    def slot_bytes(self) -> int:
        """Bytes of the largest bucket: what one staging slot must hold."""
        return max(self.bucket_sizes)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_buckets:
            raise IndexError(f"bucket {index} outside [0, {self.num_buckets})")

    def manifest(self, index: int) -> tuple[TensorSlot, ...]:
        """The tensors of bucket ``index``, in stream order."""
        self._check_index(index)
        return self._manifests[index]

    def plan(self) -> list[list[str]]:
        """Per bucket, the names of the tensors it carries."""
        return [[s.name for s in m] for m in self._manifests]

    def tensors(self, index: int, payload: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view into payload)`` of every tensor of bucket ``index``, stream order.

        Args:
            payload: uint8 [>= ``bucket_sizes[index]``], the bucket's bytes.
        """
        for s in self.manifest(index):
            yield s.name, payload[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)


def check_header(layout: StreamLayout, header: BucketHeader, index: int, version: int) -> None:
    """Refuse a bucket header that is not bucket ``index`` of refit ``version`` as
    ``layout`` (the receiver's refit info) has it.

    Raises:
        RefitError: out of order, another version, another bucket count, size or manifest.
    """
    if header.index != index:
        raise RefitError(
            f"bucket {header.index} arrived where bucket {index} was expected: a bucket is "
            "missing or out of order"
        )
    if header.version != version:
        raise RefitError(
            f"bucket {index} belongs to refit version {header.version}, the stream to version "
            f"{version}"
        )
    if header.num_buckets != layout.num_buckets:
        raise RefitError(
            f"the sender streams {header.num_buckets} buckets, the refit info gives "
            f"{layout.num_buckets}: both sides need the same refit info and bucket size"
        )
    if header.nbytes != layout.bucket_sizes[index]:
        raise RefitError(
            f"bucket {index} has {header.nbytes} bytes, the refit info gives "
            f"{layout.bucket_sizes[index]}"
        )
    mine = layout.manifest(index)
    if header.manifest != mine:
        raise RefitError(
            f"bucket {index} disagrees with the refit info: "
            f"{_first_difference(header.manifest, mine)}"
        )


def verify_payload(header: BucketHeader, payload: torch.Tensor) -> None:
    """Check ``payload`` (uint8 [header.nbytes], the bucket's bytes where they landed) against
    the sender's checksum: one read. A header without a checksum passes.

    Raises:
        RefitError: the checksum differs (the bucket was corrupted on its way).
    """
    if header.checksum is None:
        return
    checksum = bucket_checksum(payload[: header.nbytes])
    if checksum != header.checksum:
        raise RefitError(
            f"bucket {header.index} of refit version {header.version} is corrupt: its "
            f"checksum is {checksum:#018x}, the sender's {header.checksum:#018x}"
        )


def _first_difference(got: tuple[TensorSlot, ...], want: tuple[TensorSlot, ...]) -> str:
    for g, w in zip(got, want):
        if g != w:
            return (
                f"the sender has {g.name!r} {g.shape} {g.dtype} at byte {g.offset} where the "
                f"refit info has {w.name!r} {w.shape} {w.dtype} at byte {w.offset}"
            )
    return f"the sender lists {len(got)} tensors, the refit info {len(want)}"


@dataclasses.dataclass
class PackTimings:
    """Seconds the sender spent, summed over buckets: waiting for the export to yield
    tensors (``export_s``), copying them into buckets and checksumming them (``pack_s``)."""

    export_s: float = 0.0
    pack_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# A tensor's bytes as ``(offset in the tensor, flat uint8 bytes)`` runs, in order.
ByteRuns = tuple[tuple[int, torch.Tensor], ...]


def byte_runs(tensor: torch.Tensor | StackedTensor) -> ByteRuns:
    """The bytes of an exported tensor: one run, or one per part of a :class:`StackedTensor`
    (the parts are copied straight into the bucket, never stacked in memory first).

    Raises:
        RefitError: a part but the last is not a whole number of 8-byte words (the bucket
            checksum sums 8-byte words at 8-byte aligned offsets).
    """
    parts = tensor.parts if isinstance(tensor, StackedTensor) else (tensor,)
    runs, offset = [], 0
    for part in parts:
        flat = part.contiguous().reshape(-1).view(torch.uint8)
        runs.append((offset, flat))
        offset += flat.numel()
    if any(flat.numel() % 8 for _, flat in runs[:-1]):
        raise RefitError(
            f"a stacked tensor's parts must be multiples of 8 bytes, got "
            f"{[flat.numel() for _, flat in runs]}"
        )
    return tuple(runs)


class BucketPacker:
    """Sender side: fills buckets, in order, from the exported ``(name, tensor)`` stream.

    Args:
        layout: the stream layout (from the same refit info the receiver got).
        stream: the exported tensors, in layout order (e.g. ``export_hf_weights(...)``, its
            experts stacked by :func:`~.expert_groups.group_experts`).
        version: refit version stamped on every header.
        checksums: stamp every header with the bucket's :func:`bucket_checksum` (else None).
    """

    def __init__(
        self,
        layout: StreamLayout,
        stream: Iterable[tuple[str, torch.Tensor | StackedTensor]],
        version: int,
        checksums: bool = True,
    ) -> None:
        self.layout = layout
        self.version = version
        self.checksums = checksums
        self.timings = PackTimings()
        self._iter = iter(stream)
        self._next_index = 0

    @property
    def next_index(self) -> int:
        """The bucket the next :meth:`fill` / :meth:`advance` must ask for."""
        return self._next_index

    @property
    def done(self) -> bool:
        """Every bucket has been filled (or advanced over)."""
        return self._next_index == self.layout.num_buckets

    def _check_order(self, index: int) -> None:
        if index != self._next_index:
            raise RefitError(
                f"bucket {index} requested but the stream is at bucket {self._next_index}; "
                "buckets are filled in order, each once"
            )

    def advance(self, index: int) -> None:
        """Consume (and check) the exported tensors of bucket ``index`` without packing them:
        what a rank that exports but does not pack does, to stay in step with its peers'
        collectives inside the export."""
        self._check_order(index)
        for slot in self.layout.manifest(index):
            self._next_tensor(slot)
        self._finish_bucket()

    def drain(self) -> None:
        """Advance over every bucket not yet filled (a sender that gave up keeps the export's
        collectives in step with its peers). Errors of the export are not raised again."""
        while not self.done:
            try:
                self.advance(self._next_index)
            except RefitError:
                self._next_index = self.layout.num_buckets
                return

    def fill(self, index: int, out: torch.Tensor) -> BucketHeader:
        """Write bucket ``index`` into ``out`` (uint8, >= its size) and describe it.

        Raises:
            RefitError: buckets requested out of order, or the export disagrees with the
                refit info (name, shape or dtype, or the number of tensors).
        """
        self._check_order(index)
        nbytes = self.layout.bucket_sizes[index]
        if out.dtype != torch.uint8 or out.numel() < nbytes:
            raise ValueError(f"bucket {index} needs a uint8 buffer of >= {nbytes} bytes")
        dest = out[:nbytes]
        cursor, pieces = 0, []
        with torch._C.DisableTorchFunction():  # plain byte slicing (see bucket_checksum)
            for slot in self.layout.manifest(index):
                runs = self._next_tensor(slot)
                if slot.offset > cursor:  # padding is zero: checksums are repeatable
                    dest[cursor : slot.offset].zero_()
                cursor = slot.offset + slot.nbytes
                pieces.extend((slot.offset + at, flat) for at, flat in runs)
            if cursor < nbytes:
                dest[cursor:].zero_()
            tick = time.perf_counter()
            checksum = copy_pieces(dest, pieces, self.checksums)
        self.timings.pack_s += time.perf_counter() - tick
        self._finish_bucket()
        return BucketHeader(
            self.version, index, self.layout.num_buckets, nbytes, checksum,
            self.layout.manifest(index),
        )

    def _next_tensor(self, slot: TensorSlot) -> ByteRuns:
        """The bytes of the export's next tensor (:func:`byte_runs`), checked against ``slot``."""
        tick = time.perf_counter()
        item = next(self._iter, None)
        self.timings.export_s += time.perf_counter() - tick
        if item is None:
            raise RefitError(
                f"the export ended before {slot.name!r}; it yields fewer tensors than the "
                "refit info lists (prepare the refit info again after changing the model)"
            )
        name, tensor = item
        if (name, tuple(tensor.shape), tensor.dtype) != (slot.name, slot.shape, slot.dtype):
            raise RefitError(
                f"the export yielded {name!r} {tuple(tensor.shape)} {tensor.dtype} where the "
                f"refit info has {slot.name!r} {slot.shape} {slot.dtype}"
            )
        return byte_runs(tensor)

    def _finish_bucket(self) -> None:
        self._next_index += 1
        if self.done:
            tick = time.perf_counter()
            extra = next(self._iter, None)
            self.timings.export_s += time.perf_counter() - tick
            if extra is not None:
                raise RefitError(
                    f"the export yielded {extra[0]!r} after the last tensor of the refit info; "
                    "prepare the refit info again after changing the model"
                )
