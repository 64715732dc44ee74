"""Every HF tensor accounted for: none missing, none of the wrong shape, none left over.

A conversion that reads only the tensors it expects and ignores the rest turns a checkpoint
whose config it misreads into a different model without a word (e.g. attention biases under
``attention_bias: false``). :func:`check_hf_tensors` runs before any conversion or load
(``convert``, ``verify``, the policy worker's HF load) and refuses such a checkpoint, naming
the tensors and the config option they belong to.

Accounted for without being converted: ``rotary_emb.inv_freq`` buffers that old transformers
versions saved (Megatron computes them from the config), and an ``lm_head.weight`` beside tied
embeddings when it equals the embedding (transformers ties it the same way).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Protocol

import torch

from megatron_bridge.config import BridgeConfig
from megatron_bridge.transforms import TensorReader

# HF tensor-name patterns -> the config option that makes a model have them.
_OPTION_OF_TENSOR = (
    (re.compile(r"\.self_attn\.[qkvo]_proj\.bias$"), "attention_bias"),
    (re.compile(r"\.mlp\.(gate|up|down)_proj\.bias$"), "mlp_bias"),
    (re.compile(r"\.self_attn\.[qk]_norm\.weight$"), "QK-norm (Qwen3ForCausalLM)"),
    (re.compile(r"^lm_head\.weight$"), "tie_word_embeddings"),
)


class CheckpointTensors(TensorReader, Protocol):
    """A whole checkpoint's tensors (e.g. :class:`megatron_bridge.load.SafetensorsReader`)."""

    path: Path

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        ...


_DERIVED_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_EMBEDDING = "model.embed_tokens.weight"


def _few(names: list[str], limit: int = 6) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _options(names: Iterable[str], bridge: BridgeConfig) -> str:
    """Which config options the tensors ``names`` belong to, with the config's values."""
    seen: dict[str, None] = {}
    for name in names:
        for pattern, option in _OPTION_OF_TENSOR:
            if pattern.search(name):
                seen[option] = None
    if not seen:
        return f"no option of the {bridge.family.architecture} conversion produces them"
    parts = []
    for option in seen:
        if option in bridge.hf_config:
            parts.append(f"{option}={bridge.hf_config[option]!r} in config.json")
        elif option in bridge.family.config_fields:
            parts.append(f"{option} (unset in config.json)")
        else:
            parts.append(f"{option}, which {bridge.family.architecture} models do not have")
    return "they belong to " + "; ".join(parts)


def _tied_head_equals_embedding(reader: CheckpointTensors) -> bool:
    head, embedding = reader.read("lm_head.weight"), reader.read(_EMBEDDING)
    return head.shape == embedding.shape and torch.equal(head, embedding)


def check_hf_tensors(reader: CheckpointTensors, bridge: BridgeConfig) -> None:
    """Check an HF checkpoint's tensors against what its config implies.

    Args:
        reader: the checkpoint's tensors (names, shapes; reads only for a tied lm_head).
        bridge: its config.

    Raises:
        ValueError: tensors the config implies are missing or have another shape, or the
            checkpoint holds tensors the conversion would drop; the message names them and
            the config option involved.
    """
    dims = bridge.dims(1)
    expected = {
        name: shape
        for mapping in bridge.plan()
        for name, shape in zip(mapping.hf_names, mapping.hf_shapes(dims))
    }
    present = set(reader.names())
    missing = sorted(set(expected) - present)
    if missing:
        raise ValueError(
            f"{reader.path} lacks tensors that its config.json implies: {_few(missing)} "
            f"({_options(missing, bridge)})"
        )
    for name, shape in expected.items():
        if reader.shape(name) != shape:
            raise ValueError(
                f"{reader.path}: tensor {name} has shape {reader.shape(name)}, the config "
                f"implies {shape}"
            )
    leftover = sorted(
        name for name in present - set(expected) if not _DERIVED_BUFFER.search(name)
    )
    if leftover == ["lm_head.weight"] and bridge.tie_word_embeddings:
        if _tied_head_equals_embedding(reader):
            return
        raise ValueError(
            f"{reader.path}: config.json sets tie_word_embeddings=true but lm_head.weight "
            f"differs from {_EMBEDDING}; if the model has its own output layer, set "
            f"tie_word_embeddings to false"
        )
    if leftover:
        raise ValueError(
            f"{reader.path} holds {len(leftover)} tensors the conversion would drop: "
            f"{_few(leftover)} ({_options(leftover, bridge)}); fix config.json so it describes "
            f"the checkpoint, or convert a checkpoint of a supported configuration"
        )
