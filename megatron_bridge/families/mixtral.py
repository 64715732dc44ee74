"""Mixtral (``MixtralForCausalLM``): Mistral's attention (optional sliding window on every
layer) with a mixture-of-experts MLP in every layer; no shared experts.

Routing as ``MixtralTopKRouter``: softmax over all experts' router logits, the top
``num_experts_per_tok`` chosen, their weights always renormalised to sum to 1. The experts'
intermediate size is ``intermediate_size`` (there is no dense MLP).
"""

from typing import Any, Mapping

from megatron_bridge.families.base import Family, Features, SparseMlp
from megatron_bridge.families.config_fields import COMMON_FIELDS, MOE_FIELDS, only, positive_or_null
from megatron_bridge.families.llama import GLOBAL_RENAMES, LAYER_RENAMES, QKV_FUSIONS

# Per layer: model.layers.{i}.block_sparse_moe.experts.{e}.w{1,2,3}.weight (w1 gate, w3 up,
# w2 down).
SPARSE_MLP = SparseMlp(
    router="block_sparse_moe.gate.weight",
    expert="block_sparse_moe.experts.{expert}.",
    gate_up=("w1.weight", "w3.weight"),
    down="w2.weight",
    ffn_field="intermediate_size",
)

CONFIG_FIELDS = {
    **COMMON_FIELDS,
    **MOE_FIELDS,
    "sliding_window": positive_or_null,
    # Multiplicative noise on the router's input while training: not implemented.
    "router_jitter_noise": only(0, 0.0, fix="set router_jitter_noise to 0"),
}


def features(config: Mapping[str, Any]) -> Features:
    window = config.get("sliding_window")
    return Features(
        window=int(window) if window else None,
        sparse_layers=(True,) * int(config["num_hidden_layers"]),
        norm_topk_prob=True,
    )


MIXTRAL = Family(
    architecture="MixtralForCausalLM",
    hf_config_class="MixtralConfig",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions={},
    config_fields=CONFIG_FIELDS,
    features=features,
    sparse_mlp=SPARSE_MLP,
)
