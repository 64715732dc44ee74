"""The refit sender's pack alone (copy into buckets + checksum), in this process, vs memcpy.

Workload: random bf16 tensors of the shapes bench_refit.py's 0.24 B Llama exports (hidden
1024, 16 layers, 16 query / 8 KV heads of 64, MLP 4096, a 1,000-token vocabulary), packed by
:class:`BucketPacker` into 64 MiB buckets of one buffer. Variants, each the best of
``--repeats`` packs of the whole stream, alternated ``--rounds`` times:

* ``numba, N threads``: the pack as it runs (:mod:`nemo_rl.models.generation.refit.copy_checksum`,
  one-pass copy + sum, chunks shared by N threads; N = 1 and the module's ``THREADS``);
* ``torch copy, then sum``: each piece copied with ``copy_`` and summed with torch (the path
  CUDA buckets take; one thread and the process's torch threads);
* baseline: ``copy_`` of the stream's bytes between two warm buffers, 1 and 2 torch threads.

Run (about 30 s, ~2 GB of RAM):

    PYTHONPATH=. python benchmarks/bench_refit_pack.py [--rounds 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from unittest import mock

import torch

from benchmarks.bench_ipc_refit_transport import llama_tensors
from benchmarks.memcpy_baseline import Memcpy, torch_threads
from nemo_rl.models.generation.refit import buckets, copy_checksum
from nemo_rl.models.generation.refit.buckets import BucketPacker, StreamLayout


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        tick = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tick)
    return best


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

    def pack() -> None:
        packer = BucketPacker(layout, iter(tensors.items()), version=1)
        for index in range(layout.num_buckets):
            start, stop = layout.span(index)
            packer.fill(index, out[start:stop])

    def torch_pieces(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return sum(buckets._copy_then_sum(dst, src) for dst, src in pieces)

    def variant(
        numba_threads: int | None, torch_path: bool, intra_op_threads: int
    ) -> Callable[[], float]:
        """A measurement of the pack's bytes/s (best of the repeats)."""
        def run() -> None:
            with torch_threads(intra_op_threads), mock.patch.object(
                copy_checksum, "THREADS", numba_threads or copy_checksum.THREADS
            ):
                if torch_path:  # every piece takes the device path (torch copy, then sum)
                    with mock.patch.object(buckets, "copy_with_checksum", torch_pieces):
                        pack()
                else:
                    pack()
        return lambda: layout.total_bytes / best_seconds(run, args.repeats)

    variants = {
        "numba, 1 thread": variant(1, False, 1),
        f"numba, {copy_checksum.THREADS} threads": variant(None, False, 1),
        "torch copy, then sum, 1 thread": variant(None, True, 1),
        f"torch copy, then sum, {torch.get_num_threads()} threads": variant(
            None, True, torch.get_num_threads()
        ),
        "memcpy, 1 thread": lambda: memcpy.bandwidth(1, args.repeats),
        "memcpy, 2 threads": lambda: memcpy.bandwidth(2, args.repeats),
    }
    pack()  # compile the kernel, fault the pages in
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
        print(f"{name:<34} " + " ".join(f"{r / 1e9:6.2f}" for r in rates)
              + "   / 2-thread memcpy: " + " ".join(f"{q:.2f}" for q in ratios))


if __name__ == "__main__":
    main()
