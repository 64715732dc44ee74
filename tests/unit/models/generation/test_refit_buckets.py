"""Bucket layout, packing and checks, the staging ring, the shared-memory buffers, the
colocated sender -> ring -> readers stream and the broadcast group of the refit package,
without Ray or vLLM (the end-to-end refit is in test_refit.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
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
    StreamLayout,
    bucket_checksum,
    check_header,
    copy_pieces,
    verify_payload,
)
from nemo_rl.models.generation.refit.cuda_ipc import CudaIpcBuffer
from nemo_rl.models.generation.refit.interfaces import RefitInfo, RefitSettings
from nemo_rl.models.generation.refit.ipc import (
    NODE_ID_ENV,
    IpcStream,
    attach_ring,
    create_ring,
    require_device_memory,
)
from nemo_rl.models.generation.refit.plan import engine_reads, plan_rings
from nemo_rl.distributed.memory_plan import RING_SLOTS, refit_staging_bytes
from nemo_rl.models.generation.refit.ring import RingSpec
from nemo_rl.models.generation.refit.sender import RefitSender
from nemo_rl.models.generation.refit.shared_memory import (
    PREFIX,
    SHM_DIR_ENV,
    SharedMemoryBuffer,
    remove_stale_segments,
)
from nemo_rl.utils import fault_injection

CPU = torch.device("cpu")
# 256-byte buckets, the tensors' own dtypes, checksums on.
SETTINGS = RefitSettings(bucket_bytes=256, dtype=None, timeout_s=30.0, checksums=True)


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


def many_tensors(count: int = 80) -> dict[str, torch.Tensor]:
    """A stream many times larger than a ring of 256-byte slots."""
    gen = torch.Generator().manual_seed(1)
    return {f"layer{i}": torch.randn(16 + (i * 7) % 40, generator=gen) for i in range(count)}


def info_of(tensors: dict[str, torch.Tensor]) -> RefitInfo:
    return {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()


def pack_all(tensors: dict[str, torch.Tensor], bucket_bytes: int, checksums: bool = True):
    """Every bucket packed into a buffer of its own, with its header."""
    layout = StreamLayout(info_of(tensors), bucket_bytes)
    packer = BucketPacker(layout, iter(tensors.items()), 1, checksums)
    out = []
    for index in range(layout.num_buckets):
        buffer = torch.full((layout.slot_bytes,), 0xAB, dtype=torch.uint8)  # stale bytes
        out.append((packer.fill(index, buffer), buffer))
    assert packer.done
    return layout, out


# ------------------------------------------------------------------------------ layout and packing


@pytest.mark.parametrize("bucket_bytes", [64, 128, 1024, 1 << 20])
def test_round_trip_is_bitwise_exact(bucket_bytes):
    tensors = named_tensors()
    layout, packed = pack_all(tensors, bucket_bytes)
    receiver_layout = StreamLayout(info_of(tensors), bucket_bytes)  # from the refit info
    got = {}
    for index, (header, buffer) in enumerate(packed):
        check_header(receiver_layout, header, index, version=1)
        verify_payload(header, buffer)
        got.update(receiver_layout.tensors(index, buffer))
    assert list(got) == list(tensors)
    for name, tensor in tensors.items():
        assert_bitwise_equal(got[name], tensor)


def test_buckets_hold_whole_aligned_tensors_and_a_larger_tensor_alone():
    tensors = named_tensors()
    layout = StreamLayout(info_of(tensors), 256)
    assert [s.name for s in layout.slots] == list(tensors)  # each tensor in one bucket
    assert all(s.offset % ALIGNMENT == 0 for s in layout.slots)
    for index in range(layout.num_buckets):
        manifest = layout.manifest(index)
        end = max(s.offset + s.nbytes for s in manifest)
        assert layout.bucket_sizes[index] == -(-max(end, 1) // ALIGNMENT) * ALIGNMENT
        if len(manifest) > 1:
            assert end <= 256  # several tensors share a bucket only within its size
    big = next(s for s in layout.slots if s.name == "big")  # 2800 bytes > 256
    assert layout.manifest(big.bucket) == (big,) and big.offset == 0
    assert layout.slot_bytes == 2816 == max(layout.bucket_sizes)
    manifests = [layout.manifest(k) for k in range(layout.num_buckets)]
    assert layout.plan() == [[s.name for s in m] for m in manifests]
    assert layout.total_bytes == sum(layout.bucket_sizes)


def test_staged_tensors_are_views_of_the_bucket():
    tensors = named_tensors()
    layout, packed = pack_all(tensors, 1 << 20)
    (header, buffer), = packed
    for name, view in layout.tensors(0, buffer):
        assert view.untyped_storage().data_ptr() == buffer.data_ptr(), name  # no copy


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


def test_buckets_without_checksums_skip_the_check():
    """``checksums=False``: headers carry None and a flipped byte is not noticed (order, sizes
    and manifest are still checked): the price of turning checksums off."""
    layout, packed = pack_all(named_tensors(), 128, checksums=False)
    header, buffer = packed[1]
    assert header.checksum is None
    buffer[0] ^= 1
    verify_payload(header, buffer)


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


def test_advance_and_drain_consume_the_export_as_fill_does():
    pulled: list[str] = []

    def stream():
        for name, t in named_tensors().items():
            pulled.append(name)
            yield name, t

    packer = packer_for(stream(), bucket_bytes=256)
    for index in range(2):
        packer.advance(index)
    assert pulled == [s.name for k in range(2) for s in packer.layout.manifest(k)]
    with pytest.raises(RefitError, match="requested but the stream is at bucket 2"):
        packer.fill(1, torch.empty(256, dtype=torch.uint8))
    packer.drain()  # a sender that gave up: the rest of the export is consumed all the same
    assert packer.done and pulled == list(named_tensors())


# ------------------------------------------------------------------------------ receiver checks


def test_corrupt_missing_or_foreign_buckets_are_refused():
    tensors = named_tensors()
    layout, packed = pack_all(tensors, 256)
    header, buffer = packed[0]
    buffer[10] ^= 0x40
    with pytest.raises(RefitError, match="bucket 0 of refit version 1 is corrupt"):
        verify_payload(header, buffer)
    with pytest.raises(RefitError, match="bucket 2 arrived where bucket 1 was expected"):
        check_header(layout, packed[2][0], 1, version=1)
    with pytest.raises(RefitError, match="belongs to refit version 1, the stream to version 2"):
        check_header(layout, packed[1][0], 1, version=2)
    other = StreamLayout({**info_of(tensors), "half": ((3, 5), torch.float16)}, 256)
    index = next(s.bucket for s in layout.slots if s.name == "half")
    with pytest.raises(RefitError, match="has 'half' \\(5, 3\\).*refit info has 'half' \\(3, 5\\)"):
        check_header(other, packed[index][0], index, version=1)
    wider = StreamLayout(info_of(tensors), 1 << 20)
    with pytest.raises(RefitError, match="both sides need the same refit info"):
        check_header(wider, packed[0][0], 0, version=1)


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


def test_buffers_go_into_the_nodes_shared_memory_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    buffer = SharedMemoryBuffer.create(128)
    try:
        assert buffer.path.parent == tmp_path
    finally:
        buffer.close()
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=f"missing does not exist.*{SHM_DIR_ENV}"):
        SharedMemoryBuffer.create(128)


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


def test_a_ring_without_room_on_the_gpu_is_refused_with_the_fix(monkeypatch):
    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gb, 80 * gb))
    require_device_memory(2 * gb, torch.device("cuda", 0), "policy rank 0")
    with pytest.raises(RefitError, match=r"5\.00 GB.*3\.00 GB free of 80\.00 GB.*refit_buffer"):
        require_device_memory(5 * gb, torch.device("cuda", 0), "policy rank 0")
    require_device_memory(5 * gb, CPU, "policy rank 0")  # no check on the CPU


# ------------------------------------------------------------------------------ the ring


def read_stream(stream: IpcStream, reader: int, info: RefitInfo, out: dict, delay: float = 0.0,
                timeout_s: float = 30.0) -> None:
    """A reader as an engine rank is one: map the ring, copy every tensor out of its slot."""
    layout = StreamLayout(info, stream.bucket_bytes)
    buffer, ring = attach_ring(stream.ring)
    try:
        for header, payload in ring.buckets(reader, layout, stream.version, timeout_s):
            out.update((n, t.clone()) for n, t in layout.tensors(header.index, payload))
            time.sleep(delay)
    except RefitError as err:
        out["error"] = str(err)
    finally:
        buffer.close()


def ring_bytes_on_disk(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob(f"{PREFIX}_*"))


def test_a_stream_passes_through_a_ring_of_two_slots_to_every_reader(tmp_path, monkeypatch):
    """Three streams of a model 20x the ring's size reach two readers of different speeds
    exactly, while the node's shared memory never holds more than the ring: RING_SLOTS
    bucket-sized slots (measured on the node's directory) plus its control words."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
    tensors = many_tensors()
    sender = RefitSender(lambda dtype: iter(tensors.items()), 0, True, CPU, SETTINGS)
    info = sender.prepare_refit_info()
    layout = StreamLayout(info, SETTINGS.bucket_bytes)
    spec = RingSpec.for_layout(layout, readers=2)
    assert layout.total_bytes > 20 * refit_staging_bytes(layout.slot_bytes, 0)
    peak = [0]
    try:
        for version in (1, 2, 3):
            stream = sender.prepare_weights_for_ipc({0: 2})
            assert stream.version == version and stream.plan == layout.plan()
            outs: list[dict] = [{}, {}]
            readers = [
                threading.Thread(target=read_stream, args=(stream, r, info, outs[r], 0.002 * r))
                for r in range(2)
            ]
            for r in readers:
                r.start()
            for keys in stream.plan:  # bucket by bucket, measuring between them
                sender.get_weights_ipc_handles(keys)
                peak[0] = max(peak[0], ring_bytes_on_disk(tmp_path))
            for r in readers:
                r.join()
            sender.finish_weights_ipc()
            for out in outs:
                assert "error" not in out
                for name, tensor in tensors.items():
                    assert_bitwise_equal(out[name], tensor)
        assert peak[0] == spec.nbytes
        assert spec.nbytes - refit_staging_bytes(layout.slot_bytes, 0) < 256  # control words only
        assert RING_SLOTS == 2
    finally:
        sender.close()
    assert ring_bytes_on_disk(tmp_path) == 0  # unlinked at close


def test_keys_must_be_whole_buckets_of_the_plan_in_order():
    tensors = many_tensors(6)
    sender = RefitSender(lambda dtype: iter(tensors.items()), 0, True, CPU, SETTINGS)
    try:
        sender.prepare_refit_info()
        stream = sender.prepare_weights_for_ipc({})  # no ring: this rank only exports
        assert stream is None
        plan = StreamLayout(sender.info, 256).plan()
        assert len(plan) > 2
        with pytest.raises(RefitError, match="stream is at bucket 0"):
            sender.get_weights_ipc_handles(plan[1])
        assert sender.get_weights_ipc_handles(plan[0] + plan[1]) is None
        with pytest.raises(RefitError, match="request whole buckets"):
            sender.get_weights_ipc_handles(["not-a-weight"])
    finally:
        sender.close()


def test_a_reader_that_finds_a_corrupt_bucket_aborts_the_stream_for_everyone(monkeypatch):
    """Fault injection flips a byte after the checksum: the reader refuses the bucket and
    aborts the stream; the writer stops waiting for it (and drains its export), the other
    reader stops too; the next stream goes through."""
    monkeypatch.setenv(
        fault_injection.FAULTS_ENV,
        json.dumps([{"point": "refit.pack", "bucket": 3, "action": "corrupt"}]),
    )
    fault_injection._armed.cache_clear()
    tensors = many_tensors()
    sender = RefitSender(lambda dtype: iter(tensors.items()), 0, True, CPU, SETTINGS)
    try:
        info = sender.prepare_refit_info()
        for attempt in range(2):
            stream = sender.prepare_weights_for_ipc({0: 2})
            outs: list[dict] = [{}, {}]
            readers = [threading.Thread(target=read_stream, args=(stream, r, info, outs[r]))
                       for r in range(2)]
            for r in readers:
                r.start()
            keys = [n for b in stream.plan for n in b]
            if attempt == 0:
                with pytest.raises(RefitError, match="aborted"):
                    sender.get_weights_ipc_handles(keys)
            else:
                sender.get_weights_ipc_handles(keys)
            for r in readers:
                r.join()
            sender.finish_weights_ipc()
            if attempt == 0:
                assert any("bucket 3 of refit version 1 is corrupt" in o.get("error", "")
                           for o in outs)
                assert all("error" in o for o in outs)
            else:
                assert all("error" not in o for o in outs)
    finally:
        sender.close()
        fault_injection._armed.cache_clear()


_WRITER = """
import sys, time, torch
from nemo_rl.models.generation.refit.interfaces import RefitSettings
from nemo_rl.models.generation.refit.sender import RefitSender
sys.path.insert(0, sys.argv[1])
from test_refit_buckets import many_tensors
tensors = many_tensors()
settings = RefitSettings(bucket_bytes=256, dtype=None, timeout_s=30.0, checksums=True)
sender = RefitSender(lambda dtype: iter(tensors.items()), 0, True, torch.device("cpu"), settings)
sender.prepare_refit_info()
stream = sender.prepare_weights_for_ipc({0: 1})
import pickle
data = pickle.dumps(stream)
sys.stdout.buffer.write(len(data).to_bytes(8, "little") + data)
sys.stdout.buffer.flush()
sender.get_weights_ipc_handles(stream.plan[0])  # then the ring is full: it waits, and is killed
time.sleep(60)
"""


def test_a_reader_notices_a_killed_writer_within_a_poll():
    """The writer process is killed mid-stream: the reader fails at once, naming it, not
    after its timeout."""
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(Path(__file__).parent)],
        stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        import pickle

        size = int.from_bytes(writer.stdout.read(8), "little")
        stream = pickle.loads(writer.stdout.read(size))
        out: dict = {}
        reading = threading.Thread(
            target=read_stream, args=(stream, 0, info_of(many_tensors()), out, 0.0, 300.0)
        )
        reading.start()
        time.sleep(1.0)
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(timeout=30)
        tick = time.perf_counter()
        reading.join(timeout=30)
        assert not reading.is_alive() and time.perf_counter() - tick < 10
        assert "the ring's writer" in out["error"] and "died" in out["error"]
        assert "layer0" in out  # what arrived before the kill was delivered
    finally:
        if writer.poll() is None:
            writer.kill()
        remove_stale_segments()


def test_a_ring_is_only_read_on_its_own_node(monkeypatch):
    monkeypatch.setenv(NODE_ID_ENV, "node-a")
    buffer, ring = create_ring(RingSpec(256, 1), CPU, "policy rank 0")
    try:
        from nemo_rl.models.generation.refit.ipc import ring_handle

        handle = ring_handle(buffer, ring.spec, "policy rank 0")
        assert handle.node_id == "node-a"
        attach_ring(handle)[0].close()
        monkeypatch.setenv(NODE_ID_ENV, "node-b")
        with pytest.raises(RefitError, match="policy rank 0 lives on node node-a and this "
                                             "process runs on node node-b"):
            attach_ring(handle)
    finally:
        buffer.close()


# ------------------------------------------------------------------------------ the refit plan


def test_the_plan_gives_each_node_one_ring_read_by_every_engine_rank_there():
    # two nodes, two policy ranks each; engines of TP=2 (one per node)
    rings = plan_rings(["a", "a", "b", "b"], [["a", "a"], ["b", "b"]])
    assert [(r.writer, r.readers, r.place) for r in rings] == [
        (0, ((0, 0), (0, 1)), "a"), (2, ((1, 0), (1, 1)), "b")
    ]
    assert [(ring.writer, reader) for ring, reader in engine_reads(rings, 1, 2)] == [(2, 0), (2, 1)]
    # per device (GPU): every policy rank writes the ring of the engine rank on its device
    devices = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    rings = plan_rings(devices, [[("a", 0)], [("a", 1)], [("b", 0)], [("b", 1)]])
    assert [(r.writer, r.readers) for r in rings] == [(k, ((k, 0),)) for k in range(4)]
    with pytest.raises(RefitError, match="rank 0 of engine 1 runs at 'c', where no policy rank"):
        plan_rings(["a", "b"], [["a"], ["c"]])


# ------------------------------------------------------------------------------ broadcast group


def _collective_rank(rank: int, port: int, info: RefitInfo, queue: multiprocessing.Queue) -> None:
    """Two streams: a good one, then one whose export breaks off at the 'big' tensor. Each
    receiver has a ring of its own and a reader thread standing in for its engine."""
    from nemo_rl.models.generation.refit.collective import RefitCollective

    try:
        group = RefitCollective("127.0.0.1", port, 3, rank, CPU, timeout_s=60)
        tensors = named_tensors()
        broken = {**tensors, "big": torch.zeros(3)}
        layout = StreamLayout(info_of(tensors), 256)
        for stream in (tensors, broken):
            if rank == 0:
                packer = BucketPacker(layout, iter(stream.items()), 3)
                try:
                    group.send(
                        packer, [torch.empty(layout.slot_bytes, dtype=torch.uint8) for _ in "ab"]
                    )
                    outcome: Any = "sent"
                except RefitError as err:
                    outcome = f"RefitError: {err}"
                queue.put((rank, outcome, torch.distributed.is_initialized()))
                continue
            mine = StreamLayout(info, 256)
            buffer, ring = create_ring(RingSpec.for_layout(mine, 1), CPU, "receiver")
            got: dict = {}

            def read(version: int) -> None:
                try:
                    for header, payload in ring.buckets(0, mine, version, 60):
                        got.update((n, t.clone()) for n, t in mine.tensors(header.index, payload))
                except RefitError as err:
                    got["error"] = str(err)

            readers: list[threading.Thread] = []

            def started(version: int) -> None:
                readers.append(threading.Thread(target=read, args=(version,)))
                readers[0].start()

            try:
                group.receive(mine, ring, started, 60)
                outcome = None
            except RefitError as err:
                outcome = f"RefitError: {err}"
            for r in readers:
                r.join()
            buffer.close()
            queue.put((rank, outcome or got, group.broken))
        group.close()
    except Exception as err:  # report instead of hanging the parent
        queue.put((rank, f"{type(err).__name__}: {err}", None))


@pytest.mark.slow
def test_broadcast_group_delivers_exact_buckets_into_rings_and_failures_stay_contained():
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
    received, broken = results[1][0]
    assert broken is False and "error" not in received
    for name, tensor in tensors.items():
        assert_bitwise_equal(received[name], tensor)
    message, broken = results[2][0]
    assert "disagrees with the refit info" in message
    assert broken is False  # it drained the stream: the group is still usable
    # stream 2: the sender's export breaks off; every receiver is released at once (rank 2
    # reports its own first problem, the disagreement), the group stays usable
    assert "the export yielded 'big' (3,)" in results[0][1][0]
    assert "the sender gave up" in results[1][1][0]
    assert "disagrees with the refit info" in results[2][1][0]
    assert results[1][1][1] is False and results[2][1][1] is False
