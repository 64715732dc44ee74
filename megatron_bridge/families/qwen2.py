"""Qwen2 (``Qwen2ForCausalLM``): Llama with q/k/v biases and optional sliding windows on the
upper layers (``use_sliding_window``, ``sliding_window``, ``max_window_layers``)."""

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
    "use_mrope": only(False, fix="multimodal RoPE (Qwen2-VL) is not supported"),
}


def features(config: Mapping[str, Any]) -> Features:
    window, window_layers = qwen_window(config)
    return Features(qkv_bias=True, window=window, window_layers=window_layers)


QWEN2 = Family(
    architecture="Qwen2ForCausalLM",
    hf_config_class="Qwen2Config",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    config_fields=CONFIG_FIELDS,
    features=features,
)
