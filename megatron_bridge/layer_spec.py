"""The megatron-core layer spec of a model stage, and its per-linear-layer biases.

:func:`gpt_stage_spec` chooses the spec every Megatron model here is built from (the bridge's
converter and the policy worker alike): megatron's decoder block spec for a mixture-of-experts
model (per layer a dense MLP or the experts), the TransformerEngine layer spec where
TransformerEngine is importable, the local spec otherwise (as a block spec, its norms our
sequence-parallel capable :class:`~megatron_bridge.norm.LocalNorm`).

megatron-core has two bias switches: ``add_qkv_bias`` (the fused q/k/v projection) and
``add_bias_linear`` (every linear layer: q/k/v, the attention output projection, and both MLP
projections). HF models switch them finer: Llama's ``attention_bias`` puts biases on q/k/v/o
but not on the MLP, ``mlp_bias`` on the MLP only. :func:`with_model_biases` turns
``add_bias_linear`` on when any of o_proj or the MLP has biases (see
:meth:`megatron_bridge.config.BridgeConfig.transformer_config`) and swaps the linear layers
that must stay without bias for subclasses that build none, so the model holds exactly the
HF checkpoint's tensors. It works on the local and the TransformerEngine specs alike (their
linear classes all take ``bias=``).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from typing import Any

from megatron_bridge.families import Features
from megatron_bridge.norm import LocalNorm


def transformer_engine_available() -> bool:
    """True when the ``transformer_engine`` package can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_use_te(use_te: bool | None) -> bool:
    """Whether to build TransformerEngine modules: ``use_te``, or (None) whether
    TransformerEngine is importable.

    Raises:
        ValueError: ``use_te=True`` but TransformerEngine is not installed.
    """
    have_te = transformer_engine_available()
    if use_te and not have_te:
        raise ValueError(
            "use_te=True but transformer_engine is not installed: install it (GPU only) or "
            "pass use_te=None/False for the local spec"
        )
    return have_te if use_te is None else use_te


def gpt_stage_spec(
    config: Any,
    use_te: bool | None = None,
    core_attention: type | None = None,
    grouped_experts: bool = False,
) -> Any:
    """The layer spec of this pipeline stage's layers for a model of ``config``.

    With TransformerEngine a dense model gets its layer spec for every layer. Otherwise (and
    for every mixture-of-experts model) the spec is megatron's decoder block spec: one layer
    spec per layer of this rank's stage (a dense MLP or the experts, from
    ``config.moe_layer_freq``; all dense for a dense model) and the final norm. The local spec
    gets :class:`~megatron_bridge.norm.LocalNorm` for every norm (``config.normalization``;
    it supports sequence parallelism, megatron's local norm does not).

    Args:
        config: the model's megatron ``TransformerConfig``.
        use_te: as :func:`resolve_use_te`.
        core_attention: replaces the local spec's attention kernel in every layer (e.g. a
            context-parallel one); TransformerEngine's spec keeps its own.
        grouped_experts: run each layer's experts as grouped GEMMs
            (:class:`~megatron_bridge.grouped_experts.GroupedGemmExperts`, same parameters and
            checkpoint as megatron's ``SequentialMLP``); False keeps megatron's loop.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    use_te = resolve_use_te(use_te)
    if use_te and config.num_moe_experts is None:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, normalization=config.normalization
    )
    if grouped_experts:
        _use_grouped_experts(spec)
    if use_te:
        return spec
    spec.layer_norm = LocalNorm
    for layer in _distinct(spec.layer_specs):
        _use_local_norms(layer.submodules, ("input_layernorm", "pre_mlp_layernorm"))
        attention = layer.submodules.self_attention.submodules
        _use_local_norms(attention, ("q_layernorm", "k_layernorm"))
        if core_attention is not None:
            attention.core_attention = core_attention
    return spec


def _use_grouped_experts(block_spec: Any) -> None:
    """Swap megatron's ``SequentialMLP`` experts of every MoE layer for
    :class:`~megatron_bridge.grouped_experts.GroupedGemmExperts`."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_bridge.grouped_experts import GroupedGemmExperts

    for layer in _distinct(block_spec.layer_specs):
        experts = getattr(layer.submodules.mlp.submodules, "experts", None)
        if experts is not None and experts.module is SequentialMLP:
            experts.module = GroupedGemmExperts


def _distinct(specs: list[Any]) -> list[Any]:
    """``specs`` without repeats (a block spec repeats one layer spec object per layer)."""
    return list({id(spec): spec for spec in specs}.values())


def _use_local_norms(submodules: Any, names: tuple[str, ...]) -> None:
    """Set each of ``names`` that holds a norm (not ``IdentityOp``) to :class:`LocalNorm`."""
    from megatron.core.transformer.identity_op import IdentityOp

    for name in names:
        if getattr(submodules, name) not in (None, IdentityOp):
            setattr(submodules, name, LocalNorm)


@functools.cache
def without_bias(linear_class: type) -> type:
    """``linear_class`` built with ``bias=False`` whatever the config says."""

    def __init__(self: Any, *args: Any, bias: bool = False, **kwargs: Any) -> None:
        linear_class.__init__(self, *args, bias=False, **kwargs)

    return type(
        f"{linear_class.__name__}WithoutBias",
        (linear_class,),
        {"__init__": __init__, "__module__": __name__, "__doc__": without_bias.__doc__},
    )


def _drop_bias(submodules: Any, name: str) -> None:
    spec = getattr(submodules, name)
    if hasattr(spec, "module"):  # a ModuleSpec: keep its params and submodules
        spec.module = without_bias(spec.module)
    else:
        setattr(submodules, name, without_bias(spec))


def with_model_biases(spec: Any, features: Features) -> Any:
    """A copy of ``spec`` (a transformer-layer spec or a block spec of them) whose linear
    layers have biases exactly where ``features`` says, given a config with
    ``add_bias_linear = out_bias or mlp_bias`` and ``add_qkv_bias = qkv_bias``; ``spec`` itself
    when no layer needs changing."""
    if not (features.out_bias or features.mlp_bias):
        return spec  # add_bias_linear is off: only add_qkv_bias acts, exactly as wanted
    spec = copy.deepcopy(spec)
    for layer in _distinct(getattr(spec, "layer_specs", [spec])):
        attention = layer.submodules.self_attention.submodules
        mlp = layer.submodules.mlp.submodules
        if not features.qkv_bias:
            _drop_bias(attention, "linear_qkv")
        if not features.out_bias:
            _drop_bias(attention, "linear_proj")
        if not features.mlp_bias:
            _drop_bias(mlp, "linear_fc1")
            _drop_bias(mlp, "linear_fc2")
    return spec
