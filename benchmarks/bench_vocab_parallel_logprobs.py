"""Peak memory and time of chunked vocab-parallel log-probs vs a naive log_softmax + gather.

Workload: logits [B=4, S=2048, V=32000] float32 on CPU (1 tensor = 1.05 GB), forward + backward of
``sum(w * logprobs)``. Two variants:

* ``chunked``: ``from_parallel_logits_to_logprobs(..., tp_group=None, chunk_size=C)``.
* ``naive``: ``log_softmax(logits, -1).gather(-1, next_targets)`` weighted by a mask that drops
  the last position (no slicing of [B, S, V] tensors, so the naive baseline pays no extra copies).

Memory method. tracemalloc does not see torch's allocator and torch keeps no CPU allocator
statistics, so each variant runs in a fresh subprocess and reads the kernel's resident-set
high-water mark (``VmHWM`` in /proc/self/status). After the input logits exist (pages touched) the
mark is reset (``echo 5 > /proc/self/clear_refs``) and the baseline ``VmRSS`` read; after
forward + backward, ``VmHWM - baseline`` is the peak of all memory touched meanwhile. The
gradient w.r.t. the logits (one [B, S, V] tensor, unavoidable for both variants) is subtracted,
leaving the bytes of temporaries beyond the input logits and their gradient: the number the
chunking is meant to shrink. This is sound for tensors of this size because glibc serves
allocations above its mmap threshold (<= 32 MiB) with fresh mmaps that return to the kernel on
free, so RSS follows live tensors; pages are counted only once touched, i.e. bytes really used.
The reset is repeated before every timed repeat and the largest peak reported. The chunked
forward's [B, C, V] work buffer is freed before backward allocates the gradient, so its extra
peak is near zero; the table also prints the peak including the gradient.

Time: median wall time of ``--repeats`` forward + backward passes after one warm-up pass.

Run (about a minute on 2 cores, ~5 GB of RAM for the naive variant):

    PYTHONPATH=. python benchmarks/bench_vocab_parallel_logprobs.py [--chunk-size 256] [--repeats 3]

Targets: extra-memory ratio chunked/naive <= 0.25, time ratio chunked/naive <= 1.25.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

BATCH, SEQ, VOCAB = 4, 2048, 32000


def _status_kib(field: str) -> int:
    """A memory field of /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak() -> int:
    """Reset the RSS high-water mark; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def run_variant(variant: str, chunk_size: int, repeats: int) -> dict[str, float]:
    """Measure one variant in this process; returns peak extra bytes and per-repeat seconds."""
    import torch

    from nemo_rl.distributed.model_utils import from_parallel_logits_to_logprobs

    torch.manual_seed(0)
    logits = torch.randn(BATCH, SEQ, VOCAB).requires_grad_()
    target = torch.randint(0, VOCAB, (BATCH, SEQ))
    weights = torch.rand(BATCH, SEQ)
    next_target = torch.nn.functional.pad(target[:, 1:], (0, 1)).unsqueeze(-1)
    naive_weights = torch.nn.functional.pad(weights[:, 1:], (0, 1))
    grad_bytes = logits.numel() * logits.element_size()

    def step() -> None:
        logits.grad = None
        if variant == "chunked":
            out = from_parallel_logits_to_logprobs(logits, target, 0, VOCAB, None, chunk_size=chunk_size)
            (out * weights).sum().backward()
        else:
            out = torch.log_softmax(logits, dim=-1).gather(-1, next_target).squeeze(-1)
            (out * naive_weights).sum().backward()

    step()  # warm-up
    times, peaks = [], []
    for _ in range(repeats):
        logits.grad = None
        base = _reset_peak()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        peaks.append(_status_kib("VmHWM") * 1024 - base - grad_bytes)
    return {"extra_peak_bytes": max(peaks), "grad_bytes": grad_bytes, "seconds": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-size", type=int, default=256, help="sequence positions per chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=["chunked", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # child process: one variant, JSON on stdout
        print(json.dumps(run_variant(args.variant, args.chunk_size, args.repeats)))
        return

    results = {}
    for variant in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant, "--chunk-size", str(args.chunk_size),
               "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])

    mib = 1024**2
    print(f"B={BATCH} S={SEQ} V={VOCAB} float32 CPU, forward+backward, chunk_size={args.chunk_size}, "
          f"median of {args.repeats}")
    print(f"{'variant':<10}{'extra peak (MiB)':>18}{'peak incl. grad (MiB)':>24}{'time (s)':>10}")
    for variant, r in results.items():
        total = r["extra_peak_bytes"] + r["grad_bytes"]
        print(f"{variant:<10}{r['extra_peak_bytes'] / mib:>18.0f}{total / mib:>24.0f}{r['seconds']:>10.3f}")
    chunked, naive = results["chunked"], results["naive"]
    mem_ratio = chunked["extra_peak_bytes"] / naive["extra_peak_bytes"]
    total_ratio = (chunked["extra_peak_bytes"] + chunked["grad_bytes"]) / (
        naive["extra_peak_bytes"] + naive["grad_bytes"]
    )
    print(f"peak-memory ratio chunked/naive (extra):      {mem_ratio:.3f} (target <= 0.25)")
    print(f"peak-memory ratio chunked/naive (incl. grad): {total_ratio:.3f}")
    print(f"time ratio chunked/naive:                     {chunked['seconds'] / naive['seconds']:.3f} "
          "(target <= 1.25)")


if __name__ == "__main__":
    main()
