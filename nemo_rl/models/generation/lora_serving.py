"""What a generation engine needs to serve a LoRA policy's adapters itself
(``policy.generation.vllm_cfg.lora_refit: adapter``): their rank and scale.

With it the engine is built with vLLM's LoRA support and each refit streams only the
adapters' tensors, in PEFT's names and layout (``<hf module>.lora_A.weight`` ``[dim, in]``,
``<hf module>.lora_B.weight`` ``[out, dim]``, :mod:`megatron_bridge.lora_weights`), which the
engine installs as a new adapter (:mod:`nemo_rl.models.generation.vllm.lora_adapters`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The ranks vLLM (0.32) accepts as ``max_lora_rank`` (its ``vllm.config.lora.MaxLoRARanks``;
# a unit test checks they agree): an engine is built with the smallest one >= the adapters'.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_max_lora_rank(dim: int) -> int:
    """The ``max_lora_rank`` an engine serving rank-``dim`` adapters is built with.

    Raises:
        ValueError: ``dim`` is above vLLM's largest rank.
    """
    for rank in VLLM_MAX_LORA_RANKS:
        if rank >= dim:
            return rank
    raise ValueError(
        f"LoRA rank {dim} is above vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}"
    )


@dataclass(frozen=True)
class AdapterServing:
    """The policy's adapters as the engine serves them (from ``policy.megatron_cfg.peft``).

    Attributes:
        dim: rank ``r`` of every adapter.
        alpha: the update ``B A x`` is scaled by ``alpha / dim``.
    """

    dim: int
    alpha: float

    @property
    def max_lora_rank(self) -> int:
        """The engine's ``max_lora_rank`` (:func:`engine_max_lora_rank`)."""
        return engine_max_lora_rank(self.dim)
