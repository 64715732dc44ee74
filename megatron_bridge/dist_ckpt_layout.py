"""What megatron-core's ``dist_checkpointing`` writes for our GPTModel, computed without it.

A Megatron distributed checkpoint (``torch_dist`` format) stores each tensor under a key that
does not depend on TP/PP/EP, and each rank writes its TP slice of it as one chunk (a global
offset and a size). Only the main replica of a tensor is written: TP-replicated tensors
(norms, the router) and the linear layers' (empty) ``_extra_state`` objects come from TP
rank 0 only, data-parallel copies from data-parallel rank 0 only.

How decoder tensors are keyed depends on whether the layers are alike:

* Dense model (every layer alike): stacked along a leading layer axis, key without the layer
  index (``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, (nq+2nkv)*d,
  h]``).
* Mixture-of-experts model: megatron-core keys each layer on its own
  (``decoder.layers.3.self_attention.linear_qkv.weight``, global layer index, no layer axis),
  because our MoE config gives ``moe_layer_freq`` as a per-layer list (its "non-homogeneous
  layers"). The experts of a layer (``SequentialMLP``) are stacked along a leading expert
  axis under ``decoder.layers.<i>.mlp.experts.experts.linear_fc1.weight`` ``[num_experts,
  2*ffn, h]`` (and ``linear_fc2``), one chunk per expert and TP rank (experts are split over
  TP as the dense MLP is: expert tensor parallelism = TP). An expert-parallel rank writes its
  own experts' chunks, so the stored tensors, and this layout, are the same at every EP.

:func:`rank_layout` lists the chunks and objects one (TP, PP, EP) rank of a GPTModel built by
:func:`megatron_bridge.load.build_gpt_model` writes, exactly as ``model.sharded_state_dict()``
describes them (keys, global shapes, offsets, sizes; the unit tests compare the two), with the
:class:`~megatron_bridge.families.ParamMapping` whose HF tensors fill each chunk. This lets the
converter write the checkpoint straight from HF files without building the model or importing
megatron-core, and the reader find any HF tensor's region.

Layout facts encoded here (megatron-core 0.16, local and TransformerEngine specs alike):

* Names: the pre-attention / pre-MLP norms are saved under the TransformerEngine names
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``).
* Fused gate/up ``linear_fc1`` (dense or an expert's): each TP rank writes two chunks, its
  gate rows at offset ``r * ffn/tp`` and its up rows at ``ffn + r * ffn/tp``, so the stored
  tensor is ``cat(gate, up)`` whatever the TP size.
* Tied embeddings: the last stage's output-layer copy is a non-main replica of the embedding
  (never written); without tying, ``output_layer.weight`` is written like the embedding.
* ``_extra_state`` of every linear layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
  ``linear_fc2``, an expert's too): one object per tensor of the stack, with the unique key
  ``<key>/shard_<index>_<count>`` along its stacking axis (layer, expert; ``shard_0_1``
  unstacked), holding ``torch.save([None])`` (the local layers' extra state is None).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.config import BridgeConfig
from megatron_bridge.families import ParamMapping
from megatron_bridge.families.base import EXPERT_PREFIX, MEGATRON_LAYER_PREFIX, TE_NORM_NAMES
from megatron_bridge.transforms import tp_range

# Key prefix of a dense model's layer-stacked decoder tensors.
LAYERS_KEY_PREFIX = "decoder.layers."
# Key infix of a layer's experts, stacked along the expert axis (megatron-core's
# SequentialMLP renames its ``local_experts.<i>.`` to this when saving).
EXPERTS_KEY_INFIX = "mlp.experts.experts."

# Weights of the linear layers, each of which saves an ``_extra_state`` object.
LINEAR_WEIGHT_SUFFIXES = (
    "linear_qkv.weight",
    "linear_proj.weight",
    "linear_fc1.weight",
    "linear_fc2.weight",
)


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a checkpoint tensor, as one rank writes it.

    Attributes:
        key: the checkpoint key.
        global_shape: the whole stored tensor (with its stacking axis first, if any).
        offset: where the chunk starts in the whole tensor, per dim.
        shape: the chunk's shape (a leading 1 for the stacking axis, if any).
        mapping: the HF tensors the chunk is made of.
        tp_rank: the TP rank whose slice of ``mapping``'s Megatron tensor this is.
        part: for fused gate/up only: 0 the gate rows, 1 the up rows; None otherwise.
        stacked: 1 when the stored tensor stacks layers or experts along a leading axis
            (``shape[stacked:]`` is the shape of the Megatron tensor's slice), else 0.
    """

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    mapping: ParamMapping
    tp_rank: int
    part: int | None = None
    stacked: int = 0


@dataclass(frozen=True)
class ExtraStateObject:
    """A linear layer's ``_extra_state`` for one layer (or one expert): a sharded object.

    Attributes:
        key: the object key, e.g. ``decoder.layers.mlp.linear_fc1._extra_state``.
        unique_key: the stored name, ``<key>/shard_<index>_<count>``.
    """

    key: str
    unique_key: str


@dataclass(frozen=True)
class Placement:
    """Where one Megatron tensor lies in the checkpoint.

    Attributes:
        key: the checkpoint key of the stored tensor.
        index: its position along the stored tensor's stacking axis (layer or expert), None
            when the stored tensor is this Megatron tensor alone.
        count: the length of the stacking axis (layers or experts); 1 when unstacked.
    """

    key: str
    index: int | None
    count: int = 1


def placement(mapping: ParamMapping, bridge: BridgeConfig) -> Placement:
    """Where ``mapping``'s Megatron tensor is stored (see the module docstring)."""
    if mapping.layer is None:
        return Placement(mapping.megatron_name, None)
    prefix = MEGATRON_LAYER_PREFIX.format(layer=mapping.layer)
    suffix = mapping.megatron_name[len(prefix) :]
    if not bridge.is_moe:
        return Placement(LAYERS_KEY_PREFIX + TE_NORM_NAMES.get(suffix, suffix), mapping.layer,
                         bridge.num_layers)
    if mapping.expert is not None:
        rest = suffix[len(EXPERT_PREFIX.format(expert=mapping.expert)) :]
        return Placement(prefix + EXPERTS_KEY_INFIX + rest, mapping.expert, bridge.num_experts)
    return Placement(prefix + TE_NORM_NAMES.get(suffix, suffix), None)


def tensor_chunks(
    mapping: ParamMapping, bridge: BridgeConfig, tp: int, tp_rank: int
) -> list[TensorChunk]:
    """The chunks TP rank ``tp_rank`` writes for ``mapping`` (none for non-main replicas);
    at ``tp=1`` the whole Megatron tensor (two chunks, gate and up, for a fused gate/up)."""
    shape = mapping.megatron_shape(bridge.dims(tp))
    dim = mapping.tp_dim
    if dim is None and tp_rank != 0:
        return []
    where = placement(mapping, bridge)
    if where.index is None:
        global_shape, base, lead = shape, (), ()
    else:
        global_shape, base, lead = (where.count, *shape), (where.index,), (1,)

    def chunk(offset: list[int], size: list[int], part: int | None = None) -> TensorChunk:
        return TensorChunk(where.key, global_shape, (*base, *offset), (*lead, *size), mapping,
                           tp_rank, part, len(lead))

    if dim is None:
        return [chunk([0] * len(shape), list(shape))]
    if mapping.kind == "gate_up":  # weight [2*ffn, h] or bias [2*ffn]
        lo, hi = tp_range(shape[0] // 2, tp_rank, tp)
        rest = list(shape[1:])
        return [chunk([part * shape[0] // 2 + lo, *[0] * len(rest)], [hi - lo, *rest], part)
                for part in (0, 1)]
    lo, hi = tp_range(shape[dim], tp_rank, tp)
    offset = [0] * len(shape)
    size = list(shape)
    offset[dim], size[dim] = lo, hi - lo
    return [chunk(offset, size)]


def extra_state(mapping: ParamMapping, bridge: BridgeConfig) -> ExtraStateObject | None:
    """The ``_extra_state`` object saved with ``mapping``'s linear layer; None when
    ``mapping`` is not a decoder linear layer's weight."""
    if mapping.layer is None or not mapping.megatron_name.endswith(LINEAR_WEIGHT_SUFFIXES):
        return None
    where = placement(mapping, bridge)
    key = where.key.removesuffix(".weight") + "._extra_state"
    return ExtraStateObject(key, f"{key}/shard_{where.index or 0}_{where.count}")


def stage_layers(bridge: BridgeConfig, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers pipeline stage ``pp_rank`` holds."""
    per_stage = bridge.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def rank_layout(
    bridge: BridgeConfig, tp: int, pp: int, tp_rank: int, pp_rank: int, ep: int = 1,
    ep_rank: int = 0,
) -> list[TensorChunk | ExtraStateObject]:
    """Everything rank ``(tp_rank, pp_rank, ep_rank)`` of a TP x PP x EP GPTModel writes to a
    checkpoint (with data parallelism = EP: expert-parallel rank 0 is the data-parallel rank
    that writes the tensors outside the experts).

    Raises:
        ValueError: TP/PP/EP sizes that do not fit the model.
    """
    bridge.validate_parallelism(tp, pp, ep)
    layers = stage_layers(bridge, pp, pp_rank)
    experts = range(ep_rank * bridge.num_experts // ep, (ep_rank + 1) * bridge.num_experts // ep)
    first, last = pp_rank == 0, pp_rank == pp - 1
    entries: list[TensorChunk | ExtraStateObject] = []
    for mapping in bridge.plan():
        if mapping.layer is None:
            on_rank = first if mapping.megatron_name.startswith("embedding.") else last
        else:
            on_rank = mapping.layer in layers
        if mapping.expert is None:
            on_rank = on_rank and ep_rank == 0
        else:
            on_rank = on_rank and mapping.expert in experts
        if not on_rank:
            continue
        entries.extend(tensor_chunks(mapping, bridge, tp, tp_rank))
        state = extra_state(mapping, bridge)
        if state is not None and tp_rank == 0:
            entries.append(state)
    return entries


def checkpoint_layout(
    bridge: BridgeConfig, tp: int, pp: int
) -> list[TensorChunk | ExtraStateObject]:
    """Everything all ranks of a TP x PP GPTModel write (at any EP), rank by rank (TP fastest,
    as in megatron's rank order)."""
    return [
        entry
        for pp_rank in range(pp)
        for tp_rank in range(tp)
        for entry in rank_layout(bridge, tp, pp, tp_rank, pp_rank)
    ]
