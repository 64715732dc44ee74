"""A ring of staging slots through which one writer streams buckets to the readers of a node.

A refit never holds the whole weight stream: its buckets (:mod:`.buckets`) pass through a ring
of :data:`RING_SLOTS` slots, each as large as the stream's largest bucket. The writer (a policy
rank packing the export, or an engine receiving a broadcast) puts bucket ``k`` into slot
``k % RING_SLOTS`` once every reader has released bucket ``k - RING_SLOTS``; the readers (the
processes of the engines on that node or device) check each bucket where it lies, load its
tensors into their engine, and release it. So a refit stages at most ``RING_SLOTS x
slot_bytes`` per ring, whatever the model's size.

The ring is one shareable uint8 buffer (``/dev/shm`` on CPU, CUDA IPC on GPU: :mod:`.ipc`):
the slots, then int64 control words:

* one abort word: the version of a stream that any participant gave up on (readers and writer
  stop waiting and raise);
* the writer's pid, and each reader's pid once it attaches: every participant lives on the
  ring's node, so a participant that died (killed, crashed) is noticed by the others within a
  poll, not after the timeout;
* one record per slot: the header fields of the bucket in it, its completion stamp written
  last;
* one release word per reader: how many buckets of which version it is done with.

Stamps pack a version and a count into one word (``version << 32 | count``), so a record or a
release from an earlier stream (an older version) never passes for one of the current stream
and nothing has to be cleared between streams.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from nemo_rl.models.generation.refit.buckets import (
    BucketHeader,
    StreamLayout,
    check_header,
    verify_payload,
)
from nemo_rl.distributed.memory_plan import RING_SLOTS
from nemo_rl.models.generation.refit.errors import RefitError
from nemo_rl.models.generation.refit.shared_memory import pid_alive


# Control words before the records: abort, writer pid, then one pid per reader.
_ABORT = 0
_WRITER_PID = 1
_FIRST_READER_PID = 2
# One record per slot: version, index, num_buckets, nbytes, checksum (as int64), whether the
# checksum is set, unused, completion stamp (written last); 64 bytes.
_RECORD_WORDS = 8
_R_VERSION, _R_INDEX, _R_NUM, _R_NBYTES, _R_SUM, _R_HAS_SUM, _R_STAMP = 0, 1, 2, 3, 4, 5, 7
_INT64_RANGE = 1 << 64
# Polling: read back to back for SPIN_S, then every POLL_S; liveness of the other side every
# LIVENESS_S.
_SPIN_S = 0.002
_POLL_S = 0.0005
_LIVENESS_S = 0.05


def stamp(version: int, count: int) -> int:
    """One int64 word for ``(version, count)``, ordered by version then count."""
    if not 0 < version < 1 << 31 or not 0 <= count < 1 << 32:
        raise ValueError(f"stamp({version}, {count}) out of range")
    return (version << 32) | count


@dataclass(frozen=True)
class RingSpec:
    """The shape of a ring: ``slots`` slots of ``slot_bytes`` bytes, read by ``readers``."""

    slot_bytes: int
    readers: int
    slots: int = RING_SLOTS

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.slot_bytes % 64 or self.readers < 1 or self.slots < 1:
            raise ValueError(f"bad ring shape {self}")

    @property
    def nbytes(self) -> int:
        """Bytes of the ring's buffer: the slots, then the control words."""
        words = _FIRST_READER_PID + self.readers + self.slots * _RECORD_WORDS + self.readers
        return self.slots * self.slot_bytes + words * 8

    @classmethod
    def for_layout(cls, layout: StreamLayout, readers: int) -> RingSpec:
        """The ring a stream of ``layout`` needs (slots as large as its largest bucket)."""
        return cls(layout.slot_bytes, readers)


def synchronize(device: torch.device) -> None:
    """Wait until queued copies on ``device`` are done (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Ring:
    """The slots and control words of a ring buffer (see the module docstring).

    Args:
        buffer: uint8 [``spec.nbytes``] (shared memory or a CUDA IPC buffer).
        spec: the ring's shape; the writer and every reader must agree on it.

    Raises:
        RefitError: ``buffer`` is not of ``spec``'s size.
    """

    def __init__(self, buffer: torch.Tensor, spec: RingSpec) -> None:
        if buffer.dtype != torch.uint8 or buffer.numel() != spec.nbytes:
            raise RefitError(
                f"a ring of {spec} needs a uint8 buffer of {spec.nbytes} bytes, got "
                f"{buffer.dtype} [{buffer.numel()}]: the writer and the readers disagree on the "
                "refit info or the bucket size"
            )
        self.spec = spec
        self.device = buffer.device
        data_bytes = spec.slots * spec.slot_bytes
        self._slots = buffer[:data_bytes].view(spec.slots, spec.slot_bytes)
        words = buffer[data_bytes:].view(torch.int64)
        self._control = words[: _FIRST_READER_PID + spec.readers]
        records_end = _FIRST_READER_PID + spec.readers + spec.slots * _RECORD_WORDS
        self._records = words[_FIRST_READER_PID + spec.readers : records_end].view(
            spec.slots, _RECORD_WORDS
        )
        self._released = words[records_end:]

    # ------------------------------------------------------------------ shared words

    def _read(self, word: torch.Tensor) -> int:
        return int(word.item())

    def _write(self, words: torch.Tensor, values: list[int] | int) -> None:
        words.copy_(torch.tensor(values, dtype=torch.int64))
        synchronize(self.device)

    def abort(self, version: int) -> None:
        """Give up on stream ``version``: every participant waiting on it raises."""
        self._write(self._control[_ABORT], version)

    def aborted(self, version: int) -> bool:
        return self._read(self._control[_ABORT]) == version

    def _wait(
        self,
        ready: Callable[[], bool],
        what: str,
        version: int,
        timeout_s: float,
        peers: Callable[[], str | None],
    ) -> None:
        """Poll ``ready()`` until true; raise RefitError on abort of ``version``, when
        ``peers()`` names a dead participant, or after ``timeout_s``."""
        start = last_check = time.perf_counter()
        spin = _SPIN_S if self.device.type == "cuda" else 0.0
        while not ready():
            now = time.perf_counter()
            if self.aborted(version):
                raise RefitError(f"refit version {version} was aborted while {what}")
            if now - last_check >= _LIVENESS_S:
                last_check = now
                dead = peers()
                if dead:
                    if ready():  # finished just before it ended
                        return
                    raise RefitError(f"{dead} died while {what}")
            if now - start > timeout_s:
                raise RefitError(f"timed out after {timeout_s:g} s {what}")
            if now - start >= spin:
                time.sleep(_POLL_S)

    # ------------------------------------------------------------------ writer

    def start_writing(self) -> None:
        """Register this process as the ring's writer and forget the readers of earlier
        streams (a reader registers when it starts reading; a process that read an earlier
        stream and has since ended must not count as a dead reader of the next one). Call it
        before handing the ring to the readers of a stream."""
        self._control[_FIRST_READER_PID:].zero_()
        self._write(self._control[_WRITER_PID], os.getpid())

    def _dead_readers(self) -> str | None:
        pids = self._control[_FIRST_READER_PID:].tolist()
        dead = [r for r, pid in enumerate(pids) if pid and not pid_alive(pid)]
        return f"reader(s) {dead} of the ring" if dead else None

    def slot_for(self, index: int, version: int, timeout_s: float) -> torch.Tensor:
        """Slot of bucket ``index`` of stream ``version`` (uint8 [slot_bytes]), once every
        reader has released the bucket that was there.

        Raises:
            RefitError: a reader aborted the stream or died, or ``timeout_s`` passed.
        """
        needed = index - self.spec.slots + 1  # buckets every reader must be done with
        if needed > 0:
            want = stamp(version, needed)
            self._wait(
                lambda: bool((self._released >= want).all().item()),
                f"waiting for the readers to release bucket {needed - 1} of refit version "
                f"{version}",
                version, timeout_s, self._dead_readers,
            )
        return self._slots[index % self.spec.slots]

    def publish(self, header: BucketHeader) -> None:
        """Record ``header`` for the bucket just put in its slot; the stamp is written last."""
        record = self._records[header.index % self.spec.slots]
        checksum = header.checksum or 0
        signed = checksum - _INT64_RANGE if checksum >= 1 << 63 else checksum
        fields = [
            header.version, header.index, header.num_buckets, header.nbytes, signed,
            int(header.checksum is not None),
        ]
        synchronize(self.device)  # the bucket's bytes are in place before its record
        self._write(record[:_R_HAS_SUM + 1], fields)
        self._write(record[_R_STAMP], stamp(header.version, header.index + 1))

    # ------------------------------------------------------------------ readers

    def start_reading(self, reader: int) -> None:
        """Register this process as reader ``reader`` (0 .. readers-1)."""
        if not 0 <= reader < self.spec.readers:
            raise ValueError(f"reader {reader} outside [0, {self.spec.readers})")
        self._write(self._control[_FIRST_READER_PID + reader], os.getpid())

    def _dead_writer(self) -> str | None:
        pid = self._read(self._control[_WRITER_PID])
        return None if pid == 0 or pid_alive(pid) else f"the ring's writer (pid {pid})"

    def buckets(
        self, reader: int, layout: StreamLayout, version: int, timeout_s: float
    ) -> Iterator[tuple[BucketHeader, torch.Tensor]]:
        """Reader ``reader``'s view of stream ``version``: each bucket's header and payload
        (uint8 [nbytes], in its slot), checked against ``layout`` and its checksum, in order.
        A bucket is released when the next one is asked for (so the caller must be done with
        its tensors by then), the last when the iteration ends.

        Raises:
            RefitError: the stream was aborted, the writer died or timed out, or a bucket
                disagrees with ``layout`` or its checksum (the stream is then aborted for
                every participant).
        """
        self.start_reading(reader)
        release = self._released[reader]
        for index in range(layout.num_buckets):
            record = self._records[index % self.spec.slots]
            want = stamp(version, index + 1)
            try:
                self._wait(
                    lambda: self._read(record[_R_STAMP]) == want,
                    f"waiting for bucket {index} of refit version {version}",
                    version, timeout_s, self._dead_writer,
                )
                header = self._header(record, layout)
                check_header(layout, header, index, version)
                payload = self._slots[index % self.spec.slots][: header.nbytes]
                verify_payload(header, payload)
            except RefitError:
                self.abort(version)
                raise
            yield header, payload
            self._write(release, stamp(version, index + 1))

    def _header(self, record: torch.Tensor, layout: StreamLayout) -> BucketHeader:
        version, index, num, nbytes, checksum, has_checksum = record[: _R_HAS_SUM + 1].tolist()
        if not 0 <= index < layout.num_buckets:
            raise RefitError(
                f"a ring record names bucket {index}; the refit info has {layout.num_buckets}"
            )
        return BucketHeader(
            version, index, num, nbytes, checksum % _INT64_RANGE if has_checksum else None,
            layout.manifest(index),
        )
