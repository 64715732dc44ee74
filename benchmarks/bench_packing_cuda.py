"""Sequence packing against padded micro-batches on one GPU, on a GRPO-shaped batch.

The CPU worker benchmark (``bench_megatron_worker_train.py``) measures packing on 2 cores; this
one asks the cluster user's question: on a GPU, with the local layer spec (no
TransformerEngine: packed attention is :mod:`nemo_rl.models.megatron.packed_attention`), does
packing a rollout's skewed responses pay?

Workload: ``MegatronPolicyWorker.train`` (single rank, in-process) with ``NLLLoss`` on the
GPU check's 0.97 B Llama in bf16 (``gpu_check.LLAMA_1B``); one global batch of ``--samples``
rows, each a 128-token prompt plus a response of seeded length: 90 % drawn uniformly from
1-512 tokens, 10 % at the ``--max-response`` limit (the shape of a GRPO step whose few longest
responses hit the limit). Modes, one worker each, every mode's step on the same batch:

* ``padded``: micro-batches of ``--mbs`` rows, each padded to its longest row;
* ``packed``: ``policy.sequence_packing`` at a budget of ``--mbs`` x the longest row's tokens.

Reported per mode: median step time of ``--steps`` after one warm-up, real tokens/s, and MFU
(the real tokens' model FLOPs, ``bench_megatron_worker_train.model_flops``, over the measured
bf16 ``torch.mm`` peak), then packed / padded in tokens/s. ``--device cpu`` runs the same code
at toy sizes in fp32 (a smoke test: the numbers mean nothing there).

    PYTHONPATH=. python benchmarks/bench_packing_cuda.py                 # on a GPU machine
    PYTHONPATH=. python benchmarks/bench_packing_cuda.py --device cpu    # smoke test
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_megatron_worker_train import (
    grpo_response_lengths,
    make_batch,
    matmul_peak_flops,
    model_flops,
    time_worker_steps,
)
from benchmarks.gpu_check import LLAMA_1B, TINY, VOCAB_ROWS

PROMPT_TOKENS = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--max-response", type=int, default=2048)
    parser.add_argument("--mbs", type=int, default=4, help="rows per padded micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from nemo_rl.models.tiny import build_tiny_model

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (--device cpu: a smoke test)")
        sizes, precision, peak_n = LLAMA_1B, "bfloat16", 8192
    else:
        sizes, precision, peak_n = TINY, "float32", 256
        args.samples, args.max_response = min(args.samples, 16), min(args.max_response, 64)
    responses = grpo_response_lengths(args.samples, args.max_response)
    lengths = tuple(PROMPT_TOKENS + n for n in responses)
    seq = PROMPT_TOKENS + args.max_response
    batch = make_batch(lengths, seq)
    peak = matmul_peak_flops(peak_n, 10, args.device, precision)
    path = str(build_tiny_model("llama", **sizes))
    flops = model_flops(lengths, sizes, VOCAB_ROWS)
    print(f"{args.samples} samples, {sum(lengths):,} real tokens in [{args.samples}, {seq}] "
          f"(response lengths median {statistics.median(lengths) - PROMPT_TOKENS:.0f}, "
          f"{sum(n == seq for n in lengths)} at the limit); {precision} peak "
          f"{peak / 1e12:.1f} TFLOP/s", flush=True)
    rate = {}
    for mode in ("padded", "packed"):
        times = time_worker_steps(
            path, batch, args.mbs, args.steps, mode, args.mbs * seq, precision
        )
        step = statistics.median(times)
        rate[mode] = sum(lengths) / step
        print(f"{mode:7s} step {step:.3f} s (of {[round(t, 3) for t in times]}), "
              f"{rate[mode]:,.0f} real tokens/s, MFU {flops / step / peak:.1%}", flush=True)
    print(f"packed / padded tokens/s: {rate['packed'] / rate['padded']:.2f}")


if __name__ == "__main__":
    main()
