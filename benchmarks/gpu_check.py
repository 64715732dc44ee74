"""One-command GPU check: four checks of the CUDA paths on one GPU, each PASS / FAIL / SKIP
with its number. Run it through ``scripts/gpu_check.sh`` (which installs the wheels the GPU
machine lacks); ``--dry-run`` runs the same code on CPU at toy sizes (CI runs that).

Checks (each phase runs in its own subprocess, so a crash in one still reports the others):

* ``train_step``: ``MegatronPolicyWorker.train`` (single rank, in-process, local layer spec: no
  TransformerEngine) on a random Llama of about 1 B parameters in bf16, 8 rows of 2048 tokens
  in one micro-batch of 8 (``--micro-batch``), one warm-up optimizer step and ``--steps`` timed
  ones. MFU = model FLOPs (``model_flops`` of ``bench_megatron_worker_train``) / median step
  time / the measured bf16 matmul peak (``torch.mm`` 8192^2 on the same GPU). Target >= 45 %.
  ``--profile FILE`` also profiles one more step (op tables, kernel time against the step's
  wall time, host reads of device scalars). Beside it, the memory plan's training phase for
  the same model and micro-batch on one GPU (``nemo_rl.distributed.memory_plan``: parameters,
  gradients, optimizer state, activations, logits) next to the steps' measured peak (torch's
  allocator; not measured in a dry run): printed and recorded to check the formula, not
  judged.
* ``offload``: right after those steps, in the same worker, twice: ``offload_before_refit``
  (optimizer state to the host, gradient buffers freed), ``offload_after_refit`` (parameters to
  the host) and ``prepare_for_training`` (everything back): seconds and bytes of each in the
  second cycle (the first also pins the host buffers every later refit reuses), GB/s against a
  pinned device-to-host copy of 1 GiB, device memory freed. PASS when every parameter comes
  back bit for bit and one more training step after the restores has a finite loss.
* ``resume``: after the 1 B worker stops, the tiny Llama in the same precision: one step, an
  offload cycle, ``save_checkpoint``, one more step; then a fresh worker ``load_checkpoint``s
  and takes that step again. PASS when both give the same loss and parameters (the fused Adam's
  state, step counter included, comes back onto the device).
* ``logprobs``: ``get_logprobs`` of the tiny Llama (fp32, TF32 off) in a CPU process
  (``CUDA_VISIBLE_DEVICES=``) and in a CUDA process on the same batch; PASS when
  max |CPU - CUDA| <= 1e-4.
* ``vs_transformers`` (only with ``--only vs_transformers``): the Qwen2.5-1.5B shape with the
  real Qwen vocabulary, ``MegatronPolicyWorker`` against plain transformers (TRL's bf16 setup)
  in two processes on the same GPU: uniform, long, skewed (ours packed) training steps, a
  logprob pass and the peak memory, each as ours / transformers, and MFU
  (:mod:`benchmarks.gpu_check_vs_transformers`). PASS when the issue-46 targets are met.
* ``ipc_refit``: ``measure_transport`` of ``bench_ipc_refit_transport``: the colocated refit
  transport (a ring of two bucket-sized slots in a CUDA IPC buffer, writer and reader
  processes on the same GPU, the reader loading each bucket as it arrives) against a
  device-to-device copy of the same bytes. Target >= 0.5 (two copies back to back).

In a dry run every device is the CPU, the models are toy-sized and fp32, and the targets are
not judged (the numbers mean nothing on CPU): a check passes when its code ran and its
correctness part holds.

    scripts/gpu_check.sh [--wheels DIR] [--dry-run] [--only CHECK ...]
    PYTHONPATH=. python -m benchmarks.gpu_check --dry-run     # where everything is installed
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_vs_transformers import DRY_RUN_SHAPES, GPU_SHAPES, Shapes

REPO = Path(__file__).resolve().parents[1]
CHECKS = ("train_step", "offload", "resume", "logprobs", "ipc_refit", "vs_transformers")
DEFAULT_CHECKS = CHECKS[:-1]  # vs_transformers (~5 minutes of an H200) only when named
MFU_TARGET = 0.45
IPC_TARGET = 0.5
LOGPROB_ATOL = 1e-4
TOTAL_BUDGET_S = 570  # the whole check ends within 10 minutes, installation included

# A Llama-3.2-1B-like body (hidden 2048, 16 layers, GQA 32/8, FFN 8192) with the tiny builder's
# 1,024-token BPE vocabulary: 0.97 B parameters, nearly all in the layers.
LLAMA_1B = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, intermediate_size=8192, max_position_embeddings=4096,
)
TINY = dict(  # the tiny builder's defaults: the dry run's "1 B" model, already cached in CI
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=256, max_position_embeddings=1024,
)
VOCAB_ROWS = 1024  # bpe_vocab_size 1024, already a multiple of 128: no padding rows

# What the GPU machine this check is written for lacks (it has torch, transformers and their
# dependencies; scripts/gpu_check.sh brings megatron-core, pydantic and omegaconf): a dry run
# hides these, so an import of one on the checked paths fails in CI rather than on the GPU.
ABSENT_ON_GPU_MACHINE = (
    "ray", "vllm", "transformer_engine", "transferqueue", "apex", "wandb", "mlflow",
    "datasets", "torchdata", "math_verify",
)


def hide_modules(names: tuple[str, ...]) -> None:
    """Make the packages ``names`` look uninstalled in this process: ``import`` raises
    ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns None (a ``None`` entry in
    ``sys.modules`` does both)."""
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Mode:
    """Sizes and devices of one way to run the check (GPU or dry run).

    Attributes:
        device: "cuda" or "cpu", of the train, offload and IPC phases and the logprobs'
            second side.
        dry_run: targets are not judged, ``ABSENT_ON_GPU_MACHINE`` is hidden.
        train_sizes: the trained Llama's sizes (keys of ``bench_megatron_worker_train.SIZES``).
        train_precision: its dtype, also the dtype of the matmul peak.
        train_rows, train_seq, train_mbs: global batch (rows of ``train_seq`` tokens, one
            optimizer step) and micro-batch.
        peak_n: side of the square matrices of the matmul peak.
        ipc: keyword arguments of ``measure_transport``.
        phase_timeout_s: a phase's subprocess is stopped after this, or when the whole check
            has run ``TOTAL_BUDGET_S``, whichever comes first.
        vs_shapes: model and batches of the ``vs_transformers`` check.
    """

    device: str
    dry_run: bool
    train_sizes: dict[str, int]
    train_precision: str
    train_rows: int
    train_seq: int
    train_mbs: int
    peak_n: int
    ipc: dict[str, int]
    phase_timeout_s: int
    vs_shapes: Shapes


GPU = Mode("cuda", False, LLAMA_1B, "bfloat16", 8, 2048, 8, 8192,
           dict(layers=16, hidden=2048, bucket_mb=256, repeats=5, vocab=32768), 420, GPU_SHAPES)
DRY_RUN = Mode("cpu", True, TINY, "float32", 4, 64, 2, 256,
               dict(layers=1, hidden=128, bucket_mb=1, repeats=1, vocab=1024), 240, DRY_RUN_SHAPES)


@dataclass
class CheckResult:
    """One check's outcome: ``status`` PASS / FAIL / SKIP, a one-line ``summary`` with its
    number, and the raw ``numbers`` (seconds, bytes, ratios)."""

    name: str
    status: str
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)


def judged(ok: bool, meets_target: bool, mode: Mode) -> str:
    """PASS when the correctness part holds and, on a GPU, the target is met."""
    return "PASS" if ok and (mode.dry_run or meets_target) else "FAIL"


def target_note(mode: Mode, text: str) -> str:
    return "target not judged in a dry run" if mode.dry_run else text


# ------------------------------------------------------------------------------ phases
# Each runs in a subprocess (``--phase``) and returns its CheckResults.


def start_worker(model_path: str, precision: str, rows: int, seq: int, mbs: int) -> Any:
    """A single-rank ``MegatronPolicyWorker`` (no Ray) on this process's device."""
    from megatron_bridge.parallel_state import find_free_port
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(find_free_port()))
    config = PolicyConfig(
        model_name=model_path, precision=precision, train_global_batch_size=rows,
        train_micro_batch_size=mbs, logprob_batch_size=mbs, max_total_sequence_length=seq,
        megatron_cfg={"optimizer": {"lr": 1e-5, "min_lr": 1e-5, "clip_grad": 1.0}},
    )
    return MegatronPolicyWorker(config, model_path, init_reference_model=False)


def phase_train(mode: Mode, steps: int, profile_out: Path | None = None) -> list[CheckResult]:
    """``train_step`` then ``offload`` on one worker (the offload moves a trained optimizer);
    with ``profile_out``, one more step under the torch profiler first (:func:`profile_step`)."""
    import torch

    from benchmarks.bench_megatron_worker_train import make_batch, matmul_peak_flops, model_flops
    from nemo_rl.algorithms.loss import NLLLoss
    from nemo_rl.models.tiny import build_tiny_model

    require_device(mode)
    peak = matmul_peak_flops(mode.peak_n, 10, mode.device, mode.train_precision)
    path = str(build_tiny_model("llama", **mode.train_sizes))
    lengths = (mode.train_seq,) * mode.train_rows
    batch = make_batch(lengths, mode.train_seq)
    torch.manual_seed(0)
    worker = start_worker(path, mode.train_precision, mode.train_rows, mode.train_seq,
                          mode.train_mbs)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        times, losses = [], []
        for _ in range(steps + 1):  # the first step warms up (allocations, kernels)
            start = time.perf_counter()
            losses += worker.train(batch, NLLLoss())["loss"]
            times.append(time.perf_counter() - start)
        step_s = statistics.median(times[1:])
        profiled = {} if profile_out is None else profile_step(worker, batch, profile_out)
        mfu = model_flops(lengths, mode.train_sizes, VOCAB_ROWS) / step_s / peak
        params = sum(p.numel() for p in worker.policy.model.parameters())
        memory = memory_against_plan(worker)
        finite = all(math.isfinite(x) for x in losses)
        train = CheckResult(
            "train_step", judged(finite, mfu >= MFU_TARGET, mode),
            f"MFU {mfu:.1%} of the measured {mode.train_precision} matmul peak "
            f"{peak / 1e12:.1f} TFLOP/s ({target_note(mode, f'target >= {MFU_TARGET:.0%}')}); "
            f"{params / 1e6:,.1f} M parameters, micro-batch {mode.train_mbs} x {mode.train_seq} "
            f"tokens, step {step_s:.3f} s (median of {steps}), "
            f"{sum(lengths) / step_s:,.0f} tokens/s, losses {'finite' if finite else losses}; "
            f"{memory['summary']}",
            dict(mfu=mfu, peak_flops=peak, step_s=step_s, step_times_s=times, losses=losses,
                 parameters=params, tokens=sum(lengths), profile=profiled, memory=memory),
        )
        offload = offload_round_trip(worker, batch, mode)
    finally:
        worker.shutdown()
    try:
        resume = resume_step(mode)
    except Exception as err:  # reported as the check's failure; the two above still count
        resume = CheckResult("resume", "FAIL", f"{type(err).__name__}: {err}")
    return [train, offload, resume]


def memory_against_plan(worker: Any) -> dict[str, Any]:
    """The memory plan's training phase for ``worker``'s model and micro-batch on one GPU (its
    terms in bytes, their sum without the runtime allowance) next to the peak torch's allocator
    saw since the last reset (allocated and reserved bytes; None without CUDA), and a one-line
    summary. Compared, not judged: the plan is an estimate to check."""
    import torch

    from nemo_rl.distributed.memory_plan import RUNTIME, TRAINING, GiB
    from nemo_rl.models.policy.gpu_memory import plan_policy_memory

    def size(nbytes: int) -> str:  # the dry run's toy model is a few MiB
        return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB // 10 else f"{nbytes / 2**20:.1f} MiB"

    cuda = torch.cuda.is_available()
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / GiB if cuda else 80.0
    plan = plan_policy_memory(worker.config, 1, gpu_gib, with_generation=False)
    terms = {t.name: t.nbytes for t in plan.phase(TRAINING).terms}
    planned = sum(nbytes for name, nbytes in terms.items() if name != RUNTIME)
    allocated = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    measured = (
        f"measured peak {size(allocated)} allocated, {size(reserved)} reserved"
        if cuda else "peak not measured without CUDA"
    )
    parts = ", ".join(f"{name} {size(nbytes)}" for name, nbytes in terms.items() if name != RUNTIME)
    return dict(
        plan_terms=terms, plan_bytes=planned, peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        summary=f"memory: {measured}; the plan's training phase {size(planned)} ({parts}; "
                f"+ {size(terms[RUNTIME])} runtime allowance)",
    )


def resume_step(mode: Mode) -> CheckResult:
    """``resume``: the tiny Llama's step after a checkpoint, taken by the worker that saved it
    and again by a fresh worker that loaded it; the same loss and parameters expected."""
    import torch

    from benchmarks.bench_megatron_worker_train import make_batch
    from nemo_rl.algorithms.loss import NLLLoss
    from nemo_rl.models.tiny import build_tiny_model

    path = str(build_tiny_model("llama"))
    batch = make_batch((64, 40, 64, 23), 64, seed=2)

    def start() -> Any:
        torch.manual_seed(0)
        return start_worker(path, mode.train_precision, 4, 64, 2)

    def step(worker: Any) -> tuple[float, list[Any]]:
        loss = worker.train(batch, NLLLoss())["loss"][-1]
        return loss, [p.detach().float().cpu() for p in worker.policy.model.parameters()]

    with tempfile.TemporaryDirectory() as tmp:
        saver = start()
        try:
            step(saver)
            offload_cycle(saver, torch.device(mode.device))  # the path that once left the
            saver.save_checkpoint(f"{tmp}/ckpt")               # step counters on the host
            loss_a, params_a = step(saver)
        finally:
            saver.shutdown()
        loader = start()
        try:
            loader.load_checkpoint(f"{tmp}/ckpt")
            loss_b, params_b = step(loader)
        finally:
            loader.shutdown()
    diff = max((a - b).abs().max().item() for a, b in zip(params_a, params_b))
    ok = math.isfinite(loss_a) and math.isclose(loss_a, loss_b, rel_tol=1e-5) and diff <= 1e-5
    return CheckResult(
        "resume", "PASS" if ok else "FAIL",
        f"{mode.train_precision} tiny Llama on {mode.device}: the step after the checkpoint "
        f"{loss_a:.6f} in the saving worker, {loss_b:.6f} in a fresh worker that loaded it; "
        f"parameters after it differ by at most {diff:.1e}",
        dict(loss_saver=loss_a, loss_loader=loss_b, max_param_diff=diff),
    )


def profile_step(worker: Any, batch: Any, out: Path) -> dict[str, Any]:
    """One training step under ``torch.profiler``: the ops by their own device time (top 40)
    and by their own CPU time (top 25), and where the host reads device scalars (the Python
    stacks of the ten most frequent), written to ``out``; returns the step's wall seconds,
    the kernels' summed seconds (their share of the wall time says how much the device waited
    for the host) and the host-device synchronisations (``.item()``-like reads)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from nemo_rl.algorithms.loss import NLLLoss

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as prof:
        start = time.perf_counter()
        worker.train(batch, NLLLoss())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    ops = prof.key_averages()
    kernel_s = sum(e.time_range.elapsed_us() for e in prof.events()
                   if e.device_type == DeviceType.CUDA) / 1e6
    callers = collections.Counter(_python_callers(e) for e in prof.events()
                                  if e.name == "aten::_local_scalar_dense")
    syncs = sum(callers.values())
    stacks = "\n".join(f"{n:5d} x {chain}" for chain, n in callers.most_common(10))
    out.write_text(
        f"one step: {wall_s:.4f} s wall, kernels {kernel_s:.4f} s "
        f"({kernel_s / wall_s:.1%} of the wall time), {syncs} device-to-host scalar reads\n\n"
        + ops.table(sort_by="self_device_time_total", row_limit=40) + "\n\n"
        + ops.table(sort_by="self_cpu_time_total", row_limit=25) + "\n\nscalar reads:\n"
        + stacks + "\n"
    )
    return dict(wall_s=wall_s, kernel_s=kernel_s, scalar_reads=syncs)


def _python_callers(event: Any, depth: int = 4) -> str:
    """The innermost ``depth`` Python frames above a profiler event (its parents recorded by
    the profiler's Python tracer), innermost first."""
    frames, parent = [], event.cpu_parent
    while parent is not None and len(frames) < depth:
        if ".py(" in parent.name:
            frames.append(parent.name.rsplit("/", 1)[-1])
        parent = parent.cpu_parent
    return " <- ".join(frames)


def offload_round_trip(worker: Any, batch: Any, mode: Mode) -> CheckResult:
    """Offload and restore ``worker``'s state twice, timed (the first cycle also pins the host
    buffers that every later one reuses); then one more training step."""
    import torch

    from nemo_rl.algorithms.loss import NLLLoss

    device = torch.device(mode.device)
    before = [p.detach().to("cpu", copy=True) for p in worker.policy.model.parameters()]
    cycles = [offload_cycle(worker, device) for _ in range(2)]
    after = [p.detach().to("cpu") for p in worker.policy.model.parameters()]
    same = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    loss = worker.train(batch, NLLLoss())["loss"][-1]
    ok = same and math.isfinite(loss)
    first, steady = cycles
    timings, moved = steady["seconds"], steady["bytes"]
    total = sum(moved.values())
    baseline = pinned_copy_bandwidth(device)

    def rate(nbytes: int, seconds: float) -> str:
        return f"{nbytes / 1e9:.2f} GB in {seconds:.3f} s ({nbytes / max(seconds, 1e-9) / 1e9:.1f} GB/s)"

    offload_s = timings["optimizer_and_grads"] + timings["params"]
    summary = (
        f"offload {rate(total, offload_s)} "
        f"(optimizer+grads {rate(moved['optimizer_and_grads'], timings['optimizer_and_grads'])}, "
        f"params {rate(moved['params'], timings['params'])}), restore "
        f"{rate(total, timings['restore'])}; first cycle (pins the host buffers) offload "
        f"{first['seconds']['optimizer_and_grads'] + first['seconds']['params']:.3f} s; device "
        f"memory freed {steady['freed_bytes'] / 1e9:.2f} GB; pinned device-to-host copy "
        f"{baseline / 1e9:.1f} GB/s; parameters after the restores "
        f"{'bit-identical' if same else 'CHANGED'}, next step's loss {loss:.4f}"
    )
    return CheckResult("offload", "PASS" if ok else "FAIL", summary,
                       dict(seconds=timings, bytes=moved, freed_bytes=steady["freed_bytes"],
                            first_cycle=first, pinned_d2h_bytes_per_s=baseline,
                            restored_equal=same, loss=loss))


def offload_cycle(worker: Any, device: Any) -> dict[str, Any]:
    """One ``offload_before_refit`` + ``offload_after_refit`` + ``prepare_for_training``:
    seconds and bytes of each step, device memory freed by the offloads."""
    import torch

    from benchmarks.memcpy_baseline import synchronize

    allocated = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    seconds, moved = {}, {}
    for name, call in (("optimizer_and_grads", worker.offload_before_refit),
                       ("params", worker.offload_after_refit)):
        start = time.perf_counter()
        moved[name] = call()
        synchronize(device)
        seconds[name] = time.perf_counter() - start
    freed = allocated - (torch.cuda.memory_allocated() if device.type == "cuda" else 0)
    start = time.perf_counter()
    worker.prepare_for_training()
    synchronize(device)
    seconds["restore"] = time.perf_counter() - start
    return dict(seconds=seconds, bytes=moved, freed_bytes=freed)


def pinned_copy_bandwidth(device: Any, nbytes: int = 1 << 30) -> float:
    """Bytes/s of one device-to-host copy of ``nbytes`` into pinned memory, best of 3 (0 on
    CPU: nothing to copy)."""
    import torch

    if device.type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def phase_logprobs(mode: Mode, out: Path) -> list[CheckResult]:
    """The tiny Llama's fp32 logprobs ``[4, 64]`` on this process's device, saved to ``out``
    with the device's type."""
    import torch

    from benchmarks.bench_megatron_worker_train import make_batch
    from nemo_rl.models.tiny import build_tiny_model

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    lengths = (48, 64, 17, 33)
    worker = start_worker(str(build_tiny_model("llama")), "float32", len(lengths), 64, 2)
    try:
        logprobs = worker.get_logprobs(make_batch(lengths, 64, seed=1))["logprobs"]
    finally:
        worker.shutdown()
    torch.save({"logprobs": logprobs.cpu(),
                "device": "cuda" if torch.cuda.is_available() else "cpu"}, out)
    return []


def phase_ipc(mode: Mode) -> list[CheckResult]:
    import torch

    from benchmarks.bench_ipc_refit_transport import measure_transport

    require_device(mode)
    device = torch.device("cuda:0" if mode.device == "cuda" else "cpu")
    # judged at the default (policy.refit_checksums: false); the checksummed stream beside it
    r, summed = (measure_transport(device, **mode.ipc, checksums=c) for c in (False, True))
    ratio, summed_ratio = statistics.median(r.ratios), statistics.median(summed.ratios)
    baseline = "device-to-device copy" if device.type == "cuda" else "memcpy"
    return [CheckResult(
        "ipc_refit", judged(True, ratio >= IPC_TARGET, mode),
        f"transfer / {baseline} {ratio:.2f} ({min(r.ratios):.2f}-{max(r.ratios):.2f}, "
        f"{target_note(mode, f'target >= {IPC_TARGET}')}); {r.nbytes / 1e9:.3f} GB in "
        f"{r.transfer_s * 1e3:.2f} ms vs {baseline} {r.baseline / 1e9:.1f} GB/s; pack "
        f"{r.pack_s * 1e3:.2f} ms, load {r.load_s * 1e3:.2f} ms, ring "
        f"{r.ring_bytes / 1e6:.1f} MB staged; with checksums "
        f"(every bucket verified) {summed_ratio:.2f}, pack {summed.pack_s * 1e3:.2f} ms",
        {**asdict(r), "checksummed": asdict(summed)},
    )]


def phase_vs(mode: Mode, side: str, steps: int, compile_layers: bool) -> list[CheckResult]:
    """One side of ``vs_transformers`` (``ours`` also measures the matmul peak): its numbers
    in a row named ``vs_transformers:<side>`` for :func:`compare_vs_transformers`."""
    from benchmarks import gpu_check_vs_transformers as vs
    from benchmarks.bench_megatron_worker_train import matmul_peak_flops

    require_device(mode)
    path = vs.model_path(mode.vs_shapes)
    if side == "ours":
        numbers = vs.run_ours(path, mode.vs_shapes, steps, compile_layers)
    else:
        numbers = vs.run_transformers(path, mode.vs_shapes, steps)
    if side == "ours":
        numbers["peak_flops"] = matmul_peak_flops(mode.peak_n, 10, mode.device, "bfloat16")
    return [CheckResult(f"vs_transformers:{side}", "PASS", "", numbers)]


def compare_vs_transformers(
    mode: Mode, env: dict[str, str], deadline: float, steps: int, compile_layers: bool
) -> CheckResult:
    """``vs_transformers``: both sides one after the other (each alone on the GPU)."""
    from benchmarks.gpu_check_vs_transformers import compare

    sides = {}
    for side in ("ours", "transformers"):
        extra = ["--compile-layers"] if compile_layers and side == "ours" else []
        rows, error = run_phase(phase_args("vs_" + side, mode) + ["--steps", str(steps)] + extra,
                                env, timeout_s(mode, deadline))
        if error:
            return CheckResult("vs_transformers", "FAIL", f"the {side} side failed: {error}")
        sides[side] = rows[0]["numbers"]
    peak = sides["ours"].pop("peak_flops")
    ok, summary, numbers = compare(sides["ours"], sides["transformers"], mode.vs_shapes, peak,
                                   mode.dry_run)
    return CheckResult("vs_transformers", judged(True, ok, mode), summary, numbers)


def require_device(mode: Mode) -> None:
    import torch

    if mode.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "this check needs a CUDA GPU and torch.cuda.is_available() is False here; "
            "`scripts/gpu_check.sh --dry-run` runs the same code on CPU at toy sizes"
        )


# ------------------------------------------------------------------------------ driver


def run_phase(args: list[str], env: dict[str, str], timeout_s: int) -> tuple[list[dict], str]:
    """Run ``python -m benchmarks.gpu_check --phase ...``; (its results, its error or '')."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", *args, "--result", result.name]
        # its own process group, so a timeout also stops what it spawned (the IPC receiver)
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return [], f"did not finish within {timeout_s} s"
        if proc.returncode != 0:
            tail = "\n      ".join((stderr or stdout).strip().splitlines()[-15:])
            return [], f"exit code {proc.returncode}:\n      {tail}"
        return json.loads(Path(result.name).read_text() or "[]"), ""


def timeout_s(mode: Mode, deadline: float) -> int:
    """A phase's time limit: its own, cut to what is left of the whole check's budget."""
    return max(1, int(min(mode.phase_timeout_s, deadline - time.monotonic())))


def compare_logprobs(mode: Mode, env: dict[str, str], deadline: float) -> CheckResult:
    """``logprobs``: the same batch through a CPU worker and a device worker (two processes
    at once: nothing is timed)."""
    import torch

    base = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    sides = {"cpu": {**base, "CUDA_VISIBLE_DEVICES": ""}, mode.device.upper(): env}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(sides)) as pool:
        outs = [Path(tmp) / f"{i}.pt" for i in range(len(sides))]
        runs = [pool.submit(run_phase, phase_args("logprobs", mode) + ["--logprobs-out", str(out)],
                            side_env, timeout_s(mode, deadline))
                for out, side_env in zip(outs, sides.values())]
        for side, run in zip(sides, runs):
            if error := run.result()[1]:
                return CheckResult("logprobs", "FAIL", f"the {side} side failed: {error}")
        (cpu, cpu_device), (dev, dev_device) = (
            (saved["logprobs"], saved["device"]) for saved in map(torch.load, outs))
    if (cpu_device, dev_device) != ("cpu", mode.device):
        return CheckResult("logprobs", "FAIL", f"the sides ran on {cpu_device} and {dev_device}, "
                           f"not cpu and {mode.device}")
    diff = (cpu - dev).abs().max().item() if cpu.shape == dev.shape else math.inf
    return CheckResult(
        "logprobs", "PASS" if diff <= LOGPROB_ATOL else "FAIL",
        f"max |CPU - {mode.device.upper()}| = {diff:.2e} over {tuple(cpu.shape)} fp32 logprobs "
        f"of the tiny Llama (tolerance {LOGPROB_ATOL:g})",
        dict(max_abs_diff=diff, shape=list(cpu.shape)),
    )


def phase_args(name: str, mode: Mode) -> list[str]:
    return (["--phase", name, "--micro-batch", str(mode.train_mbs)]
            + (["--dry-run"] if mode.dry_run else []))


def environment_line(mode: Mode) -> str:
    import torch

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception as err:  # reported, not fatal: the phases say what is missing
        megatron = f"missing ({type(err).__name__})"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return (f"gpu_check{' --dry-run (CPU, toy sizes)' if mode.dry_run else ''}: {device}; "
            f"python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {megatron}")


def run_checks(
    mode: Mode, only: set[str], steps: int, profile: Path | None = None,
    compile_layers: bool = False,
) -> list[CheckResult]:
    deadline = time.monotonic() + TOTAL_BUDGET_S
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    results: dict[str, CheckResult] = {}
    for phase, checks in (("train", ("train_step", "offload", "resume")), ("ipc", ("ipc_refit",))):
        if not only & set(checks):
            continue
        started = time.perf_counter()
        extra = ["--profile", str(profile.resolve())] if profile and phase == "train" else []
        rows, error = run_phase(phase_args(phase, mode) + ["--steps", str(steps)] + extra, env,
                                timeout_s(mode, deadline))
        for row in rows:
            results[row["name"]] = CheckResult(**row)
        for name in checks:
            if name not in results:
                results[name] = CheckResult(name, "FAIL", f"the {phase} phase failed: {error}")
            report(results[name])
        print(f"  ({phase} phase: {time.perf_counter() - started:.0f} s)", flush=True)
    if "logprobs" in only:
        results["logprobs"] = compare_logprobs(mode, env, deadline)
        report(results["logprobs"])
    if "vs_transformers" in only:
        results["vs_transformers"] = compare_vs_transformers(
            mode, env, deadline, steps, compile_layers)
        report(results["vs_transformers"])
    return [results.get(name) or CheckResult(name, "SKIP", "not selected (--only)")
            for name in CHECKS if name in DEFAULT_CHECKS or name in only]


def report(result: CheckResult) -> None:
    """Print one check's line as soon as its phase ends (a run stopped from outside still
    shows what finished)."""
    print(f"[{result.status}] {result.name}: {result.summary}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, toy sizes, targets not judged (what CI runs)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(DEFAULT_CHECKS),
                        help="checks to run (default: all but vs_transformers)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--micro-batch", type=int,
                        help="rows per micro-batch of the training step (default: 8 on the "
                        "GPU, 2 in a dry run)")
    parser.add_argument("--profile", type=Path,
                        help="also profile one training step: its op tables go to this file")
    parser.add_argument("--compile-layers", action="store_true",
                        help="vs_transformers: our worker with "
                        "megatron_cfg.compile_transformer_layers (regional torch.compile)")
    parser.add_argument("--phase", choices=["train", "ipc", "logprobs", "vs_ours", "vs_transformers"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--logprobs-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = DRY_RUN if args.dry_run else GPU
    if args.micro_batch:
        mode = dataclasses.replace(mode, train_mbs=args.micro_batch)

    if args.phase:
        if mode.dry_run:
            hide_modules(ABSENT_ON_GPU_MACHINE)
        rows = {"train": lambda: phase_train(mode, args.steps, args.profile),
                "ipc": lambda: phase_ipc(mode),
                "logprobs": lambda: phase_logprobs(mode, args.logprobs_out),
                "vs_ours": lambda: phase_vs(mode, "ours", args.steps, args.compile_layers),
                "vs_transformers": lambda: phase_vs(mode, "transformers", args.steps, False),
                }[args.phase]()
        args.result.write_text(json.dumps([asdict(r) for r in rows]))
        return

    import torch

    if not mode.dry_run and not torch.cuda.is_available():
        raise SystemExit(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False), and every "
            "check needs one; `scripts/gpu_check.sh --dry-run` runs the same code on CPU at "
            "toy sizes"
        )
    print(environment_line(mode), flush=True)
    started = time.perf_counter()
    results = run_checks(mode, set(args.only), args.steps, args.profile, args.compile_layers)
    for r in results:
        if r.status == "SKIP":
            report(r)
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} "
          f"skipped in {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
