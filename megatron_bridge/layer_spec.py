"""Per-linear-layer biases in a megatron-core layer spec.

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
from typing import Any

from megatron_bridge.families import Features


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
    """A copy of transformer-layer ``spec`` whose linear layers have biases exactly where
    ``features`` says, given a config with ``add_bias_linear = out_bias or mlp_bias`` and
    ``add_qkv_bias = qkv_bias``; ``spec`` itself when no layer needs changing."""
    if not (features.out_bias or features.mlp_bias):
        return spec  # add_bias_linear is off: only add_qkv_bias acts, exactly as wanted
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention.submodules
    mlp = spec.submodules.mlp.submodules
    if not features.qkv_bias:
        _drop_bias(attention, "linear_qkv")
    if not features.out_bias:
        _drop_bias(attention, "linear_proj")
    if not features.mlp_bias:
        _drop_bias(mlp, "linear_fc1")
        _drop_bias(mlp, "linear_fc2")
    return spec
