"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (QK-norm) with a mixture-of-experts
MLP in the layers ``decoder_sparse_step`` and ``mlp_only_layers`` select; no shared experts.

Routing as ``Qwen3MoeTopKRouter``: softmax over all experts' router logits, the top
``num_experts_per_tok`` chosen, their weights renormalised to sum to 1 when ``norm_topk_prob``.
"""

from typing import Any, Mapping

from megatron_bridge.families.base import Family, Features, SparseMlp
from megatron_bridge.families.config_fields import (
    COMMON_FIELDS,
    MOE_FIELDS,
    accepted,
    only,
    positive_or_null,
)
from megatron_bridge.families.llama import (
    GATE_UP_FUSIONS,
    GLOBAL_RENAMES,
    LAYER_RENAMES,
    QKV_FUSIONS,
)

# The experts' tensors, per layer: model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight.
SPARSE_MLP = SparseMlp(
    router="mlp.gate.weight",
    expert="mlp.experts.{expert}.",
    gate_up=("gate_proj.weight", "up_proj.weight"),
    down="down_proj.weight",
    ffn_field="moe_intermediate_size",
)

CONFIG_FIELDS = {
    **COMMON_FIELDS,
    **MOE_FIELDS,
    "attention_bias": only(False, fix="Qwen3-MoE attention biases are not supported"),
    "norm_topk_prob": only(True, False, fix="use a boolean"),
    "moe_intermediate_size": accepted,
    "decoder_sparse_step": accepted,
    "mlp_only_layers": accepted,
    # transformers applies the window to every layer when use_sliding_window is true.
    "use_sliding_window": only(True, False, fix="use a boolean"),
    "sliding_window": positive_or_null,
}


def sparse_layers(config: Mapping[str, Any]) -> tuple[bool, ...]:
    """Which layers have experts, as ``Qwen3MoeDecoderLayer`` decides: not listed in
    ``mlp_only_layers``, and every ``decoder_sparse_step``-th layer (1-based)."""
    step = int(config.get("decoder_sparse_step") or 1)
    dense = set(config.get("mlp_only_layers") or ())
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    return tuple(
        i not in dense and experts > 0 and (i + 1) % step == 0
        for i in range(int(config["num_hidden_layers"]))
    )


def features(config: Mapping[str, Any]) -> Features:
    # The resolved config's sliding_window is None unless use_sliding_window is set.
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    return Features(
        qk_layernorm=True,
        window=int(window) if window else None,
        sparse_layers=sparse_layers(config),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
    )


QWEN3_MOE = Family(
    architecture="Qwen3MoeForCausalLM",
    hf_config_class="Qwen3MoeConfig",
    global_renames=GLOBAL_RENAMES,
    layer_renames=LAYER_RENAMES,
    qkv_fusions=QKV_FUSIONS,
    gate_up_fusions=GATE_UP_FUSIONS,
    config_fields=CONFIG_FIELDS,
    features=features,
    sparse_mlp=SPARSE_MLP,
)
