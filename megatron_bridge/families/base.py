"""What a model family is (rename tables + fusions) and the conversion plan built from it.

A :class:`Family` is declarative: which HF tensors map 1:1 onto which Megatron tensors, and
which HF tensors are fused into one Megatron tensor. :meth:`Family.plan` expands it, for a
given number of layers, into :class:`ParamMapping` s; each mapping knows how to build one
tensor-parallel rank's Megatron tensor from HF tensors (:meth:`ParamMapping.shard`) and how
to turn all ranks' tensors back into HF tensors (:meth:`ParamMapping.unshard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_bridge import transforms

Kind = Literal["copy", "qkv", "gate_up", "vocab"]

HF_LAYER_PREFIX = "model.layers.{layer}."
MEGATRON_LAYER_PREFIX = "decoder.layers.{layer}."

# Megatron tensors whose rows are vocabulary entries (padded, never exported padded).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

# With TransformerEngine the pre-attention / pre-MLP RMSNorms are fused into the following
# linear layer, so their weights live under that layer's name; megatron-core's checkpoints use
# these names with either layer spec.
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

# Weights of row-parallel linear layers: TP ranks hold column slices. The fused kinds (qkv,
# gate/up) and the vocabulary are split along rows; the norms are replicated.
ROW_PARALLEL_SUFFIXES = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


@dataclass(frozen=True)
class ModelDims:
    """The sizes the transforms need (all counts; sizes in elements)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    padded_vocab_size: int


@dataclass(frozen=True)
class Family:
    """One HF architecture: rename tables, fusions and the feature flags config.py reads.

    Attributes:
        architecture: HF ``architectures[0]``, e.g. "LlamaForCausalLM".
        global_renames: HF name -> Megatron name outside the decoder layers.
        layer_renames: per-layer HF suffix -> Megatron suffix, copied unchanged.
        qkv_fusions: Megatron suffix -> (q, k, v) HF suffixes fused per query group.
        gate_up_fusions: Megatron suffix -> (gate, up) HF suffixes fused into linear_fc1.
        qkv_bias: the q/k/v projections have biases.
        qk_layernorm: per-head RMSNorm on queries and keys.
        sliding_window: the HF config may set ``sliding_window``.
    """

    architecture: str
    global_renames: dict[str, str]
    layer_renames: dict[str, str]
    qkv_fusions: dict[str, tuple[str, str, str]]
    gate_up_fusions: dict[str, tuple[str, str]]
    qkv_bias: bool = False
    qk_layernorm: bool = False
    sliding_window: bool = False

    def plan(self, num_layers: int, tie_word_embeddings: bool) -> list["ParamMapping"]:
        """Every Megatron tensor of a full model, in export order (embedding, layers, head).

        With tied embeddings there is no separate ``lm_head.weight``; the output layer (which
        Megatron still allocates on the last pipeline stage when PP > 1) is loaded from the
        embedding and not exported.
        """
        head = [
            ParamMapping(megatron, (hf,), "vocab" if megatron in VOCAB_TENSORS else "copy")
            for hf, megatron in self.global_renames.items()
            if not (tie_word_embeddings and megatron == "output_layer.weight")
        ]
        first = [m for m in head if m.megatron_name == "embedding.word_embeddings.weight"]
        last = [m for m in head if m.megatron_name != "embedding.word_embeddings.weight"]
        layers: list[ParamMapping] = []
        for layer in range(num_layers):
            hf_prefix = HF_LAYER_PREFIX.format(layer=layer)
            mg_prefix = MEGATRON_LAYER_PREFIX.format(layer=layer)
            for hf, megatron in self.layer_renames.items():
                layers.append(ParamMapping(mg_prefix + megatron, (hf_prefix + hf,), "copy", layer))
            for megatron, hf_names in self.qkv_fusions.items():
                names = tuple(hf_prefix + n for n in hf_names)
                layers.append(ParamMapping(mg_prefix + megatron, names, "qkv", layer))
            for megatron, hf_names in self.gate_up_fusions.items():
                names = tuple(hf_prefix + n for n in hf_names)
                layers.append(ParamMapping(mg_prefix + megatron, names, "gate_up", layer))
        return first + layers + last


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron tensor and the HF tensor(s) it is made of.

    Attributes:
        megatron_name: name in a full (PP=1) GPTModel, global layer index.
        hf_names: the HF tensors, in the order the transform takes them.
        kind: "copy" (rename, maybe TP-sliced), "qkv", "gate_up" or "vocab".
        layer: global decoder-layer index, None outside the layers.
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: Kind
    layer: int | None = None

    @property
    def tp_dim(self) -> int | None:
        """The dim Megatron splits this tensor along across TP ranks (0 column-parallel
        rows and vocabulary rows, 1 row-parallel columns), None when replicated."""
        if self.kind != "copy":
            return 0
        return 1 if self.megatron_name.endswith(ROW_PARALLEL_SUFFIXES) else None

    def megatron_shape(self, dims: ModelDims) -> tuple[int, ...]:
        """Shape of the whole (TP=1) Megatron tensor; vocabulary rows padded."""
        hidden, name = dims.hidden_size, self.megatron_name
        if self.kind == "vocab":
            return (dims.padded_vocab_size, hidden)
        if self.kind == "gate_up":
            return (2 * dims.ffn, hidden)
        if self.kind == "qkv":
            rows = (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim
            return (rows, hidden) if name.endswith(".weight") else (rows,)
        if name.endswith("self_attention.linear_proj.weight"):
            return (hidden, dims.num_heads * dims.head_dim)
        if name.endswith("mlp.linear_fc2.weight"):
            return (hidden, dims.ffn)
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            return (dims.head_dim,)
        return (hidden,)  # input / pre-MLP / final RMSNorm

    def hf_shapes(self, dims: ModelDims) -> list[tuple[int, ...]]:
        """Shapes of the HF tensors, in ``hf_names`` order (the unshard of a meta tensor)."""
        meta = torch.empty(self.megatron_shape(dims), device="meta")
        return [tuple(t.shape) for t in self.unshard([meta], dims)]

    def local_name(self, layer_offset: int) -> str:
        """The name in a pipeline stage whose first layer is global layer ``layer_offset``."""
        if self.layer is None:
            return self.megatron_name
        prefix = MEGATRON_LAYER_PREFIX.format(layer=self.layer)
        local = MEGATRON_LAYER_PREFIX.format(layer=self.layer - layer_offset)
        return local + self.megatron_name[len(prefix) :]

    def shard(
        self, reader: transforms.TensorReader, dims: ModelDims, tp_rank: int, tp_size: int
    ) -> torch.Tensor:
        """This TP rank's Megatron tensor, reading only its part of the HF tensors."""
        if self.kind == "qkv":
            return transforms.qkv_shard(
                reader, self.hf_names, dims.num_heads, dims.num_kv_heads, dims.head_dim,
                tp_rank, tp_size,
            )
        if self.kind == "gate_up":
            return transforms.gate_up_shard(reader, self.hf_names, dims.ffn, tp_rank, tp_size)
        if self.kind == "vocab":
            return transforms.vocab_shard(
                reader, self.hf_names[0], dims.vocab_size, dims.padded_vocab_size,
                tp_rank, tp_size,
            )
        return transforms.split_shard(reader, self.hf_names[0], self.tp_dim, tp_rank, tp_size)

    def unshard(self, shards: list[torch.Tensor], dims: ModelDims) -> list[torch.Tensor]:
        """The HF tensors (in ``hf_names`` order) from every TP rank's tensor, rank order."""
        if self.kind == "qkv":
            return transforms.qkv_unshard(shards, dims.num_heads, dims.num_kv_heads, dims.head_dim)
        if self.kind == "gate_up":
            return transforms.gate_up_unshard(shards)
        if self.kind == "vocab":
            return transforms.vocab_unshard(shards, dims.vocab_size)
        return transforms.split_unshard(shards, self.tp_dim)
