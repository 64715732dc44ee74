"""Mistral (``MistralForCausalLM``): Llama's tensors; optional sliding window on every layer."""

from typing import Any, Mapping

from megatron_bridge.families.base import Family, Features
from megatron_bridge.families.config_fields import COMMON_FIELDS, positive_or_null
from megatron_bridge.families.llama import (
    GATE_UP_FUSIONS,
    GLOBAL_RENAMES,
    LAYER_RENAMES,
    QKV_FUSIONS,
)

CONFIG_FIELDS = {**COMMON_FIELDS, "sliding_window": positive_or_null}


def features(config: Mapping[str, Any]) -> Features:
    window = config.get("sliding_window")
    return Features(window=int(window) if window else None)


MISTRAL = Family(
    architecture="MistralForCausalLM",
    hf_config_class="MistralConfig",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    config_fields=CONFIG_FIELDS,
    features=features,
)
