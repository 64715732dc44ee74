"""A Hugging Face PEFT adapter folder from LoRA adapter tensors in PEFT's layout.

The folder the ``peft`` package loads onto the base model in transformers
(``PeftModel.from_pretrained(base, folder)``):

* ``adapter_config.json``: a LoRA config (``peft_type`` ``LORA``, ``r`` = dim, ``lora_alpha``
  = alpha, so PEFT's scale ``lora_alpha / r`` is ours, ``target_modules``: the HF projection
  names when every decoder layer has the same adapted projections, else the full module
  names);
* ``adapter_model.safetensors``: ``base_model.model.<hf module>.lora_A.weight`` ``[r, in]``
  and ``.lora_B.weight`` ``[out, r]`` per adapted HF projection (the tensors of
  :func:`~megatron_bridge.lora_weights.export_lora_weights` or :func:`~megatron_bridge.
  dist_ckpt_reader.checkpoint_lora_weights` with PEFT's prefix).

PEFT applies dropout on the adapter's input only, so an adapter trained with
``dropout_position`` "post" is written with its dropout probability as is; dropout does not
change inference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megatron_bridge.lora import LoraSettings

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# What PEFT's PeftModel puts before the base model's own parameter names.
PEFT_PREFIX = "base_model.model."

_LAYER_MODULE = re.compile(r"^(.*\.layers\.)(\d+)\.(.+)$")


def _target_modules(modules: list[str], num_layers: int) -> list[str]:
    """PEFT's ``target_modules`` for the adapted HF ``modules`` (full names): the projection
    names (``q_proj``...) when every one of the ``num_layers`` decoder layers has the same
    adapted projections, else the full module names."""
    per_layer: dict[int, set[str]] = {}
    for module in modules:
        match = _LAYER_MODULE.match(module)
        assert match is not None, f"{module} is not a decoder layer's module"
        per_layer.setdefault(int(match.group(2)), set()).add(match.group(3).rsplit(".", 1)[-1])
    shapes = {frozenset(projections) for projections in per_layer.values()}
    if set(per_layer) == set(range(num_layers)) and len(shapes) == 1:
        return sorted(next(iter(shapes)))
    return sorted(modules)


def adapter_config(
    settings: LoraSettings, modules: list[str], num_layers: int, base_model: str | None
) -> dict[str, Any]:
    """The ``adapter_config.json`` of adapters on the HF ``modules`` (full names, e.g.
    ``model.layers.0.self_attn.q_proj``) of a ``num_layers``-layer model."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.dim,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": _target_modules(modules, num_layers),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def save_peft_adapter(
    tensors: Iterable[tuple[str, torch.Tensor]],
    settings: LoraSettings,
    num_layers: int,
    out_dir: str | Path,
    base_model: str | None = None,
) -> None:
    """Write the PEFT adapter folder ``out_dir`` (created if missing).

    Args:
        tensors: ``(<hf module>.lora_A.weight | .lora_B.weight, tensor)`` of every adapter
            (the adapters are small: held in memory together).
        settings: the adapters' rank, alpha and dropout.
        num_layers: decoder layers of the base model.
        base_model: recorded as ``base_model_name_or_path`` (the hub name or folder the
            adapters were trained on); None leaves it unset.
    """
    # a fused linear's projections share one A tensor: each name gets its own copy
    weights = {f"{PEFT_PREFIX}{name}": t.clone(memory_format=torch.contiguous_format)
               for name, t in tensors}
    modules = sorted({name.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0] for name in weights})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    config = adapter_config(settings, modules, num_layers, base_model)
    (out / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
