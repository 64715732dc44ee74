"""Rollout generation with vLLM: a driver facade and its per-replica Ray workers."""

from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration
from nemo_rl.models.generation.vllm.vllm_worker import VllmGenerationWorker

__all__ = ["VllmGeneration", "VllmGenerationWorker"]
