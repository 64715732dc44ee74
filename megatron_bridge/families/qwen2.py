"""Qwen2 (``Qwen2ForCausalLM``): Llama plus a bias on the q/k/v projections."""

from megatron_bridge.families.base import Family
from megatron_bridge.families.llama import GATE_UP_FUSIONS, GLOBAL_RENAMES, LAYER_RENAMES

# The q/k/v biases are fused exactly like the weights (1-D, same per-group interleave).
QKV_FUSIONS = {
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
}

QWEN2 = Family(
    architecture="Qwen2ForCausalLM",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    qkv_bias=True,
)
