"""The GPU check's ``vs_transformers`` case: ``MegatronPolicyWorker`` side by side with plain
transformers on a realistic shape, each side in its own process on the same GPU.

Model: the Qwen2.5-1.5B shape (28 layers, hidden 1536, GQA 12/2, head 128, FFN 8960, tied
embeddings) with the real 151,936-row Qwen vocabulary (``build_tiny_model("qwen2",
vocab="qwen")``), random weights. Ours: bf16 parameters with fp32 master weights (the worker's
``precision: bfloat16``), local layer spec, its defaults (fused LM head + logprobs in chunks of
``policy.logprob_chunk_size``). Theirs: TRL's bf16 setup: fp32 weights under bf16 autocast,
SDPA attention, ``torch.optim.AdamW(fused=True)``, logits -> ``log_softmax`` -> gather.

Cases, each timed as the median of ``steps`` after one warm-up:

* ``uniform_train``: 8 rows x 2048 tokens, micro-batch 4, one optimizer step (NLL).
* ``uniform_logprobs``: the same batch, one logprob pass at micro-batch 4.
* ``long_train``: 1 row x 16,384 tokens, one optimizer step.
* ``skewed_train``: 8 rows of :data:`SKEWED` lengths (6,528 real tokens): ours through the
  controller's sequence-packing plan (budget 4 x 2048 tokens), theirs in micro-batches of 4
  rows padded to each micro-batch's longest row.
* ``peak_memory``: torch's peak allocated bytes over the uniform steps.

Printed: each case's seconds on both sides, the ratio ours / theirs (lower is better), and
MFU of both uniform training steps against the measured bf16 matmul peak. Targets (issue 46):
uniform train <= 0.8, logprobs <= 0.8, skewed <= 0.45, peak memory <= 1.0, MFU >= 52 %.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

QWEN_1_5B = dict(
    hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    head_dim=128, intermediate_size=8960, max_position_embeddings=32768,
)
QWEN_VOCAB_ROWS = 151936
SKEWED = (2048, 1536, 1024, 768, 512, 320, 192, 128)  # 6,528 tokens
TARGETS = {"uniform_train": 0.8, "uniform_logprobs": 0.8, "skewed_train": 0.45, "peak_memory": 1.0}
MFU_TARGET = 0.52
CASES = ("uniform_train", "uniform_logprobs", "long_train", "skewed_train", "peak_memory")


@dataclass(frozen=True)
class Shapes:
    """What one run measures: the model (``build_tiny_model`` arguments) and the batches."""

    sizes: dict[str, int]
    vocab: str
    vocab_rows: int
    uniform: tuple[int, int]  # rows, tokens per row
    mbs: int
    long: int
    skewed: tuple[int, ...]
    precision: str


GPU_SHAPES = Shapes(QWEN_1_5B, "qwen", QWEN_VOCAB_ROWS, (8, 2048), 4, 16384, SKEWED, "bfloat16")
DRY_RUN_SHAPES = Shapes({}, "bpe", 1024, (4, 32), 2, 64, (32, 17, 9, 5), "float32")


def _timed(fn: Callable[[], Any], steps: int) -> float:
    """Median seconds of ``steps`` calls of ``fn`` after one warm-up call."""
    import torch

    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _peak_bytes() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _batches(shapes: Shapes) -> dict[str, Any]:
    from benchmarks.bench_megatron_worker_train import make_batch

    rows, seq = shapes.uniform
    return {
        "uniform": make_batch((seq,) * rows, seq),
        "long": make_batch((shapes.long,), shapes.long, seed=1),
        "skewed": make_batch(shapes.skewed, max(shapes.skewed), seed=2),
    }


def model_path(shapes: Shapes) -> str:
    """The random checkpoint of ``shapes`` (built once, cached by the tiny builder)."""
    from nemo_rl.models.tiny import build_tiny_model

    return str(build_tiny_model("qwen2", vocab=shapes.vocab, **shapes.sizes))


def run_ours(path: str, shapes: Shapes, steps: int, compile_layers: bool = False) -> dict[str, Any]:
    """Seconds of each case (and the peak bytes) of ``MegatronPolicyWorker`` in this process;
    ``compile_layers``: with ``megatron_cfg.compile_transformer_layers`` (the warm-up step of
    each case then includes the compilation)."""
    import os

    import torch

    from megatron_bridge.parallel_state import find_free_port
    from nemo_rl.algorithms.loss import NLLLoss
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(find_free_port()))
    batches = _batches(shapes)
    rows, seq = shapes.uniform
    config = PolicyConfig(
        model_name=path, precision=shapes.precision, train_global_batch_size=rows,
        train_micro_batch_size=shapes.mbs, logprob_batch_size=shapes.mbs,
        max_total_sequence_length=shapes.long, sequence_packing={"enabled": True},
        megatron_cfg={"optimizer": {"lr": 1e-5, "min_lr": 1e-5, "clip_grad": 1.0},
                      "compile_transformer_layers": compile_layers},
    )
    torch.manual_seed(0)
    worker = MegatronPolicyWorker(config, path, init_reference_model=False)
    packing = {"input_key": "input_ids", "input_lengths_key": "input_lengths",
               "max_tokens_per_microbatch": shapes.mbs * seq, "sequence_length_round": 64,
               "algorithm": "modified_first_fit_decreasing"}
    (skewed,) = batches["skewed"].shard_by_batch_size(
        1, batch_size=len(shapes.skewed), sequence_packing_args=packing).shards
    loss = NLLLoss()
    try:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        out = {"uniform_train": _timed(
            lambda: worker.train(batches["uniform"], loss, gbs=rows, mbs=shapes.mbs), steps)}
        out["peak_memory"] = _peak_bytes()
        out["uniform_logprobs"] = _timed(
            lambda: worker.get_logprobs(batches["uniform"], shapes.mbs), steps)
        out["long_train"] = _timed(lambda: worker.train(batches["long"], loss, gbs=1, mbs=1), steps)
        out["skewed_train"] = _timed(
            lambda: worker.train(skewed, loss, gbs=len(shapes.skewed), mbs=shapes.mbs), steps)
    finally:
        worker.shutdown()
    return out


def run_transformers(path: str, shapes: Shapes, steps: int) -> dict[str, Any]:
    """The same cases with transformers (TRL's bf16 setup) in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=cuda)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=shapes.precision == "bfloat16")
    batches = {k: v.to(device) for k, v in _batches(shapes).items()}

    def logprobs(ids: Any) -> Any:
        with autocast:
            logits = model(input_ids=ids).logits
        return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]

    def micro_batches(batch: Any) -> list[tuple[Any, Any]]:
        out = []
        for start in range(0, batch["input_ids"].shape[0], shapes.mbs):
            rows = slice(start, start + shapes.mbs)
            longest = int(batch["input_lengths"][rows].max())
            out.append((batch["input_ids"][rows, :longest], batch["token_mask"][rows, 1:longest]))
        return out

    def train(batch: Any) -> None:
        valid = batch["token_mask"][:, 1:].sum()
        for ids, mask in micro_batches(batch):
            (-(logprobs(ids) * mask).sum() / valid).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def score(batch: Any) -> None:
        with torch.no_grad():
            for ids, _ in micro_batches(batch):
                logprobs(ids)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.train()
    out = {"uniform_train": _timed(lambda: train(batches["uniform"]), steps)}
    out["peak_memory"] = _peak_bytes()
    out["uniform_logprobs"] = _timed(lambda: score(batches["uniform"]), steps)
    out["long_train"] = _timed(lambda: train(batches["long"]), steps)
    out["skewed_train"] = _timed(lambda: train(batches["skewed"]), steps)
    return out


def compare(ours: dict[str, Any], theirs: dict[str, Any], shapes: Shapes, peak_flops: float,
            dry_run: bool) -> tuple[bool, str, dict[str, Any]]:
    """``(targets met, summary, numbers)``: each case's ratio ours / theirs and both sides'
    uniform-step MFU. A case without a number on a side (the peak memory without CUDA) has no
    ratio and is not judged."""
    from benchmarks.bench_megatron_worker_train import model_flops

    rows, seq = shapes.uniform
    sizes = {**_tiny_sizes(), **shapes.sizes}
    flops = model_flops((seq,) * rows, sizes, shapes.vocab_rows)
    mfu = {side: flops / nums["uniform_train"] / peak_flops
           for side, nums in (("ours", ours), ("transformers", theirs))}
    ratios = {case: (ours[case] / theirs[case] if ours.get(case) and theirs.get(case) else None)
              for case in CASES}
    missed = [case for case, limit in TARGETS.items()
              if ratios[case] is not None and ratios[case] > limit]
    if mfu["ours"] < MFU_TARGET:
        missed.append("mfu")
    parts = []
    for case in CASES:
        if ratios[case] is None:
            parts.append(f"{case} not measured")
            continue
        unit, scale = ("GiB", 2**30) if case == "peak_memory" else ("s", 1)
        parts.append(f"{case} {ours[case] / scale:.3f} / {theirs[case] / scale:.3f} {unit} = "
                     f"{ratios[case]:.2f}")
    summary = (f"ours / transformers: {'; '.join(parts)}; MFU ours {mfu['ours']:.1%}, "
               f"transformers {mfu['transformers']:.1%} of {peak_flops / 1e12:.1f} TFLOP/s "
               + ("(targets not judged in a dry run)" if dry_run else
                  f"(missed: {', '.join(missed)})" if missed else "(all targets met)"))
    numbers = dict(ours=ours, transformers=theirs, ratios=ratios, mfu=mfu, missed=missed,
                   peak_flops=peak_flops)
    return not missed, summary, numbers


def _tiny_sizes() -> dict[str, int]:
    from nemo_rl.models.tiny import DEFAULT_SIZES

    return dict(DEFAULT_SIZES)
