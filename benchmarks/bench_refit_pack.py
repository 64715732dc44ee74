"""The refit sender's pack alone (copy into buckets, with or without checksums) vs memcpy.

Workload: random bf16 tensors of the shapes bench_refit.py's 0.24 B Llama exports (hidden
1024, 16 layers, 16 query / 8 KV heads of 64, MLP 4096, a 1,000-token vocabulary), packed by
:class:`BucketPacker` into 64 MiB buckets of one buffer. Variants, each the best of
``--repeats`` packs of the whole stream, alternated ``--rounds`` times:

* ``pack, checksums on / off``: :class:`BucketPacker` as the sender runs it (4 MiB chunks
  shared by ``PACK_THREADS`` Python threads, each copied and, when on, summed while in cache,
  with numpy), and the same on 1 thread;
* ``numba one-pass copy + sum``: the pack the project used before (a JIT kernel that stores
  each 8-byte word and adds it to the sum in the same pass, 2 threads), kept here, and only
  here, to show what dropping the numba dependency costs; run only where numba is installed;
* baseline: ``copy_`` of the stream's bytes between two warm buffers, 1 and 2 torch threads.

Run (about 30 s, ~2 GB of RAM):

    PYTHONPATH=. python benchmarks/bench_refit_pack.py [--rounds 3] [--repeats 5]

Measured numbers: docs/performance.md (refit section).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import numpy as np
import torch

from benchmarks.bench_ipc_refit_transport import llama_tensors
from benchmarks.memcpy_baseline import Memcpy
from nemo_rl.models.generation.refit import buckets
from nemo_rl.models.generation.refit.buckets import BucketPacker, StreamLayout

CHUNK_WORDS = 512 * 1024  # 4 MiB of 8-byte words per numba task


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tick)
    return best


def numba_copy_and_sum() -> Callable[[np.ndarray, np.ndarray], int]:
    """``dst[:] = src`` and the sum of ``src``'s uint64 words mod 2**64, one pass per 4 MiB
    chunk, chunks shared by two threads (the former sender's kernel)."""
    import numba

    @numba.njit(nogil=True, cache=False)
    def kernel(dst: np.ndarray, src: np.ndarray) -> np.uint64:
        total = np.uint64(0)
        for i in range(src.shape[0]):
            word = src[i]
            dst[i] = word
            total += word
        return total

    pool = ThreadPoolExecutor(1)

    def run(dst: np.ndarray, src: np.ndarray) -> int:
        chunks = iter(
            [(dst[lo : lo + CHUNK_WORDS], src[lo : lo + CHUNK_WORDS])
             for lo in range(0, src.shape[0], CHUNK_WORDS)]
        )
        work = lambda: sum(int(kernel(d, s)) for d, s in chunks)  # noqa: E731
        helper = pool.submit(work)
        return (work() + helper.result()) & ((1 << 64) - 1)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    # bench_refit.py's model: hidden 1024, 16 layers, 8 KV heads of 64, MLP 4096, 1,000 tokens
    tensors = llama_tensors(16, 1024, torch.device("cpu"), kv=512, vocab=1000)
    layout = StreamLayout({n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}, 64 << 20)
    out = torch.empty(layout.total_bytes, dtype=torch.uint8)
    memcpy = Memcpy(layout.total_bytes)

    # every bucket into its own place of one buffer of the stream's size (as memcpy writes)
    starts = list(itertools.accumulate(layout.bucket_sizes, initial=0))

    def pack(checksums: bool, threads: int) -> Callable[[], float]:
        def run() -> None:
            with mock.patch.object(buckets, "PACK_THREADS", threads):
                packer = BucketPacker(layout, iter(tensors.items()), 1, checksums)
                for index in range(layout.num_buckets):
                    packer.fill(index, out[starts[index] : starts[index + 1]])

        return lambda: layout.total_bytes / best_seconds(run, args.repeats)

    threads = buckets.PACK_THREADS
    variants = {
        "pack, checksums on, 1 thread": pack(True, 1),
        f"pack, checksums on, {threads} threads": pack(True, threads),
        "pack, checksums off, 1 thread": pack(False, 1),
        f"pack, checksums off, {threads} threads": pack(False, threads),
        "memcpy, 1 thread": lambda: memcpy.bandwidth(1, args.repeats),
        "memcpy, 2 threads": lambda: memcpy.bandwidth(2, args.repeats),
    }
    if importlib.util.find_spec("numba") is not None:
        kernel = numba_copy_and_sum()
        # the same stream of words as the pack (one piece per tensor, 8-byte aligned)
        sources = [t.reshape(-1).view(torch.uint8).numpy().view(np.uint64) for t in tensors.values()]
        words = out[: sum(s.nbytes for s in sources)].numpy().view(np.uint64)

        def one_pass() -> None:
            offset = 0
            for src in sources:
                kernel(words[offset : offset + src.shape[0]], src)
                offset += src.shape[0]

        one_pass()  # compile
        variants["numba one-pass copy + sum, 2 threads"] = (
            lambda: layout.total_bytes / best_seconds(one_pass, args.repeats)
        )
    pack(True, 1)()  # fault the pages in
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            results[name].append(run())

    print(f"command: PYTHONPATH=. python benchmarks/bench_refit_pack.py --rounds {args.rounds} "
          f"--repeats {args.repeats}")
    print(f"stream: {layout.total_bytes / 1e9:.3f} GB bf16 in {layout.num_buckets} buckets of "
          "64 MiB; GB/s per round, best of the repeats")
    for name, rates in results.items():
        ratios = [r / m for r, m in zip(rates, results["memcpy, 2 threads"])]
        print(f"{name:<40} " + " ".join(f"{r / 1e9:6.2f}" for r in rates)
              + "   / 2-thread memcpy: " + " ".join(f"{q:.2f}" for q in ratios))


if __name__ == "__main__":
    main()
