"""Mistral (``MistralForCausalLM``): Llama's tensors; optional sliding-window attention."""

from megatron_bridge.families.base import Family
from megatron_bridge.families.llama import (
    GATE_UP_FUSIONS,
    GLOBAL_RENAMES,
    LAYER_RENAMES,
    QKV_FUSIONS,
)

# Same tensor names and layouts as Llama; the sliding window (config.sliding_window) is a
# config setting handled in megatron_bridge.config, not a weight transform.
MISTRAL = Family(
    architecture="MistralForCausalLM",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    sliding_window=True,
)
