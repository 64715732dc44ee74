"""Colocated refit transport between two processes vs a copy of the same bytes on the device.

The transport of a colocated refit without the models around it: a writer process
(:class:`RefitSender`, export = a fixed set of Llama-shaped bf16 tensors already on the
device) packs bucket after bucket into its ring of two slots (``refit/ring.py``); a reader
process maps the ring, checks every bucket where it lies as its record appears, and "loads" it
(copies every tensor into its own preallocated tensors, as an engine's loaders do) before
releasing the slot for the next bucket. On CUDA the ring is a CUDA IPC allocation; on CPU a
``/dev/shm`` file (the path the CPU tests and bench_refit.py take, here without Ray and vLLM).

Reported, median of ``--repeats`` streams after one warm-up:

* ``transfer``: from the writer starting to pack to the reader having loaded the last bucket
  (both read ``time.perf_counter``, one clock for all processes on Linux): pack, check and load
  of every byte, overlapped bucket by bucket;
* ``pack`` (writer: copy, + checksum with ``--checksums``), ``load`` (reader: one copy of
  every tensor, its slots' waits excluded);
* baseline: ``copy_`` of the same number of bytes between two buffers on the same device in
  the writer process (device-to-device on GPU; memcpy with the process's torch threads on
  CPU), best of 3, right before each stream. A ring transfer copies every byte twice (pack,
  load): 0.5 of the baseline is what two back-to-back copies give, more needs them overlapped.

Run (GPU: the CUDA IPC path; ``--device cpu`` runs the same harness on shared memory):

    PYTHONPATH=. python benchmarks/bench_ipc_refit_transport.py --device cuda --layers 16
    PYTHONPATH=. python benchmarks/bench_ipc_refit_transport.py --device cpu --layers 2

docs/performance.md ("GPU check") records the GPU runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.memcpy_baseline import Memcpy, synchronize


def llama_tensors(
    layers: int, hidden: int, device: torch.device, *, kv: int | None = None, vocab: int = 32768
) -> dict[str, torch.Tensor]:
    """HF-named bf16 tensors of a Llama with ``layers`` layers of width ``hidden`` (MLP 4x,
    K/V projections of ``kv`` rows, by default ``hidden // 4``: 4 query heads per KV head),
    random, on ``device``."""
    kv, mlp = kv or hidden // 4, 4 * hidden
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    generator = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        for name, shape in shapes.items()
    }


def receiver_main(device_name: str, inbox: Any, outbox: Any) -> None:
    """The reading process: for each stream, map the ring, load every bucket as it arrives
    (one copy into its own tensors, as an engine's loaders), report."""
    from nemo_rl.models.generation.refit.buckets import StreamLayout
    from nemo_rl.models.generation.refit.ipc import attach_ring

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    targets: dict[str, torch.Tensor] = {}
    try:
        info = inbox.get()
        outbox.put("ready")
        while (stream := inbox.get()) is not None:
            layout = StreamLayout(info, stream.bucket_bytes)
            buffer, ring = attach_ring(stream.ring)
            load_s = 0.0
            for header, payload in ring.buckets(0, layout, stream.version, timeout_s=120):
                tick = time.perf_counter()
                for name, tensor in layout.tensors(header.index, payload):
                    if name not in targets:
                        targets[name] = torch.empty_like(tensor, device=device)
                    targets[name].copy_(tensor)
                synchronize(device)
                load_s += time.perf_counter() - tick
            outbox.put({"loaded": time.perf_counter(), "load_s": load_s})
            buffer.close()
    except Exception as err:  # report instead of leaving the writer waiting
        outbox.put(f"{type(err).__name__}: {err}")


@dataclass(frozen=True)
class TransportResult:
    """Medians over the timed streams (seconds; bytes/s for ``baseline``).

    Attributes:
        nbytes: bytes of one stream (all tensors).
        num_tensors: tensors in the stream.
        ring_bytes: bytes the ring stages (its two slots).
        transfer_s: pack start -> the reader has loaded the last bucket.
        pack_s: the writer's pack (+ checksum).
        load_s: the reader's engine-style load (one copy of every tensor).
        baseline: bytes/s of ``copy_`` of the same bytes on the device (best of 3 per stream).
        ratios: per stream, transfer bytes/s over that stream's baseline.
    """

    nbytes: int
    num_tensors: int
    ring_bytes: int
    transfer_s: float
    pack_s: float
    load_s: float
    baseline: float
    ratios: list[float]


def measure_transport(
    device: torch.device, layers: int, hidden: int, bucket_mb: int, repeats: int,
    vocab: int = 32768, checksums: bool = False,
) -> TransportResult:
    """Run ``repeats`` + 1 streams (the first warms up) writer -> reader process on ``device``;
    ``checksums`` as ``policy.refit_checksums`` (off by default there too): the writer sums
    every bucket and the reader checks it, one more read of the bytes on each side.

    Raises:
        RuntimeError: ``device`` is CUDA and this machine has none, or the reader failed (its
            error, e.g. a checksum mismatch, is in the message).
    """
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "the CUDA IPC transport needs a CUDA GPU, which this machine does not have; "
            "device 'cpu' runs the same transport over shared memory"
        )
    from nemo_rl.models.generation.refit.interfaces import RefitSettings
    from nemo_rl.models.generation.refit.sender import RefitSender

    tensors = llama_tensors(layers, hidden, device, vocab=vocab)
    settings = RefitSettings(bucket_mb * 1024**2, None, timeout_s=120.0, checksums=checksums)
    sender = RefitSender(lambda dtype: iter(tensors.items()), 0, True, device, settings)
    info = sender.prepare_refit_info()
    nbytes = sum(t.numel() * t.itemsize for t in tensors.values())

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receiver_main, args=(str(device), inbox, outbox))
    child.start()
    memcpy, rows, ring_bytes = Memcpy(nbytes, device), [], 0
    try:
        inbox.put(info)
        if (answer := outbox.get(timeout=300)) != "ready":
            raise RuntimeError(f"reader: {answer}")
        for repeat in range(repeats + 1):  # the first one warms up both sides
            baseline = memcpy.bandwidth()
            stream = sender.prepare_weights_for_ipc({0: 1})
            ring_bytes = stream.ring.spec.slots * stream.ring.spec.slot_bytes
            inbox.put(stream)
            start = time.perf_counter()
            timings = sender.get_weights_ipc_handles([n for b in stream.plan for n in b])
            report = outbox.get(timeout=300)
            sender.finish_weights_ipc()
            if not isinstance(report, dict):
                raise RuntimeError(f"reader: {report}")
            if repeat:
                rows.append((report["loaded"] - start, timings["pack_s"], report["load_s"],
                             baseline))
    finally:
        inbox.put(None)
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        sender.close()

    transfer, pack, load, baseline = (statistics.median(c) for c in zip(*rows))
    return TransportResult(
        nbytes, len(tensors), ring_bytes, transfer, pack, load, baseline,
        [nbytes / r[0] / r[-1] for r in rows],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--checksums", action="store_true",
                        help="checksum every bucket (policy.refit_checksums: true)")
    args = parser.parse_args()
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    try:
        result = measure_transport(device, args.layers, args.hidden, args.bucket_mb, args.repeats,
                                   checksums=args.checksums)
    except RuntimeError as err:
        raise SystemExit(str(err)) from None

    nbytes, baseline, ratios = result.nbytes, result.baseline, result.ratios
    name = "device-to-device copy" if device.type == "cuda" else "memcpy"
    print(f"command: PYTHONPATH=. python benchmarks/bench_ipc_refit_transport.py --device "
          f"{args.device} --layers {args.layers} --hidden {args.hidden} --bucket-mb "
          f"{args.bucket_mb} --repeats {args.repeats}{' --checksums' * args.checksums}")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{result.num_tensors} bf16 tensors, {nbytes / 1e9:.3f} GB, buckets of "
          f"{args.bucket_mb} MiB")
    print(f"{name} of the same bytes: {baseline / 1e9:.1f} GB/s (median of the runs' best of 3)")
    print(f"ring: {result.ring_bytes / 1e6:.1f} MB staged ({result.ring_bytes / nbytes:.3f} of "
          "the stream)")
    for label, seconds in (("transfer (pack start -> last bucket loaded)", result.transfer_s),
                           ("  pack (writer)", result.pack_s),
                           ("  engine-style load (reader, one copy)", result.load_s)):
        print(f"{label:<46} {seconds * 1e3:9.2f} ms {nbytes / seconds / 1e9:8.1f} GB/s "
              f"{nbytes / seconds / baseline:6.2f} x {name}")
    print(f"transfer / {name}, per run: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}) (two copies back to back: 0.5)")


if __name__ == "__main__":
    main()
