"""What a checkpoint's manifest costs: sealing at save time and verifying at resume time,
against reading the same files and against loading them.

Writes a checkpoint-like folder (``--files`` shards, each a ``torch.save`` of float32 tensors
of 1-16 MiB, ``--total-mb`` in all, plus a few small files), seals it
(:func:`~nemo_rl.utils.checkpoint_manifest.seal_folder`), then times, best of ``--repeats``: a
plain read of every file (the same 8 MiB chunks and thread pool as hashing), ``torch.load`` of
every shard (a load's floor: real loads also reshard and build optimizer state),
:func:`verify_folder` in ``sizes`` and ``checksums`` mode, a resume (checksum verification
then ``torch.load``), and the seal. Each is timed twice: ``warm``, the files in the page cache
(hashing against memory-speed reads: the worst case for the ratios), and ``cold``, the files
evicted from the page cache first (``posix_fadvise(DONTNEED)``, no root needed), as a resume
after a restart on another node finds them. The figure to read: how much longer a cold resume
takes with checksum verification than the load alone.

    python benchmarks/bench_checkpoint_verify.py --total-mb 512 --files 8
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import timeit
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from nemo_rl.utils.checkpoint_manifest import HASH_THREADS, seal_folder, verify_folder

_CHUNK = 8 * 1024 * 1024


def make_checkpoint(root: Path, total_mb: int, files: int) -> list[Path]:
    """Write ``files`` shards of random float32 tensors (``total_mb`` MiB in all) and small
    metadata files under ``root``; returns the shards."""
    (root / "policy").mkdir(parents=True)
    rng = random.Random(0)
    shards = []
    for i in range(files):
        left, tensors = total_mb * 2**20 // files // 4, {}
        while left > 0:
            numel = min(left, rng.randint(1, 16) * 2**18)
            tensors[f"layer{len(tensors)}.weight"] = torch.randn(numel)
            left -= numel
        shards.append(root / "policy" / f"__{i}_0.distcp")
        torch.save(tensors, shards[-1])
    for name in ("policy/.metadata", "policy/common.pt", "training_info.json", "rng_state.pt"):
        (root / name).write_bytes(os.urandom(4096))
    return shards


def read_all(root: Path) -> None:
    """Read every file under ``root`` once, in parallel as hashing does."""

    def read(path: Path) -> None:
        with open(path, "rb", buffering=0) as f:
            while f.read(_CHUNK):
                pass

    paths = [p for p in root.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        list(pool.map(read, paths))


def evict(root: Path) -> None:
    """Drop ``root``'s files from the page cache (they are clean: the seal fsynced them)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def best_time(fn: Callable[[], object], repeats: int, before: Callable[[], None]) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn``, each after ``before()`` (untimed)."""
    return min(timeit.repeat(fn, setup=before, number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-mb", type=int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--files", type=int, default=8, help="number of shard files")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="parent folder (default: the temp dir)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_verify_", dir=args.dir))
    try:
        ckpt = root / "step_1"
        shards = make_checkpoint(ckpt, args.total_mb, args.files)
        nbytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        seal = best_time(lambda: seal_folder(ckpt), args.repeats, lambda: None)

        def load() -> None:
            for path in shards:
                torch.load(path)

        def resume() -> None:
            assert verify_folder(ckpt, "checksums") is None
            load()

        ops = {
            "plain read": lambda: read_all(ckpt),
            "torch.load": load,
            "verify sizes": lambda: verify_folder(ckpt, "sizes"),
            "verify checksums": lambda: verify_folder(ckpt, "checksums"),
            "verify + torch.load": resume,
        }
        times = {
            (name, cache): best_time(op, args.repeats, before)
            for cache, before in (("warm", lambda: None), ("cold", lambda: evict(ckpt)))
            for name, op in ops.items()
        }
    finally:
        shutil.rmtree(root)
    gib = nbytes / 2**30
    print(f"checkpoint: {nbytes / 2**20:.0f} MiB in {args.files} shards, {HASH_THREADS} threads")
    print(f"seal (fsync + manifest), warm: {seal * 1e3:.1f} ms")
    for cache in ("warm", "cold"):
        read, load_s = times["plain read", cache], times["torch.load", cache]
        for name in ops:
            t = times[name, cache]
            print(f"{cache} {name:20s} {t * 1e3:8.1f} ms  {gib / t:6.2f} GiB/s  "
                  f"{t / read:5.2f} x read  {t / load_s:5.2f} x torch.load")
    for cache in ("warm", "cold"):
        extra = times["verify + torch.load", cache] / times["torch.load", cache] - 1
        print(f"{cache}: checksum verification adds {extra * 100:.0f} % to a load")


if __name__ == "__main__":
    main()
