"""Qwen3 (``Qwen3ForCausalLM``): Llama plus per-head RMSNorm on queries and keys (QK-norm),
optional attention biases and Qwen2's sliding windows."""

from typing import Any, Mapping

from megatron_bridge.families.base import Family, Features
from megatron_bridge.families.config_fields import (
    COMMON_FIELDS,
    QWEN_WINDOW_FIELDS,
    only,
    qwen_window,
)
from megatron_bridge.families.llama import (
    GATE_UP_FUSIONS,
    GLOBAL_RENAMES,
    LAYER_RENAMES,
    QKV_FUSIONS,
)

CONFIG_FIELDS = {
    **COMMON_FIELDS,
    **QWEN_WINDOW_FIELDS,
    "attention_bias": only(True, False, fix="use a boolean"),
}


def features(config: Mapping[str, Any]) -> Features:
    window, window_layers = qwen_window(config)
    attention_bias = bool(config.get("attention_bias", False))
    return Features(
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        qk_layernorm=True,
        window=window,
        window_layers=window_layers,
    )


QWEN3 = Family(
    architecture="Qwen3ForCausalLM",
    hf_config_class="Qwen3Config",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    config_fields=CONFIG_FIELDS,
    features=features,
)
