"""Llama (``LlamaForCausalLM``): RMSNorm, SwiGLU, RoPE, GQA, optional biases."""

from typing import Any, Mapping

from megatron_bridge.families.base import Family, Features
from megatron_bridge.families.config_fields import COMMON_FIELDS, only

# HF name -> Megatron name, for tensors outside the decoder layers.
GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}

# HF per-layer suffix (after ``model.layers.{i}.``) -> Megatron suffix (after
# ``decoder.layers.{i}.``), for tensors copied as they are (TP-sliced along Megatron's dim).
LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}

# Megatron computes q, k and v in one GEMM, its rows interleaved per query group.
QKV_FUSIONS = {
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
}

# SwiGLU's gate and up projections are one column-parallel GEMM (linear_fc1) in Megatron.
GATE_UP_FUSIONS = {
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}

# attention_bias: biases on q, k, v and o; mlp_bias: on gate, up and down.
CONFIG_FIELDS = {
    **COMMON_FIELDS,
    "attention_bias": only(True, False, fix="use a boolean"),
    "mlp_bias": only(True, False, fix="use a boolean"),
}


def features(config: Mapping[str, Any]) -> Features:
    attention_bias = bool(config.get("attention_bias", False))
    return Features(
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
    )


LLAMA = Family(
    architecture="LlamaForCausalLM",
    hf_config_class="LlamaConfig",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    config_fields=CONFIG_FIELDS,
    features=features,
)
