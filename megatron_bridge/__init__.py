"""HF <-> Megatron-Core weight conversion with TP/PP resharding and streaming export.

Public API:
    BridgeConfig: an HF config plus what Megatron needs (family, vocabulary padding).
    load_hf_into_megatron: build this rank's GPTModel and stream an HF checkpoint into it.
    export_hf_weights: stream HF-layout tensors out of a sharded Megatron model.
    megatron_logits: full-vocabulary logits from a sharded model (verification).
    save_hf_checkpoint / save_megatron_checkpoint / load_megatron_checkpoint: checkpoints.
    convert_hf_to_dist_checkpoint: HF safetensors -> Megatron dist checkpoint, streamed,
        without building a model (the ``convert`` CLI).
    checkpoint_hf_weights: stream HF-layout tensors out of a Megatron dist checkpoint.
"""

from megatron_bridge.checkpoint import (
    checkpoint_bridge,
    load_megatron_checkpoint,
    save_hf_checkpoint,
    save_megatron_checkpoint,
)
from megatron_bridge.config import BridgeConfig, dtype_from_name
from megatron_bridge.dist_ckpt_reader import checkpoint_hf_weights
from megatron_bridge.dist_ckpt_writer import convert_hf_to_dist_checkpoint
from megatron_bridge.export import export_hf_weights
from megatron_bridge.families import FAMILIES, get_family
from megatron_bridge.forward import megatron_logits
from megatron_bridge.load import build_gpt_model, load_hf_into_megatron, load_hf_weights

__all__ = [
    "FAMILIES",
    "BridgeConfig",
    "build_gpt_model",
    "checkpoint_bridge",
    "checkpoint_hf_weights",
    "convert_hf_to_dist_checkpoint",
    "dtype_from_name",
    "export_hf_weights",
    "get_family",
    "load_hf_into_megatron",
    "load_hf_weights",
    "load_megatron_checkpoint",
    "megatron_logits",
    "save_hf_checkpoint",
    "save_megatron_checkpoint",
]
