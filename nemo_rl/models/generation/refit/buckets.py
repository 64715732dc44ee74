"""Pack a stream of HF-named tensors into fixed-size byte buckets and check them in place.

The stream is laid out once, from the refit info (``{hf_name: (shape, dtype)}`` in export
order): every tensor gets a byte range of one flat stream starting at a multiple of
:data:`ALIGNMENT` bytes, and the stream ends padded to that multiple. Bucket ``k`` is the window
``[k * bucket_bytes, min((k + 1) * bucket_bytes, total_bytes))`` of the stream, so a tensor
larger than a bucket simply spans consecutive buckets. The receiver checks each bucket in its
window of one flat buffer of the stream's size (the sender's shared buffer itself when
colocated, its own staging memory when the bytes come over a broadcast); once all have passed,
every tensor is a view of that buffer.

Each bucket travels with a :class:`BucketHeader`: the refit version, its index and the bucket
count, its length, optionally a 64-bit additive checksum of its bytes, and its manifest (which byte range
of which tensor sits where in it). Both sides build the same :class:`StreamLayout` from the
refit info; the sender checks every exported tensor against it and the receiver checks every
header against it, so a stream that disagrees with the refit info is refused, not loaded.
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
    """One tensor's place in the flat stream (``offset``, ``nbytes`` in bytes)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ManifestEntry:
    """Bytes ``[tensor_offset, tensor_offset + length)`` of tensor ``name`` lie at
    ``[bucket_offset, bucket_offset + length)`` of a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket_offset: int
    tensor_offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class BucketHeader:
    """Everything a receiver needs to place and check one bucket.

    Attributes:
        version: refit version the bucket belongs to.
        index: position of the bucket in the stream (0-based).
        num_buckets: buckets in the whole stream.
        bucket_bytes: the stream's bucket size (every bucket but the last is this long).
        nbytes: length of the bucket's payload in bytes.
        checksum: :func:`bucket_checksum` of the payload; None when the sender does not
            checksum (``policy.refit_checksums: false``, the default).
        manifest: the tensor pieces in the payload, in stream order.
    """

    version: int
    index: int
    num_buckets: int
    bucket_bytes: int
    nbytes: int
    checksum: int | None
    manifest: tuple[ManifestEntry, ...]


class StreamLayout:
    """Byte layout of a refit stream and its cut into buckets.

    Args:
        info: ``{hf_name: (shape, dtype)}`` in the order the sender exports them.
        bucket_bytes: bucket size in bytes; a positive multiple of :data:`ALIGNMENT`.

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
        slots, offset = [], 0
        for name, (shape, dtype) in info.items():
            shape = tuple(int(d) for d in shape)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            slots.append(TensorSlot(name, shape, dtype, offset, nbytes))
            offset = _align(offset + nbytes)
        self.slots: tuple[TensorSlot, ...] = tuple(slots)
        self.total_bytes: int = offset
        self.num_buckets: int = max(1, -(-offset // bucket_bytes))
        self._manifests = self._cut()
        self._plan = [list(dict.fromkeys(e.name for e in m)) for m in self._manifests]

    def _cut(self) -> list[tuple[ManifestEntry, ...]]:
        manifests: list[list[ManifestEntry]] = [[] for _ in range(self.num_buckets)]
        size = self.bucket_bytes
        for slot in self.slots:
            first = min(slot.offset // size, self.num_buckets - 1)
            last = first if slot.nbytes == 0 else (slot.offset + slot.nbytes - 1) // size
            for k in range(first, last + 1):
                lo = max(slot.offset, k * size)
                hi = min(slot.offset + slot.nbytes, (k + 1) * size)
                manifests[k].append(
                    ManifestEntry(
                        slot.name, slot.shape, slot.dtype, lo - k * size, lo - slot.offset, hi - lo
                    )
                )
        return [tuple(m) for m in manifests]

    def span(self, index: int) -> tuple[int, int]:
        """``[start, stop)`` of bucket ``index`` in the stream, bytes."""
        if not 0 <= index < self.num_buckets:
            raise IndexError(f"bucket {index} outside [0, {self.num_buckets})")
        start = index * self.bucket_bytes
        return start, min(start + self.bucket_bytes, self.total_bytes)

    def manifest(self, index: int) -> tuple[ManifestEntry, ...]:
        """The tensor pieces of bucket ``index``, in stream order."""
        self.span(index)
        return self._manifests[index]

    def plan(self) -> list[list[str]]:
        """Per bucket, the names of the tensors (or tensor pieces) it carries."""
        return [list(names) for names in self._plan]

    def bucket_names(self, index: int) -> list[str]:
        """The names of the tensors (or tensor pieces) bucket ``index`` carries."""
        self.span(index)
        return list(self._plan[index])

    def tensors(self, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` of every tensor in ``flat`` (uint8 [>= total_bytes]), stream order."""
        for s in self.slots:
            yield s.name, flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)


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
    (the parts are copied straight into the stream, never stacked in memory first).

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


def _slice_runs(runs: ByteRuns, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Bytes ``[lo, hi)`` of the tensor ``runs`` describe, as ``(offset from lo, bytes)``."""
    for start, flat in runs:
        a, b = max(lo, start), min(hi, start + flat.numel())
        if a < b:
            yield a - lo, flat[a - start : b - start]


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
        self._slot = 0
        self._current: ByteRuns | None = None  # bytes of the tensor now being packed

    @property
    def next_index(self) -> int:
        """The bucket the next :meth:`fill` / :meth:`advance` must ask for."""
        return self._next_index

    @property
    def done(self) -> bool:
        """Every bucket has been filled."""
        return self._next_index == self.layout.num_buckets

    def _check_order(self, index: int) -> None:
        if index != self._next_index:
            raise RefitError(
                f"bucket {index} requested but the stream is at bucket {self._next_index}; "
                "buckets are filled in order, each once"
            )

    def advance(self, index: int) -> None:
        """Consume (and check) the exported tensors of bucket ``index`` without packing them:
        what a rank that exports but does not send does, to stay in step with the sender's
        collectives inside the export."""
        self._check_order(index)
        for entry in self.layout.manifest(index):
            if entry.tensor_offset == 0:
                self._tensor_bytes(entry)
        self._next_index += 1
        if self.done:
            self._expect_end()

    def fill(self, index: int, out: torch.Tensor) -> BucketHeader:
        """Write bucket ``index`` into ``out`` (uint8, >= bucket_bytes) and describe it.

        Raises:
            RefitError: buckets requested out of order, or the export disagrees with the
                refit info (name, shape or dtype, or the number of tensors).
        """
        self._check_order(index)
        start, stop = self.layout.span(index)
        if out.dtype != torch.uint8 or out.numel() < stop - start:
            raise ValueError(f"bucket {index} needs a uint8 buffer of >= {stop - start} bytes")
        dest = out[: stop - start]
        cursor, pieces = 0, []
        with torch._C.DisableTorchFunction():  # plain byte slicing (see bucket_checksum)
            for entry in self.layout.manifest(index):
                source = self._tensor_bytes(entry)
                if entry.bucket_offset > cursor:  # padding is zero: checksums are repeatable
                    dest[cursor : entry.bucket_offset].zero_()
                cursor = entry.bucket_offset + entry.length
                for at, piece in _slice_runs(
                    source, entry.tensor_offset, entry.tensor_offset + entry.length
                ):
                    pieces.append((entry.bucket_offset + at, piece))
            if cursor < dest.numel():
                dest[cursor:].zero_()
            tick = time.perf_counter()
            checksum = copy_pieces(dest, pieces, self.checksums)
        self.timings.pack_s += time.perf_counter() - tick
        self._next_index += 1
        if self.done:
            self._expect_end()
        return BucketHeader(
            self.version, index, self.layout.num_buckets, self.layout.bucket_bytes,
            dest.numel(), checksum, self.layout.manifest(index),
        )

    def _tensor_bytes(self, entry: ManifestEntry) -> ByteRuns:
        """Bytes of ``entry``'s tensor (:func:`byte_runs`), pulling it from the export at its
        first piece."""
        if entry.tensor_offset == 0:
            slot = self.layout.slots[self._slot]
            self._slot += 1
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
            self._current = byte_runs(tensor)
        assert self._current is not None
        return self._current

    def _expect_end(self) -> None:
        tick = time.perf_counter()
        extra = next(self._iter, None)
        self.timings.export_s += time.perf_counter() - tick
        self._current = None
        if extra is not None:
            raise RefitError(
                f"the export yielded {extra[0]!r} after the last tensor of the refit info; "
                "prepare the refit info again after changing the model"
            )


class StagingArea:
    """Receiver side: checks each bucket against the layout where its bytes lie.

    ``buffer`` holds the whole stream, bucket ``k`` at its window :meth:`StreamLayout.span`:
    the sender's shared buffer (colocated: the sender wrote the bytes there, nothing is
    copied) or the receiver's own memory (a broadcast writes into :meth:`destination`).

    Args:
        layout: the stream layout built from the refit info this receiver was given.
        buffer: uint8 [>= ``layout.total_bytes``].

    Raises:
        ValueError: ``buffer`` is not uint8 or is shorter than the stream.
    """

    def __init__(self, layout: StreamLayout, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.numel() < layout.total_bytes:
            raise ValueError(
                f"staging needs a uint8 buffer of >= {layout.total_bytes} bytes (the whole "
                f"stream), got {buffer.dtype} [{buffer.numel()}]"
            )
        self.layout = layout
        self.buffer = buffer
        self.version: int | None = None
        self._next_index = 0

    @property
    def complete(self) -> bool:
        """Every bucket has arrived and passed its checks."""
        return self._next_index == self.layout.num_buckets

    def destination(self, header: BucketHeader) -> torch.Tensor:
        """The window of ``header``'s payload in the buffer, after checking the header.

        Raises:
            RefitError: the bucket is out of order or from another version, or its size or
                manifest disagrees with the refit info.
        """
        expected = self._next_index
        if self.complete:
            raise RefitError(f"bucket {header.index} arrived after the last bucket")
        if header.index != expected:
            raise RefitError(
                f"bucket {header.index} arrived where bucket {expected} was expected: a bucket "
                "is missing or out of order"
            )
        if self.version is not None and header.version != self.version:
            raise RefitError(
                f"bucket {header.index} belongs to refit version {header.version}, the buckets "
                f"before it to version {self.version}"
            )
        if (header.num_buckets, header.bucket_bytes) != (
            self.layout.num_buckets, self.layout.bucket_bytes
        ):
            raise RefitError(
                f"the sender streams {header.num_buckets} buckets of {header.bucket_bytes} "
                f"bytes, the refit info gives {self.layout.num_buckets} of "
                f"{self.layout.bucket_bytes}: both sides need the same refit info"
            )
        start, stop = self.layout.span(header.index)
        if header.nbytes != stop - start:
            raise RefitError(
                f"bucket {header.index} has {header.nbytes} bytes, the refit info gives "
                f"{stop - start}"
            )
        mine = self.layout.manifest(header.index)
        if header.manifest != mine:
            raise RefitError(
                f"bucket {header.index} disagrees with the refit info: "
                f"{_first_difference(header.manifest, mine)}"
            )
        self.version = header.version
        return self.buffer[start:stop]

    def verify(self, header: BucketHeader) -> None:
        """Check the payload of ``header`` in its window (after :meth:`destination`, once the
        bytes are there) against the sender's checksum: one read of the window. A header
        without a checksum (the sender was told not to compute them) passes.

        Raises:
            RefitError: the checksum differs (the bucket was corrupted in transit).
        """
        if header.index != self._next_index or header.version != self.version:
            raise RuntimeError(
                f"verify bucket {header.index} after destination() accepted its header"
            )
        start, stop = self.layout.span(header.index)
        checksum = None if header.checksum is None else bucket_checksum(self.buffer[start:stop])
        if checksum != header.checksum:
            raise RefitError(
                f"bucket {header.index} of refit version {header.version} is corrupt: its "
                f"checksum is {checksum:#018x}, the sender's {header.checksum:#018x}"
            )
        self._next_index += 1

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view into the buffer)`` of every tensor, once every bucket has passed.

        Raises:
            RefitError: buckets are still missing.
        """
        if not self.complete:
            raise RefitError(
                f"only {self._next_index} of {self.layout.num_buckets} buckets arrived; the "
                "refit is incomplete"
            )
        return self.layout.tensors(self.buffer)


def _first_difference(got: tuple[ManifestEntry, ...], want: tuple[ManifestEntry, ...]) -> str:
    for g, w in zip(got, want):
        if g != w:
            return (
                f"the sender has {g.name!r} {g.shape} {g.dtype} at byte {g.bucket_offset} where "
                f"the refit info has {w.name!r} {w.shape} {w.dtype} at byte {w.bucket_offset}"
            )
    return f"the sender lists {len(got)} tensor pieces, the refit info {len(want)}"
