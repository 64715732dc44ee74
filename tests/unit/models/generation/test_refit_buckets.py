"""Bucket packing and checking, the shared-memory buffers, the colocated sender -> receiver
stream and the broadcast group of the refit package, without Ray or vLLM (the end-to-end refit
is in test_refit.py)."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nemo_rl.models.generation.refit import RefitError, buckets
from nemo_rl.models.generation.refit.buckets import (
    ALIGNMENT,
    BucketPacker,
    StagingArea,
    StreamLayout,
    bucket_checksum,
    copy_pieces,
)
from nemo_rl.models.generation.refit.cuda_ipc import CudaIpcBuffer
from nemo_rl.models.generation.refit.interfaces import RefitInfo, RefitSettings
from nemo_rl.models.generation.refit.ipc import IpcBucket, stream_buffer_bytes
from nemo_rl.models.generation.refit.receiver import RefitReceiver
from nemo_rl.models.generation.refit.sender import RefitSender
from nemo_rl.models.generation.refit.shared_memory import (
    PREFIX,
    SharedMemoryBuffer,
    remove_stale_segments,
)


# 256-byte buckets, the tensors' own dtypes, checksums on.
SETTINGS = RefitSettings(bucket_bytes=256, dtype=None, timeout_s=60.0, checksums=True)


def named_tensors() -> dict[str, torch.Tensor]:
    """Mixed dtypes and sizes, including odd byte counts, a scalar and an empty tensor."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(33, 17, generator=gen),
        "norm_bf16": torch.randn(37, generator=gen).to(torch.bfloat16),
        "half": torch.randn(5, 3, generator=gen).to(torch.float16),
        "ids": torch.randint(-(2**40), 2**40, (7,), generator=gen),
        "flags": torch.rand(13, generator=gen) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "big": torch.randn(700, generator=gen),  # 2800 bytes
    }


def info_of(tensors: dict[str, torch.Tensor]) -> RefitInfo:
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}


def transfer(
    tensors: dict[str, torch.Tensor], bucket_bytes: int, version: int = 1
) -> tuple[StagingArea, list]:
    """Pack every bucket into its window of one stream buffer and check it there, as a
    colocated refit does (the receiver's layout is built from the refit info on its own)."""
    layout = StreamLayout(info_of(tensors), bucket_bytes)
    packer = BucketPacker(layout, iter(tensors.items()), version)
    buffer = torch.full((layout.total_bytes,), 0xAB, dtype=torch.uint8)  # stale bytes
    staging = StagingArea(StreamLayout(info_of(tensors), bucket_bytes), buffer)
    headers = []
    for index in range(layout.num_buckets):
        start, stop = layout.span(index)
        header = packer.fill(index, buffer[start:stop])
        staging.destination(header)
        staging.verify(header)
        headers.append(header)
    assert packer.done
    return staging, headers


def deliver(staging: StagingArea, header, payload: torch.Tensor) -> None:
    """Copy a bucket into its window and check it, as a broadcast receiver does."""
    staging.destination(header).copy_(payload[: header.nbytes])
    staging.verify(header)


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()


# ------------------------------------------------------------------------------ layout and packing


@pytest.mark.parametrize("bucket_bytes", [64, 128, 1024, 1 << 20])
def test_round_trip_is_bitwise_exact(bucket_bytes):
    tensors = named_tensors()
    staging, headers = transfer(tensors, bucket_bytes)
    out = dict(staging.tensors())
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert_bitwise_equal(out[name], tensor)
    assert all(h.version == 1 and h.num_buckets == len(headers) for h in headers)


def test_bucket_boundaries_and_alignment():
    tensors = named_tensors()
    layout = StreamLayout(info_of(tensors), 256)
    assert layout.total_bytes % ALIGNMENT == 0
    assert all(s.offset % ALIGNMENT == 0 for s in layout.slots)
    assert layout.num_buckets == -(-layout.total_bytes // 256)
    spans = [layout.span(k) for k in range(layout.num_buckets)]
    assert spans[0][0] == 0 and spans[-1][1] == layout.total_bytes
    assert all(stop - start == 256 for start, stop in spans[:-1])
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # every byte of every tensor is in exactly one manifest piece, in order
    covered: dict[str, int] = {}
    for k in range(layout.num_buckets):
        for e in layout.manifest(k):
            assert covered.get(e.name, 0) == e.tensor_offset
            assert 0 <= e.bucket_offset and e.bucket_offset + e.length <= spans[k][1] - spans[k][0]
            covered[e.name] = e.tensor_offset + e.length
    assert covered == {s.name: s.nbytes for s in layout.slots}
    # a tensor cut by a boundary is named by both buckets
    assert layout.plan()[0][-1] == layout.plan()[1][0] == "embed"


def test_staged_tensors_are_views_of_the_stream_buffer():
    staging, _ = transfer(named_tensors(), 256)
    base = staging.buffer.data_ptr()
    for name, view in staging.tensors():
        assert view.untyped_storage().data_ptr() == base, name  # no copy on the receiver
        assert view.untyped_storage().nbytes() == staging.buffer.numel(), name


def test_staging_needs_a_buffer_of_the_whole_stream_and_checks_in_order():
    layout = StreamLayout(info_of(named_tensors()), 256)
    with pytest.raises(ValueError, match=f">= {layout.total_bytes} bytes"):
        StagingArea(layout, torch.empty(layout.total_bytes - 64, dtype=torch.uint8))
    packer = BucketPacker(layout, iter(named_tensors().items()), 1)
    buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
    header = packer.fill(0, buffer[:256])
    with pytest.raises(RuntimeError, match="after destination"):
        StagingArea(layout, buffer).verify(header)


def test_oversize_tensor_spans_many_buckets():
    big = {"huge": torch.arange(10_000, dtype=torch.float32), "after": torch.ones(3)}
    staging, headers = transfer(big, 1024)
    assert len(headers) == 40
    assert [e.name for e in headers[5].manifest] == ["huge"]
    out = dict(staging.tensors())
    assert torch.equal(out["huge"], big["huge"]) and torch.equal(out["after"], big["after"])


def test_checksum_is_the_wrapping_sum_of_words():
    data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    words = [int.from_bytes(bytes(data[i : i + 8].tolist()), "little") for i in range(0, 4096, 8)]
    assert sum(words) >= 2**64  # the sum wraps
    assert bucket_checksum(data) == sum(words) % 2**64
    with pytest.raises(ValueError, match="multiple of 8"):
        bucket_checksum(data[:7])


@pytest.mark.parametrize("threads", [1, 3])
def test_chunked_pack_copies_exactly_and_sums_like_the_bucket_checksum(threads, monkeypatch):
    """Pieces of every size (several chunks, under one chunk, a partial last word, a source
    not 8-byte aligned) land at their offsets, the gaps stay zero, and the chunk sums add up to
    the checksum of the whole bucket, on any number of threads."""
    monkeypatch.setattr(buckets, "PACK_THREADS", threads)
    monkeypatch.setattr(buckets, "CHUNK_BYTES", 1 << 16)
    lengths = [9 * (1 << 16) + 3, 12, 1 << 16, 5, 3 * (1 << 16)]
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in lengths]
    sources[3] = torch.randint(0, 256, (6,), dtype=torch.uint8)[1:]  # unaligned
    bucket = torch.zeros(sum(-(-n // 64) * 64 for n in lengths), dtype=torch.uint8)
    pieces, offset = [], 0
    for src in sources:
        pieces.append((offset, src))
        offset += -(-src.numel() // 64) * 64
    checksum = copy_pieces(bucket, pieces, checksums=True)
    assert checksum == bucket_checksum(bucket)
    for (start, src), nxt in zip(pieces, [p[0] for p in pieces[1:]] + [bucket.numel()]):
        assert torch.equal(bucket[start : start + src.numel()], src)
        assert (bucket[start + src.numel() : nxt] == 0).all()
    again = torch.zeros_like(bucket)
    assert copy_pieces(again, pieces, checksums=False) is None and torch.equal(again, bucket)


def test_checksum_bypasses_torch_function_modes():
    """The checksum's sum skips torch-function modes (the CPU compatibility layer keeps one
    pushed in the policy process) and gives the same value."""
    calls = []

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    data = torch.randint(0, 256, (5 * 1024**2 + 8,), dtype=torch.uint8)
    want = bucket_checksum(data)
    with Counting():
        got = bucket_checksum(data)
    assert calls == [] and got == want


def test_buckets_without_checksums_round_trip_and_skip_the_check():
    """``checksums=False``: headers carry None, the receiver checks order, sizes and manifest
    only, and the stream still arrives bitwise (a flipped byte is not noticed: the price of
    turning checksums off)."""
    tensors = named_tensors()
    layout = StreamLayout(info_of(tensors), 128)
    packer = BucketPacker(layout, iter(tensors.items()), 1, checksums=False)
    buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    staging = StagingArea(StreamLayout(info_of(tensors), 128), buffer)
    for index in range(layout.num_buckets):
        start, stop = layout.span(index)
        header = packer.fill(index, buffer[start:stop])
        assert header.checksum is None
        if index == 1:
            buffer[start] ^= 1
        staging.destination(header)
        staging.verify(header)
    got = dict(staging.tensors())
    changed = [n for n, t in tensors.items() if not torch.equal(got[n], t)]
    assert len(changed) == 1  # the flipped byte's tensor, loaded as it is


@pytest.mark.parametrize("bucket_bytes", [0, 100, -64, 64.0])
def test_bad_bucket_size_names_the_field(bucket_bytes):
    with pytest.raises(ValueError, match="bucket_bytes"):
        StreamLayout(info_of(named_tensors()), bucket_bytes)


# ------------------------------------------------------------------------------ sender checks


def packer_for(stream: Iterator, bucket_bytes: int = 1 << 20) -> BucketPacker:
    return BucketPacker(StreamLayout(info_of(named_tensors()), bucket_bytes), stream, 1)


def test_export_with_a_wrong_shape_is_refused():
    tensors = named_tensors()
    tensors["half"] = torch.zeros(3, 5, dtype=torch.float16)
    with pytest.raises(RefitError, match="'half' \\(3, 5\\).*refit info has 'half' \\(5, 3\\)"):
        packer_for(iter(tensors.items())).fill(0, torch.empty(1 << 20, dtype=torch.uint8))


def test_export_with_too_many_or_too_few_tensors_is_refused():
    items = list(named_tensors().items())
    with pytest.raises(RefitError, match="after the last tensor"):
        packer_for(iter(items + [("extra", torch.ones(1))])).fill(
            0, torch.empty(1 << 20, dtype=torch.uint8)
        )
    with pytest.raises(RefitError, match="ended before 'big'"):
        packer_for(iter(items[:-1])).fill(0, torch.empty(1 << 20, dtype=torch.uint8))


def test_advance_consumes_the_same_tensors_as_fill():
    pulled: list[str] = []

    def stream():
        for name, t in named_tensors().items():
            pulled.append(name)
            yield name, t

    packer = packer_for(stream(), bucket_bytes=256)
    for index in range(3):
        packer.advance(index)
    starting = [e.name for k in range(3) for e in packer.layout.manifest(k) if e.tensor_offset == 0]
    assert pulled == starting
    with pytest.raises(RefitError, match="requested but the stream is at bucket 3"):
        packer.fill(1, torch.empty(256, dtype=torch.uint8))


# ------------------------------------------------------------------------------ receiver checks


def staging_for(info: RefitInfo, bucket_bytes: int = 256) -> StagingArea:
    layout = StreamLayout(info, bucket_bytes)
    return StagingArea(layout, torch.empty(layout.total_bytes, dtype=torch.uint8))


def staged_pair(bucket_bytes: int = 256) -> tuple[BucketPacker, StagingArea, torch.Tensor]:
    """A sender, a broadcast-style receiver and the sender's bucket buffer."""
    tensors = named_tensors()
    layout = StreamLayout(info_of(tensors), bucket_bytes)
    return (
        BucketPacker(layout, iter(tensors.items()), 7),
        staging_for(info_of(tensors), bucket_bytes),
        torch.empty(bucket_bytes, dtype=torch.uint8),
    )


def test_corrupt_bucket_is_refused():
    packer, staging, buffer = staged_pair()
    header = packer.fill(0, buffer)
    buffer[10] ^= 0x40
    with pytest.raises(RefitError, match="bucket 0 of refit version 7 is corrupt"):
        deliver(staging, header, buffer)


def test_missing_bucket_is_refused_and_incomplete_stream_cannot_be_read():
    packer, staging, buffer = staged_pair()
    deliver(staging, packer.fill(0, buffer), buffer)
    packer.fill(1, buffer)  # lost in transit
    with pytest.raises(RefitError, match="bucket 2 arrived where bucket 1 was expected"):
        deliver(staging, packer.fill(2, buffer), buffer)
    with pytest.raises(RefitError, match="only 1 of"):
        staging.tensors()


def test_stream_that_disagrees_with_the_receivers_refit_info_is_refused():
    tensors = named_tensors()
    packer, _, buffer = staged_pair()
    other = {**info_of(tensors), "half": ((3, 5), torch.float16)}
    staging = staging_for(other)
    with pytest.raises(RefitError, match="has 'half' \\(5, 3\\).*refit info has 'half' \\(3, 5\\)"):
        for index in range(packer.layout.num_buckets):
            deliver(staging, packer.fill(index, buffer), buffer)
    wider = staging_for(info_of(tensors), 512)
    packer, _, buffer = staged_pair()
    with pytest.raises(RefitError, match="both sides need the same refit info"):
        deliver(wider, packer.fill(0, buffer), buffer)


# ------------------------------------------------------------------------------ shared memory


_CHILD = """
import sys
from nemo_rl.models.generation.refit.shared_memory import SharedMemoryBuffer, SharedMemoryHandle
buf = SharedMemoryBuffer.attach(SharedMemoryHandle(sys.argv[1], int(sys.argv[2])))
print(int(buf.tensor.sum()))
buf.tensor[:4] = 7
buf.close()
"""


def test_shared_memory_is_shared_across_processes_and_unlinked_on_close():
    owner = SharedMemoryBuffer.create(4096)
    try:
        owner.tensor[:] = 1
        handle = owner.handle
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, handle.path, str(handle.nbytes)],
            capture_output=True, text=True, check=True, timeout=120,
        )
        assert out.stdout.strip() == "4096"
        assert owner.tensor[:5].tolist() == [7, 7, 7, 7, 1]  # the child's writes
        assert Path(handle.path).exists()
    finally:
        owner.close()
    assert not Path(handle.path).exists()
    with pytest.raises(RuntimeError, match="the sender closed it or died"):
        SharedMemoryBuffer.attach(handle)


def test_segments_of_dead_processes_are_removed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    ns = SharedMemoryBuffer.create(64, tmp_path)
    ns.close()
    namespace = ns.path.name.split("_")[-3]
    stale = tmp_path / f"{PREFIX}_{namespace}_{child.pid}_deadbeef"
    live = tmp_path / f"{PREFIX}_{namespace}_{os.getpid()}_cafe"
    elsewhere = tmp_path / f"{PREFIX}_1{namespace}_{child.pid}_deadbeef"  # other pid namespace
    for path in (stale, live, elsewhere):
        path.write_bytes(b"x")
    assert remove_stale_segments(tmp_path) == [stale.name]
    assert live.exists() and elsewhere.exists() and not stale.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_ipc_fails_clearly_without_cuda():
    with pytest.raises(RuntimeError, match="needs CUDA.*shared-memory transport"):
        CudaIpcBuffer.create(1024, torch.device("cuda"))


# ------------------------------------------------------------------------------ colocated stream


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def stream_ipc(sender: RefitSender, receiver: RefitReceiver, corrupt: int | None = None) -> list:
    """One colocated stream of 256-byte buckets; flips a byte of bucket ``corrupt`` in the
    shared buffer after the sender packed it. Returns the buckets."""
    buckets = []
    for keys in sender.prepare_weights_for_ipc().plan:
        bucket = sender.get_weights_ipc_handles(keys)
        if bucket.header.index == corrupt:
            flip_byte(bucket.buffer.path, bucket.header.index * 256 + 10)
        buckets.append(bucket)
        receiver.update_weights_from_ipc_handles(bucket)
    return buckets


def test_colocated_stream_loads_views_of_the_senders_buffer_and_refuses_corruption():
    tensors = named_tensors()
    loads: list[dict[str, torch.Tensor]] = []

    def load(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        loads.append(dict(weights))

    cpu = torch.device("cpu")
    sender = RefitSender(lambda dtype: iter(tensors.items()), True, True, cpu, SETTINGS)
    receiver = RefitReceiver(load, cpu)
    try:
        receiver.prepare_refit_info(sender.prepare_refit_info())
        buckets = stream_ipc(sender, receiver)
        assert receiver.commit_weight_update()["version"] == 1
        timings = sender.finish_weights_ipc()
        assert set(timings) == {"export_s", "pack_s", "stream_s"}
        # one buffer of the whole stream: every bucket names it
        assert len({b.buffer for b in buckets}) == 1 and len(buckets) > 4
        total = buckets[0].buffer.nbytes
        assert total == stream_buffer_bytes(StreamLayout(info_of(tensors), 256))
        for name, tensor in tensors.items():
            assert_bitwise_equal(loads[0][name], tensor)
            # a view of the whole mapped buffer, not a copy
            assert loads[0][name].untyped_storage().nbytes() == total, name

        with pytest.raises(RefitError, match="bucket 2 of refit version 2 is corrupt"):
            stream_ipc(sender, receiver, corrupt=2)
        with pytest.raises(RefitError, match="no staged refit to commit"):
            receiver.commit_weight_update()
        assert (receiver.version, len(loads)) == (1, 1)  # the loader never ran

        # every bucket of a stream must lie in the stream's one buffer
        plan = sender.prepare_weights_for_ipc().plan
        receiver.update_weights_from_ipc_handles(sender.get_weights_ipc_handles(plan[0]))
        second = sender.get_weights_ipc_handles(plan[1])
        other = SharedMemoryBuffer.create(total)
        try:
            with pytest.raises(RefitError, match="another shared buffer than bucket 0"):
                receiver.update_weights_from_ipc_handles(IpcBucket(second.header, other.handle))
        finally:
            other.close()
        sender.finish_weights_ipc()

        stream_ipc(sender, receiver)  # the buffer is reused by the next stream
        assert receiver.commit_weight_update()["version"] == 4 and len(loads) == 2
        for name, tensor in tensors.items():
            assert_bitwise_equal(loads[1][name], tensor)
    finally:
        receiver.close()
        sender.close()
    assert not Path(buckets[0].buffer.path).exists()


def test_whole_stream_is_checked_from_the_bucket_records_while_it_is_packed():
    """One call per side: the receiver polls the records the sender publishes after each
    bucket, here while the sender packs on another thread; corrupt, partial and stale streams
    are refused and leave the receiver's version alone."""
    tensors = named_tensors()
    loads: list[dict[str, torch.Tensor]] = []
    cpu = torch.device("cpu")
    sender = RefitSender(lambda dtype: iter(tensors.items()), True, True, cpu, SETTINGS)
    receiver = RefitReceiver(lambda weights: loads.append(dict(weights)), cpu)
    finished = lambda: "finished"  # noqa: E731
    try:
        receiver.prepare_refit_info(sender.prepare_refit_info())
        stream = sender.prepare_weights_for_ipc()
        assert len(stream.plan) > 4
        packing = threading.Thread(target=lambda: (time.sleep(0.05), sender.stream_weights_ipc()))
        packing.start()  # the receiver starts polling before the first bucket is packed
        receiver.receive_weights_ipc_stream(
            stream, lambda: None if packing.is_alive() else "finished", timeout_s=30
        )
        packing.join()
        assert receiver.commit_weight_update()["version"] == stream.version == 1
        sender.finish_weights_ipc()
        for name, tensor in tensors.items():
            assert_bitwise_equal(loads[0][name], tensor)

        stream = sender.prepare_weights_for_ipc()
        sender.stream_weights_ipc()
        flip_byte(stream.buffer.path, 2 * 256 + 10)
        with pytest.raises(RefitError, match="bucket 2 of refit version 2 is corrupt"):
            receiver.receive_weights_ipc_stream(stream, finished, timeout_s=30)
        sender.finish_weights_ipc()

        stream = sender.prepare_weights_for_ipc()  # a sender that dies after two buckets
        for keys in stream.plan[:2]:
            sender.get_weights_ipc_handles(keys)
        with pytest.raises(RefitError, match="bucket 2 was never packed: the sender failed"):
            receiver.receive_weights_ipc_stream(stream, lambda: "failed: killed", timeout_s=30)
        with pytest.raises(RefitError, match="bucket 2 was not packed within"):
            receiver.receive_weights_ipc_stream(stream, lambda: None, timeout_s=0.05)
        sender.finish_weights_ipc()

        # a new stream clears the records: the last stream's are never taken for its own
        stream = sender.prepare_weights_for_ipc()
        with pytest.raises(RefitError, match="bucket 0 was never packed"):
            receiver.receive_weights_ipc_stream(stream, finished, timeout_s=30)
        with pytest.raises(RefitError, match="no staged refit to commit"):
            receiver.commit_weight_update()
        assert (receiver.version, len(loads)) == (1, 1)  # the loader never ran again
    finally:
        receiver.close()
        sender.close()


# ------------------------------------------------------------------------------ broadcast group


def _collective_rank(rank: int, port: int, info: RefitInfo, queue: multiprocessing.Queue) -> None:
    """Two streams: a good one, then one whose export breaks off at the 'big' tensor."""
    from nemo_rl.models.generation.refit.collective import RefitCollective

    try:
        group = RefitCollective("127.0.0.1", port, 3, rank, torch.device("cpu"), timeout_s=60)
        tensors = named_tensors()
        broken = {**tensors, "big": torch.zeros(3)}
        for stream in (tensors, broken):
            if rank == 0:
                layout = StreamLayout(info_of(tensors), 256)
                packer = BucketPacker(layout, iter(stream.items()), 3)
                try:
                    group.send(packer, [torch.empty(256, dtype=torch.uint8) for _ in range(2)])
                    outcome: Any = "sent"
                except RefitError as err:
                    outcome = f"RefitError: {err}"
                queue.put((rank, outcome, torch.distributed.is_initialized()))
            else:
                staging = staging_for(info)
                try:
                    group.receive(staging)
                    queue.put((rank, dict(staging.tensors()), torch.distributed.is_initialized()))
                except RefitError as err:
                    queue.put((rank, f"RefitError: {err}", group.broken))
        group.close()
    except Exception as err:  # report instead of hanging the parent
        queue.put((rank, f"{type(err).__name__}: {err}", None))


@pytest.mark.slow
def test_broadcast_group_delivers_exact_buckets_and_failures_stay_contained():
    tensors = named_tensors()
    wrong = {**info_of(tensors), "half": ((3, 5), torch.float16)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    infos = [None, info_of(tensors), wrong]
    procs = [
        ctx.Process(target=_collective_rank, args=(r, port, infos[r], queue)) for r in range(3)
    ]
    for p in procs:
        p.start()
    results: dict[int, list] = {0: [], 1: [], 2: []}
    try:
        for _ in range(6):
            rank, out, flag = queue.get(timeout=120)
            results[rank].append((out, flag))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    # stream 1: exact on the receiver with the right info; the other drains and refuses
    assert results[0][0] == ("sent", False)  # the default process group was never created
    received, default_group = results[1][0]
    assert default_group is False
    for name, tensor in tensors.items():
        assert_bitwise_equal(received[name], tensor)
    message, broken = results[2][0]
    assert "disagrees with the refit info" in message
    assert broken is False  # it drained the stream: the group is still usable
    # stream 2: the sender's export breaks off; every receiver is released at once
    assert "the export yielded 'big' (3,)" in results[0][1][0]
    for rank in (1, 2):
        message, broken = results[rank][1]
        assert "the sender gave up" in message and broken is False


def test_a_refit_buffer_without_room_on_the_gpu_is_refused_with_the_fix(monkeypatch):
    from nemo_rl.models.generation.refit.ipc import require_device_memory

    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gb, 80 * gb))
    require_device_memory(2 * gb, torch.device("cuda", 0), "the sending policy rank")
    with pytest.raises(RefitError, match=r"5\.00 GB.*3\.00 GB free of 80\.00 GB.*precision"):
        require_device_memory(5 * gb, torch.device("cuda", 0), "the sending policy rank")
    require_device_memory(5 * gb, torch.device("cpu"), "the sending policy rank")  # no check
