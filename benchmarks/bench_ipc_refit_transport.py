"""Colocated refit transport between two processes vs a copy of the same bytes on the device.

The transport of a colocated refit without the models around it: a sender process
(:class:`RefitSender`, export = a fixed set of Llama-shaped bf16 tensors already on the
device) packs bucket after bucket into its shareable stream buffer and publishes each
bucket's record; a receiver process (:class:`RefitReceiver`) maps that buffer, checks every
bucket in place as its record appears, then "loads" (copies every tensor into its own
preallocated tensors, as an engine's loader does). On CUDA the buffer is a CUDA IPC
allocation; on CPU a ``/dev/shm`` file (the path the CPU tests and bench_refit.py take, here
without Ray and vLLM).

Reported, median of ``--repeats`` streams after one warm-up:

* ``transfer``: from the sender starting to pack to the receiver having checked the last
  bucket (both read ``time.perf_counter``, one clock for all processes on Linux);
* ``pack`` (sender: copy, + checksum with ``--checksums``), ``load`` (receiver: one copy of every tensor);
* baseline: ``copy_`` of the same number of bytes between two buffers on the same device in
  the sender process (device-to-device on GPU; memcpy with the process's torch threads on
  CPU), best of 3, right before each stream. Target (issue 6): transfer >= 0.5 of it.

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


def receiver_main(device_name: str, inbox: Any, outbox: Any, packing_done: Any) -> None:
    """The receiving process: map each stream, check it as it is packed, load, report."""
    from nemo_rl.models.generation.refit.receiver import RefitReceiver

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    targets: dict[str, torch.Tensor] = {}

    def load(weights: Any) -> None:  # an engine's loader: one copy into its own tensors
        for name, tensor in weights:
            if name not in targets:
                targets[name] = torch.empty_like(tensor, device=device)
            targets[name].copy_(tensor)
        synchronize(device)

    receiver = RefitReceiver(load, device)
    try:
        receiver.prepare_refit_info(inbox.get())
        outbox.put("ready")
        while (stream := inbox.get()) is not None:
            receiver.receive_weights_ipc_stream(
                stream, lambda: "finished" if packing_done.is_set() else None, timeout_s=120
            )
            checked = time.perf_counter()
            timings = receiver.commit_weight_update()
            outbox.put({"checked": checked, "load_s": timings["load_s"],
                        "receive_s": timings["receive_s"], "attach_s": timings["attach_s"]})
    except Exception as err:  # report instead of leaving the sender waiting
        outbox.put(f"{type(err).__name__}: {err}")
    finally:
        receiver.close()


@dataclass(frozen=True)
class TransportResult:
    """Medians over the timed streams (seconds; bytes/s for ``baseline``).

    Attributes:
        nbytes: bytes of one stream (all tensors).
        num_tensors: tensors in the stream.
        transfer_s: pack start -> the receiver has checked the last bucket.
        pack_s: the sender's pack (+ checksum).
        load_s: the receiver's engine-style load (one copy of every tensor).
        attach_s: the receiver mapping the sender's buffer (0 when the mapping was kept).
        baseline: bytes/s of ``copy_`` of the same bytes on the device (best of 3 per stream).
        ratios: per stream, transfer bytes/s over that stream's baseline.
    """

    nbytes: int
    num_tensors: int
    transfer_s: float
    pack_s: float
    load_s: float
    attach_s: float
    baseline: float
    ratios: list[float]


def measure_transport(
    device: torch.device, layers: int, hidden: int, bucket_mb: int, repeats: int,
    vocab: int = 32768, checksums: bool = False,
) -> TransportResult:
    """Run ``repeats`` + 1 streams (the first warms up) sender -> receiver process on ``device``;
    ``checksums`` as ``policy.refit_checksums`` (off by default there too): the sender sums
    every bucket and the receiver checks it, one more read of the bytes on each side.

    Raises:
        RuntimeError: ``device`` is CUDA and this machine has none, or the receiver failed (its
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
    sender = RefitSender(lambda dtype: iter(tensors.items()), True, True, device, settings)
    info = sender.prepare_refit_info()
    nbytes = sum(t.numel() * t.itemsize for t in tensors.values())

    ctx = multiprocessing.get_context("spawn")
    inbox, outbox, packing_done = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=receiver_main, args=(str(device), inbox, outbox, packing_done))
    child.start()
    memcpy, rows = Memcpy(nbytes, device), []
    try:
        inbox.put(info)
        if (answer := outbox.get(timeout=300)) != "ready":
            raise RuntimeError(f"receiver: {answer}")
        for repeat in range(repeats + 1):  # the first one warms up both sides
            baseline = memcpy.bandwidth()
            packing_done.clear()
            stream = sender.prepare_weights_for_ipc()
            inbox.put(stream)
            start = time.perf_counter()
            sender.stream_weights_ipc()
            packing_done.set()
            report = outbox.get(timeout=300)
            timings = sender.finish_weights_ipc()
            if not isinstance(report, dict):
                raise RuntimeError(f"receiver: {report}")
            if repeat:
                rows.append((report["checked"] - start, timings["pack_s"], report["load_s"],
                             report["attach_s"], baseline))
    finally:
        inbox.put(None)
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        sender.close()

    transfer, pack, load, attach, baseline = (statistics.median(c) for c in zip(*rows))
    return TransportResult(
        nbytes, len(tensors), transfer, pack, load, attach, baseline,
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
    for label, seconds in (("transfer (pack start -> last bucket checked)", result.transfer_s),
                           ("  pack (sender)", result.pack_s),
                           ("engine-style load (receiver, one copy)", result.load_s)):
        print(f"{label:<46} {seconds * 1e3:9.2f} ms {nbytes / seconds / 1e9:8.1f} GB/s "
              f"{nbytes / seconds / baseline:6.2f} x {name}")
    print(f"receiver mapping the sender's buffer (inside transfer): {result.attach_s * 1e3:.2f} ms")
    print(f"transfer / {name}, per run: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f}-{max(ratios):.2f}) (target >= 0.5)")


if __name__ == "__main__":
    main()
