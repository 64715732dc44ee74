"""What a model family is (rename tables + fusions) and the conversion plan built from it.

A :class:`Family` is declarative: which HF tensors map 1:1 onto which Megatron tensors, which
HF tensors are fused into one Megatron tensor, the names of its mixture-of-experts block when
it has one (:class:`SparseMlp`), and which config fields it implements (with the
:class:`Features` they select: biases, QK-norm, sliding windows, which layers are sparse).
:meth:`Family.plan` expands it, for a given number of layers, features and experts, into
:class:`ParamMapping` s; each mapping knows how to build one
tensor-parallel rank's Megatron tensor from HF tensors (:meth:`ParamMapping.shard`) and how
to turn all ranks' tensors back into HF tensors (:meth:`ParamMapping.unshard`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch

from megatron_bridge import transforms

Kind = Literal["copy", "qkv", "gate_up", "vocab"]

HF_LAYER_PREFIX = "model.layers.{layer}."
MEGATRON_LAYER_PREFIX = "decoder.layers.{layer}."

# Megatron tensors whose rows are vocabulary entries (padded, never exported padded).
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
# A sequence classifier (``<Family>ForSequenceClassification``) keeps its score head where a
# causal LM keeps its LM head; HF calls it ``score.weight`` ([num_labels, hidden], replicated).
SCORE_TENSOR = "output_layer.weight"
SCORE_HF_NAME = "score.weight"

# With TransformerEngine the pre-attention / pre-MLP RMSNorms are fused into the following
# linear layer, so their weights live under that layer's name; megatron-core's checkpoints use
# these names with either layer spec.
TE_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

# Weights of row-parallel linear layers: TP ranks hold column slices. The fused kinds (qkv,
# gate/up) and the vocabulary are split along rows; the norms and the router are replicated.
# ``linear_fc2.weight`` covers the dense MLP's and every expert's down projection.
ROW_PARALLEL_SUFFIXES = ("self_attention.linear_proj.weight", "linear_fc2.weight")

# Megatron names in a sparse layer (suffixes after ``decoder.layers.{i}.``): megatron-core's
# MoELayer with a TopKRouter and SequentialMLP experts (local spec, or TE without grouped GEMM).
ROUTER_NAME = "mlp.router.weight"
EXPERT_PREFIX = "mlp.experts.local_experts.{expert}."


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
    moe_ffn: int = 0
    num_experts: int = 0
    num_labels: int = 1  # rows of a sequence-classification score head


@dataclass(frozen=True)
class Features:
    """What one model's config switches on beyond its sizes: optional tensors and attention.

    Attributes:
        qkv_bias: the q/k/v projections have biases.
        out_bias: the attention output projection (o_proj) has a bias.
        mlp_bias: the gate/up/down projections have biases.
        qk_layernorm: per-head RMSNorm on queries and keys.
        window: sliding-window size in tokens (a query attends to itself and the
            ``window - 1`` tokens before it); None for full causal attention everywhere.
        window_layers: with a window, which layers use it (index = layer); None for all.
        sparse_layers: which layers have a mixture-of-experts MLP (index = layer); empty for
            a dense model.
        norm_topk_prob: the top-k routing weights are renormalised to sum to 1 (else they
            are the softmax over all experts, taken at the chosen ones).
    """

    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_layernorm: bool = False
    window: int | None = None
    window_layers: tuple[bool, ...] | None = None
    sparse_layers: tuple[bool, ...] = ()
    norm_topk_prob: bool = False

    def is_sparse(self, layer: int) -> bool:
        """True when decoder layer ``layer`` (0-based) has experts instead of a dense MLP."""
        return bool(self.sparse_layers) and self.sparse_layers[layer]


@dataclass(frozen=True)
class SparseMlp:
    """HF names of a family's mixture-of-experts block (suffixes after ``model.layers.{i}.``)
    and the config field holding the experts' hidden size.

    Attributes:
        router: the router (gate) weight ``[num_experts, hidden]``.
        expert: prefix of expert ``{expert}``'s tensors, e.g. "mlp.experts.{expert}.".
        gate_up: the expert's gate and up projections (fused into Megatron's linear_fc1).
        down: the expert's down projection.
        ffn_field: config field of the expert's intermediate size.
    """

    router: str
    expert: str
    gate_up: tuple[str, str]
    down: str
    ffn_field: str


# Tensors an option adds, named alike in every family here (HF suffix after
# ``model.layers.{i}.``, Megatron suffix after ``decoder.layers.{i}.``). Biases follow their
# weight's layout: q/k/v biases fused per query group, gate/up biases fused like the rows.
QKV_BIAS_FUSIONS = {
    "self_attention.linear_qkv.bias": (
        "self_attn.q_proj.bias",
        "self_attn.k_proj.bias",
        "self_attn.v_proj.bias",
    ),
}
OUT_BIAS_RENAMES = {"self_attn.o_proj.bias": "self_attention.linear_proj.bias"}
MLP_BIAS_RENAMES = {"mlp.down_proj.bias": "mlp.linear_fc2.bias"}
MLP_BIAS_FUSIONS = {"mlp.linear_fc1.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias")}
QK_NORM_RENAMES = {
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}

# A config-field check: the field's value and the whole config -> why it cannot be converted,
# or None when the conversion implements it (see megatron_bridge.families.config_fields).
FieldCheck = Callable[[Any, Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class Family:
    """One HF architecture: rename tables, fusions, the config fields it implements.

    Attributes:
        architecture: HF ``architectures[0]``, e.g. "LlamaForCausalLM".
        hf_config_class: the transformers config class, e.g. "LlamaConfig": its defaults fill
            the fields config.json leaves out, as transformers fills them.
        global_renames: HF name -> Megatron name outside the decoder layers.
        layer_renames: per-layer HF suffix -> Megatron suffix, copied unchanged.
        qkv_fusions: Megatron suffix -> (q, k, v) HF suffixes fused per query group.
        gate_up_fusions: Megatron suffix -> (gate, up) HF suffixes fused into linear_fc1.
        config_fields: every config.json field this family understands -> its check. A field
            not listed is refused: it could change the computation.
        features: the config -> the :class:`Features` it selects.
        sparse_mlp: the mixture-of-experts block's names; None for a dense family.
    """

    architecture: str
    hf_config_class: str
    global_renames: dict[str, str]
    layer_renames: dict[str, str]
    qkv_fusions: dict[str, tuple[str, str, str]]
    gate_up_fusions: dict[str, tuple[str, str]]
    config_fields: Mapping[str, FieldCheck]
    features: Callable[[Mapping[str, Any]], Features]
    sparse_mlp: SparseMlp | None = None

    def plan(
        self, num_layers: int, tie_word_embeddings: bool, features: Features, num_experts: int = 0
    ) -> list["ParamMapping"]:
        """Every Megatron tensor of a full model, in export order (embedding, layers, head).

        In a sparse layer (``features.is_sparse``) the dense MLP's tensors are replaced by the
        router and ``num_experts`` experts' (global expert indices, as at EP=1).

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
        renames = dict(self.layer_renames)
        qkv_fusions = dict(self.qkv_fusions)
        gate_up_fusions = dict(self.gate_up_fusions)
        if features.qk_layernorm:
            renames.update(QK_NORM_RENAMES)
        if features.qkv_bias:
            qkv_fusions.update(QKV_BIAS_FUSIONS)
        if features.out_bias:
            renames.update(OUT_BIAS_RENAMES)
        if features.mlp_bias:
            renames.update(MLP_BIAS_RENAMES)
            gate_up_fusions.update(MLP_BIAS_FUSIONS)
        layers = [
            mapping
            for layer in range(num_layers)
            for mapping in self._layer_mappings(
                layer, renames, qkv_fusions, gate_up_fusions, features, num_experts
            )
        ]
        return first + layers + last

    def _layer_mappings(
        self, layer: int, renames: dict[str, str], qkv_fusions: dict[str, tuple[str, str, str]],
        gate_up_fusions: dict[str, tuple[str, str]], features: Features, num_experts: int,
    ) -> list["ParamMapping"]:
        """The mappings of decoder layer ``layer``: attention and norms, then its MLP (dense,
        or the router and every expert)."""
        hf_prefix = HF_LAYER_PREFIX.format(layer=layer)
        mg_prefix = MEGATRON_LAYER_PREFIX.format(layer=layer)
        sparse = features.is_sparse(layer)
        if sparse:  # the experts replace the dense MLP
            renames = {h: m for h, m in renames.items() if not m.startswith("mlp.")}
            gate_up_fusions = {}
        out = [ParamMapping(mg_prefix + m, (hf_prefix + h,), "copy", layer)
               for h, m in renames.items()]
        for megatron, hf_names in qkv_fusions.items():
            names = tuple(hf_prefix + n for n in hf_names)
            out.append(ParamMapping(mg_prefix + megatron, names, "qkv", layer))
        for megatron, hf_names in gate_up_fusions.items():
            names = tuple(hf_prefix + n for n in hf_names)
            out.append(ParamMapping(mg_prefix + megatron, names, "gate_up", layer))
        if sparse:
            out.extend(self._expert_mappings(layer, num_experts))
        return out

    def _expert_mappings(self, layer: int, num_experts: int) -> list["ParamMapping"]:
        """Layer ``layer``'s router and experts (router first, experts in index order)."""
        names = self.sparse_mlp
        if names is None:
            raise ValueError(f"{self.architecture} has no mixture-of-experts layers")
        hf_prefix = HF_LAYER_PREFIX.format(layer=layer)
        mg_prefix = MEGATRON_LAYER_PREFIX.format(layer=layer)
        out = [ParamMapping(mg_prefix + ROUTER_NAME, (hf_prefix + names.router,), "copy", layer)]
        for e in range(num_experts):
            hf_expert = hf_prefix + names.expert.format(expert=e)
            mg_expert = mg_prefix + EXPERT_PREFIX.format(expert=e)
            out.append(ParamMapping(
                mg_expert + "linear_fc1.weight", tuple(hf_expert + n for n in names.gate_up),
                "gate_up", layer, e,
            ))
            out.append(ParamMapping(
                mg_expert + "linear_fc2.weight", (hf_expert + names.down,), "copy", layer, e
            ))
        return out


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron tensor and the HF tensor(s) it is made of.

    Attributes:
        megatron_name: name in a full (PP=1) GPTModel, global layer index.
        hf_names: the HF tensors, in the order the transform takes them.
        kind: "copy" (rename, maybe TP-sliced), "qkv", "gate_up" or "vocab".
        layer: global decoder-layer index, None outside the layers.
        expert: global expert index for an expert's tensors, None otherwise.
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: Kind
    layer: int | None = None
    expert: int | None = None

    @property
    def tp_dim(self) -> int | None:
        """The dim Megatron splits this tensor along across TP ranks (0 column-parallel
        rows and vocabulary rows, 1 row-parallel columns), None when replicated."""
        if self.kind != "copy":
            return 0
        return 1 if self.megatron_name.endswith(ROW_PARALLEL_SUFFIXES) else None

    def megatron_shape(self, dims: ModelDims) -> tuple[int, ...]:
        """Shape of the whole (TP=1) Megatron tensor; vocabulary rows padded."""
        hidden, name, ffn = dims.hidden_size, self.megatron_name, self.ffn(dims)
        if self.kind == "vocab":
            return (dims.padded_vocab_size, hidden)
        if self.kind == "gate_up":
            return (2 * ffn, hidden) if name.endswith(".weight") else (2 * ffn,)
        if self.kind == "qkv":
            rows = (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim
            return (rows, hidden) if name.endswith(".weight") else (rows,)
        if name == SCORE_TENSOR:  # a sequence classifier's head: one row per label
            return (dims.num_labels, hidden)
        if name.endswith("self_attention.linear_proj.weight"):
            return (hidden, dims.num_heads * dims.head_dim)
        if name.endswith("linear_fc2.weight"):
            return (hidden, ffn)
        if name.endswith(ROUTER_NAME):
            return (dims.num_experts, hidden)
        if name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            return (dims.head_dim,)
        return (hidden,)  # input / pre-MLP / final RMSNorm, o_proj and down_proj biases

    def hf_shapes(self, dims: ModelDims) -> list[tuple[int, ...]]:
        """Shapes of the HF tensors, in ``hf_names`` order (the unshard of a meta tensor)."""
        meta = torch.empty(self.megatron_shape(dims), device="meta")
        return [tuple(t.shape) for t in self.unshard([meta], dims)]

    def ffn(self, dims: ModelDims) -> int:
        """The MLP intermediate size this tensor belongs to (an expert's or the dense one)."""
        return dims.ffn if self.expert is None else dims.moe_ffn

    def local_name(self, layer_offset: int, expert_offset: int = 0) -> str:
        """The name in a pipeline stage whose first layer is global layer ``layer_offset``,
        on an expert-parallel rank whose first expert is global expert ``expert_offset``."""
        if self.layer is None:
            return self.megatron_name
        prefix = MEGATRON_LAYER_PREFIX.format(layer=self.layer)
        local = MEGATRON_LAYER_PREFIX.format(layer=self.layer - layer_offset)
        suffix = self.megatron_name[len(prefix) :]
        if self.expert is not None:
            rest = suffix[len(EXPERT_PREFIX.format(expert=self.expert)) :]
            suffix = EXPERT_PREFIX.format(expert=self.expert - expert_offset) + rest
        return local + suffix

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
            return transforms.gate_up_shard(
                reader, self.hf_names, self.ffn(dims), tp_rank, tp_size
            )
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
