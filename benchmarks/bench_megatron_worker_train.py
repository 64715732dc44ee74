"""Training throughput of ``MegatronPolicyWorker`` on CPU vs a plain transformers + AdamW loop.

Workload: a random Llama of about 37 M parameters (hidden 640, 8 layers, 10 heads / 5 KV heads,
head_dim 64, FFN 1792, BPE vocabulary 1024, untied), fp32, built locally with
``nemo_rl.models.tiny.build_tiny_model``. Every phase runs in a fresh subprocess (the CPU
compatibility layer stays active for the life of a process once applied, so it must not leak
into the baseline) and reports real (unpadded) tokens per second of its fastest of ``--steps``
optimizer steps after one warm-up step (the least disturbed one: the 2 cores are shared).

Phases:

* ``hf``: transformers ``LlamaForCausalLM`` + ``torch.optim.AdamW``; per micro-batch
  ``log_softmax`` + gather of the next tokens, the masked NLL normalised by the global batch's
  valid tokens, backward; then ``clip_grad_norm_`` and the optimizer step. The loop a user would
  write by hand; the baseline of the "worker vs HF" ratio (target >= 0.9).
* ``worker``: ``MegatronPolicyWorker.train`` (single rank, TP=PP=CP=DP=1, in-process: no Ray)
  with ``NLLLoss`` on the same batch and micro-batch size, same optimizer hyper-parameters.
* ``hf+compat``: ``hf`` after :func:`megatron_bridge.cpu_compat.apply_cpu_compat` (its torch
  function mode sees every torch call): the overhead of the CPU compatibility layer on the
  same work, ``hf+compat`` time / ``hf`` time - 1.
* ``padded`` / ``dynamic`` / ``packed``: the worker on a skewed length distribution (16
  samples, 24-512 tokens, 1,972 real tokens in a ``[16, 512]`` batch) with fixed micro-batches
  of 4 padded rows, token-budget dynamic micro-batches, and sequence packing, both at a budget of
  2,048 tokens (4 x 512). Target packed / padded >= 1.5.
* ``grpo_packed``: the worker, sequence packing, on a GRPO step's shape: 128 samples of a
  24-token prompt and a seeded response (10 % at the 128-token limit, the rest uniform in
  1-128), packs of 32 x 152 tokens. Its share of the peak against the uniform batch's is what
  packing many short sequences costs per FLOP.
* ``grpo_equal_padded`` / ``grpo_equal_packed``: the worker on 128 samples of the same length
  (a 24-token prompt and a 64-token response, the 40 M case of ``bench_grpo_vs_trl.py``, where
  every response reaches the limit), micro-batches of 32 padded rows against packs of 32 x 88
  tokens: where padding wastes nothing, what packing costs (target packed / padded >= 0.95).

Compute: the fraction of this machine's fp32 matmul peak (``torch.mm`` of 2048 x 2048, all
threads, best of 10, measured in every phase's process; the largest is the peak) reached by the model FLOPs of each phase, forward + backward
(3 x forward): 6 x (matmul parameters: projections, MLP, LM head) per real token, plus causal
attention 6 x layers x q-width x length^2 per sample. Padding is not counted as work.

Run (about 10 minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_megatron_worker_train.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES = dict(
    hidden_size=640,
    num_hidden_layers=8,
    num_attention_heads=10,
    num_key_value_heads=5,
    head_dim=64,
    intermediate_size=1792,
    max_position_embeddings=1024,
)
UNIFORM_ROWS, UNIFORM_LEN, UNIFORM_MBS = 8, 256, 2
SKEWED_LENGTHS = (512, 480, 64, 48, 40, 96, 32, 72, 56, 128, 24, 80, 36, 60, 44, 200)
SKEWED_MBS = 4
GRPO_SAMPLES, GRPO_PROMPT, GRPO_MAX_RESPONSE, GRPO_MBS = 128, 24, 128, 32
GRPO_EQUAL_RESPONSE = 64
LR = 1e-5


def model_path() -> str:
    from nemo_rl.models.tiny import build_tiny_model

    return str(build_tiny_model("llama", **SIZES))


def make_batch(lengths: tuple[int, ...], seq: int, seed: int = 0) -> Any:
    """Right-padded ``[len(lengths), seq]`` batch with the keys NLLLoss needs."""
    import torch

    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    pos = torch.arange(seq)[None, :]
    ids = torch.randint(3, 1000, (len(lengths), seq), generator=gen)
    ids[pos >= lens[:, None]] = 0
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lens,
        token_mask=((pos >= 1) & (pos < lens[:, None])).float(),
        sample_mask=torch.ones(len(lengths)),
    )


def model_flops(lengths: tuple[int, ...], sizes: dict[str, int] = SIZES, vocab: int = 1024) -> float:
    """Forward + backward FLOPs of one pass over samples of ``lengths`` through a Llama of
    ``sizes`` (keys of :data:`SIZES`) with ``vocab`` LM-head rows: 6 x matmul parameters per
    token, plus causal attention (QK^T and AV, 4 x q-width x length^2 forward, halved by the
    mask, x3 for the backward) per sample and layer."""
    h, layers, f = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["intermediate_size"]
    q = sizes["num_attention_heads"] * sizes["head_dim"]
    kv = sizes["num_key_value_heads"] * sizes["head_dim"]
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * f
    matmul_params = layers * per_layer + vocab * h  # + lm_head
    attention = sum(6 * layers * q * n * n for n in lengths)
    return 6 * matmul_params * sum(lengths) + attention


def matmul_peak_flops(n: int = 2048, repeats: int = 10, device: str = "cpu", dtype: str = "float32") -> float:
    """FLOP/s of ``torch.mm`` of two random ``n x n`` matrices of ``dtype`` on ``device``,
    best of ``repeats`` after one warm-up."""
    import torch

    from benchmarks.memcpy_baseline import synchronize

    dev = torch.device(device)
    a, b = (torch.randn(n, n, device=dev, dtype=getattr(torch, dtype)) for _ in range(2))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(dev)
        start = time.perf_counter()
        torch.mm(a, b)
        synchronize(dev)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


# ------------------------------------------------------------------------------ phases


def run_hf(path: str, steps: int, with_compat: bool) -> list[float]:
    """Step times of the transformers + AdamW loop on the uniform batch."""
    import torch
    from transformers import AutoModelForCausalLM

    if with_compat:
        from megatron_bridge.cpu_compat import apply_cpu_compat

        apply_cpu_compat()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    batch = make_batch((UNIFORM_LEN,) * UNIFORM_ROWS, UNIFORM_LEN)
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    valid = mask.sum()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for lo in range(0, UNIFORM_ROWS, UNIFORM_MBS):
            ids = batch["input_ids"][lo : lo + UNIFORM_MBS]
            logits = model(ids).logits[:, :-1]
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(lp * mask[lo : lo + UNIFORM_MBS, 1:]).sum() / valid
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
    return times[1:]


def grpo_response_lengths(samples: int, max_response: int, seed: int = 0) -> list[int]:
    """Seeded response lengths (tokens) of a GRPO step: 10 % at ``max_response`` (the few that
    hit the limit), the rest uniform in ``1 .. min(512, max_response)``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(1, min(512, max_response) + 1, (samples,), generator=gen).tolist()
    at_limit = set(torch.randperm(samples, generator=gen)[: max(1, samples // 10)].tolist())
    return [max_response if i in at_limit else n for i, n in enumerate(short)]


def time_worker_steps(
    path: str, batch: Any, mbs: int, steps: int, batching: str, token_budget: int,
    precision: str = "float32",
) -> list[float]:
    """Step times of a single-rank ``MegatronPolicyWorker`` (in-process, no Ray) training
    ``NLLLoss`` on ``batch`` (one global batch), after one warm-up step.

    Args:
        batching: ``padded`` (micro-batches of ``mbs`` rows, each padded to its longest),
            ``dynamic`` (token-budget micro-batches) or ``packed`` (sequence packing).
        token_budget: tokens per micro-batch of ``dynamic`` and ``packed``.
    """
    import torch

    from megatron_bridge.parallel_state import find_free_port
    from nemo_rl.models.policy.config import PolicyConfig
    from nemo_rl.models.policy.workers.megatron_policy_worker import MegatronPolicyWorker

    os.environ.update(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port())
    )
    gbs = batch.size
    config = PolicyConfig(
        model_name=path,
        precision=precision,
        train_global_batch_size=gbs,
        train_micro_batch_size=mbs,
        logprob_batch_size=mbs,
        max_total_sequence_length=batch["input_ids"].shape[1],
        megatron_cfg={
            "optimizer": {"lr": LR, "min_lr": LR, "weight_decay": 0.01, "clip_grad": 1.0},
        },
        sequence_packing={"enabled": batching == "packed"},
    )
    common = {"input_key": "input_ids", "input_lengths_key": "input_lengths",
              "max_tokens_per_microbatch": token_budget}
    if batching == "dynamic":
        (batch,) = batch.shard_by_batch_size(
            1, batch_size=gbs, dynamic_batching_args={**common, "sequence_length_round": 8}
        ).shards
    elif batching == "packed":
        (batch,) = batch.shard_by_batch_size(
            1, batch_size=gbs,
            sequence_packing_args={**common, "sequence_length_round": 2,
                                   "algorithm": "modified_first_fit_decreasing"},
        ).shards
    torch.manual_seed(0)
    worker = MegatronPolicyWorker(config, path, init_reference_model=False)
    try:
        return timed_train_steps(worker, batch, gbs, mbs, steps)
    finally:
        worker.shutdown()


def timed_train_steps(worker: Any, batch: Any, gbs: int, mbs: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` ``NLLLoss`` optimizer steps of ``worker`` on ``batch``,
    after one warm-up step."""
    import torch

    from nemo_rl.algorithms.loss import NLLLoss

    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        worker.train(batch, NLLLoss(), gbs=gbs, mbs=mbs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times[1:]


def workload(name: str) -> tuple[tuple[int, ...], int, int]:
    """Sample lengths (tokens), row length and rows per micro-batch of a named workload
    (a dynamic or packed micro-batch holds as many tokens as ``rows x row length``)."""
    if name == "uniform":
        return (UNIFORM_LEN,) * UNIFORM_ROWS, UNIFORM_LEN, UNIFORM_MBS
    if name == "skewed":
        return SKEWED_LENGTHS, max(SKEWED_LENGTHS), SKEWED_MBS
    if name == "grpo_equal":
        length = GRPO_PROMPT + GRPO_EQUAL_RESPONSE
        return (length,) * GRPO_SAMPLES, length, GRPO_MBS
    if name != "grpo":
        raise ValueError(
            f"unknown workload {name!r}: one of 'uniform', 'skewed', 'grpo', 'grpo_equal'"
        )
    responses = grpo_response_lengths(GRPO_SAMPLES, GRPO_MAX_RESPONSE)
    lengths = tuple(GRPO_PROMPT + n for n in responses)
    return lengths, GRPO_PROMPT + GRPO_MAX_RESPONSE, GRPO_MBS


def run_worker(path: str, steps: int, name: str, batching: str) -> list[float]:
    """Step times of the worker on the workload ``name`` (:func:`workload`)."""
    lengths, seq, mbs = workload(name)
    return time_worker_steps(path, make_batch(lengths, seq), mbs, steps, batching, mbs * seq)


PHASES = {
    "hf": ("uniform", lambda p, s: run_hf(p, s, with_compat=False)),
    "hf+compat": ("uniform", lambda p, s: run_hf(p, s, with_compat=True)),
    "worker": ("uniform", lambda p, s: run_worker(p, s, "uniform", "padded")),
    "padded": ("skewed", lambda p, s: run_worker(p, s, "skewed", "padded")),
    "dynamic": ("skewed", lambda p, s: run_worker(p, s, "skewed", "dynamic")),
    "packed": ("skewed", lambda p, s: run_worker(p, s, "skewed", "packed")),
    "grpo_packed": ("grpo", lambda p, s: run_worker(p, s, "grpo", "packed")),
    "grpo_equal_padded": ("grpo_equal", lambda p, s: run_worker(p, s, "grpo_equal", "padded")),
    "grpo_equal_packed": ("grpo_equal", lambda p, s: run_worker(p, s, "grpo_equal", "packed")),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per phase")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    path = model_path()
    if args.phase:
        peak = matmul_peak_flops()
        times = PHASES[args.phase][1](path, args.steps)
        print(json.dumps({"best_step_s": min(times), "peak_flops": max(peak, matmul_peak_flops())}))
        return

    results: dict[str, float] = {}
    peak = 0.0
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for name in PHASES:
        out = subprocess.run(
            [sys.executable, __file__, "--phase", name, "--steps", str(args.steps)],
            env=env, check=True, capture_output=True, text=True,
        )
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        results[name] = measured["best_step_s"]
        peak = max(peak, measured["peak_flops"])
    print(f"fp32 matmul peak (torch.mm 2048^2): {peak / 1e9:.1f} GFLOP/s")
    print(f"{'phase':<12} {'step s':>8} {'tokens/s':>10} {'of peak':>8}")
    for name, (kind, _) in PHASES.items():
        lengths, step_s = workload(kind)[0], results[name]
        mfu = model_flops(lengths) / step_s / peak
        print(f"{name:<12} {step_s:8.2f} {sum(lengths) / step_s:10.0f} {mfu:8.1%}")
    print(f"worker / HF tokens/s:          {results['hf'] / results['worker']:.2f}  (target >= 0.9)")
    print(f"packed / padded tokens/s:      {results['padded'] / results['packed']:.2f}  (target >= 1.5)")
    print(f"dynamic / padded tokens/s:     {results['padded'] / results['dynamic']:.2f}")
    equal = results["grpo_equal_padded"] / results["grpo_equal_packed"]
    print(f"packed / padded, equal lengths: {equal:.2f}  (target >= 0.95)")
    print(f"CPU compat overhead on HF loop: {results['hf+compat'] / results['hf'] - 1:+.1%}")


if __name__ == "__main__":
    main()
