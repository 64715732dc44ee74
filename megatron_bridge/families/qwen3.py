"""Qwen3 (``Qwen3ForCausalLM``): Llama plus per-head RMSNorm on queries and keys (QK-norm)."""

from megatron_bridge.families.base import Family
from megatron_bridge.families.llama import (
    GATE_UP_FUSIONS,
    GLOBAL_RENAMES,
    QKV_FUSIONS,
    LAYER_RENAMES as LLAMA_LAYER_RENAMES,
)

# QK-norm weights are [head_dim], shared by all heads: copied, replicated across TP ranks.
LAYER_RENAMES = {
    **LLAMA_LAYER_RENAMES,
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}

QWEN3 = Family(
    architecture="Qwen3ForCausalLM",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    qk_layernorm=True,
)
