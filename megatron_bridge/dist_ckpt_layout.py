"""What megatron-core's ``dist_checkpointing`` writes for our GPTModel, computed without it.

A Megatron distributed checkpoint (``torch_dist`` format) stores each tensor under a key that
does not depend on TP/PP: the decoder layers' tensors are stacked along a leading layer axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, (nq+2nkv)*d, h]``), and
each rank writes its TP slice of it as one chunk (a global offset and a size). Only the main
replica of a tensor is written: TP-replicated tensors (norms) and the linear layers' (empty)
``_extra_state`` objects come from TP rank 0 only.

:func:`rank_layout` lists the chunks and objects one (TP, PP) rank of a GPTModel built by
:func:`megatron_bridge.load.build_gpt_model` writes, exactly as ``model.sharded_state_dict()``
describes them (keys, global shapes, offsets, sizes; the unit tests compare the two), with the
:class:`~megatron_bridge.families.ParamMapping` whose HF tensors fill each chunk. This lets the
converter write the checkpoint straight from HF files without building the model or importing
megatron-core.

Layout facts encoded here (megatron-core 0.16, local and TransformerEngine specs alike):

* Names: the pre-attention / pre-MLP norms are saved under the TransformerEngine names
  (``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``).
* Fused gate/up ``linear_fc1``: each TP rank writes two chunks, its gate rows at offset
  ``r * ffn/tp`` and its up rows at ``ffn + r * ffn/tp``, so the stored tensor is
  ``cat(gate, up)`` whatever the TP size.
* Tied embeddings: the last stage's output-layer copy is a non-main replica of the embedding
  (never written); without tying, ``output_layer.weight`` is written like the embedding.
* ``_extra_state`` of ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``: one
  object per layer with the unique key ``<key>/shard_<layer>_<num_layers>``, holding
  ``torch.save([None])`` (the local layers' extra state is None).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.config import BridgeConfig
from megatron_bridge.families import ParamMapping
from megatron_bridge.families.base import MEGATRON_LAYER_PREFIX, TE_NORM_NAMES
from megatron_bridge.transforms import tp_range

LAYERS_KEY_PREFIX = "decoder.layers."

# Linear layers of a decoder layer whose ``_extra_state`` is saved as a sharded object.
EXTRA_STATE_MODULES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a checkpoint tensor, as one rank writes it.

    Attributes:
        key: the checkpoint key (layer-stacked name for decoder tensors).
        global_shape: the whole stored tensor (``[num_layers, ...]`` for decoder tensors).
        offset: where the chunk starts in the whole tensor, per dim.
        shape: the chunk's shape (a leading 1 for the layer axis of decoder tensors).
        mapping: the HF tensors the chunk is made of.
        tp_rank: the TP rank whose slice of ``mapping``'s Megatron tensor this is.
        part: for fused gate/up only: 0 the gate rows, 1 the up rows; None otherwise.
    """

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    mapping: ParamMapping
    tp_rank: int
    part: int | None = None


@dataclass(frozen=True)
class ExtraStateObject:
    """A linear layer's ``_extra_state`` for one decoder layer (a sharded object).

    Attributes:
        key: the object key, e.g. ``decoder.layers.mlp.linear_fc1._extra_state``.
        unique_key: the stored name, ``<key>/shard_<layer>_<num_layers>``.
    """

    key: str
    unique_key: str


def refuse_experts(bridge: BridgeConfig) -> None:
    """The layout here is that of dense GPTModels; megatron-core saves experts otherwise.

    Raises:
        ValueError: ``bridge`` is a mixture-of-experts model; says what works instead.
    """
    if bridge.is_moe:
        raise ValueError(
            f"streamed dist-checkpoint conversion does not support mixture-of-experts models "
            f"({bridge.family.architecture}); `megatron-bridge convert` converts them through "
            f"the model, as load_hf_into_megatron + save_megatron_checkpoint (or "
            f"load_megatron_checkpoint + export_hf_weights) do"
        )


def checkpoint_key(mapping: ParamMapping) -> str:
    """The checkpoint key of ``mapping``'s Megatron tensor (layer index dropped)."""
    if mapping.layer is None:
        return mapping.megatron_name
    suffix = mapping.megatron_name[len(MEGATRON_LAYER_PREFIX.format(layer=mapping.layer)) :]
    return LAYERS_KEY_PREFIX + TE_NORM_NAMES.get(suffix, suffix)


def _chunks(
    mapping: ParamMapping, bridge: BridgeConfig, tp: int, tp_rank: int
) -> list[TensorChunk]:
    """The chunks TP rank ``tp_rank`` writes for ``mapping`` (none for non-main replicas)."""
    shape = mapping.megatron_shape(bridge.dims(tp))
    dim = mapping.tp_dim
    if dim is None and tp_rank != 0:
        return []
    if mapping.layer is None:
        global_shape, base, lead = shape, (), ()
    else:
        global_shape, base, lead = (bridge.num_layers, *shape), (mapping.layer,), (1,)
    key = checkpoint_key(mapping)
    if dim is None:
        return [TensorChunk(key, global_shape, (*base, *[0] * len(shape)), (*lead, *shape),
                            mapping, tp_rank)]
    if mapping.kind == "gate_up":  # weight [2*ffn, h] or bias [2*ffn]
        lo, hi = tp_range(shape[0] // 2, tp_rank, tp)
        rest = shape[1:]
        return [
            TensorChunk(key, global_shape, (*base, part * shape[0] // 2 + lo, *[0] * len(rest)),
                        (*lead, hi - lo, *rest), mapping, tp_rank, part)
            for part in (0, 1)
        ]
    lo, hi = tp_range(shape[dim], tp_rank, tp)
    offset = [0] * len(shape)
    size = list(shape)
    offset[dim], size[dim] = lo, hi - lo
    return [TensorChunk(key, global_shape, (*base, *offset), (*lead, *size), mapping, tp_rank)]


def stage_layers(bridge: BridgeConfig, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers pipeline stage ``pp_rank`` holds."""
    per_stage = bridge.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def rank_layout(
    bridge: BridgeConfig, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> list[TensorChunk | ExtraStateObject]:
    """Everything rank ``(tp_rank, pp_rank)`` of a TP x PP GPTModel writes to a checkpoint.

    Raises:
        ValueError: TP/PP sizes that do not fit the model, or a mixture-of-experts model.
    """
    refuse_experts(bridge)
    bridge.validate_parallelism(tp, pp)
    layers = stage_layers(bridge, pp, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    entries: list[TensorChunk | ExtraStateObject] = []
    for mapping in bridge.plan():
        if mapping.layer is None:
            on_stage = first if mapping.megatron_name.startswith("embedding.") else last
        else:
            on_stage = mapping.layer in layers
        if on_stage:
            entries.extend(_chunks(mapping, bridge, tp, tp_rank))
    if tp_rank == 0:
        for layer in layers:
            for module in EXTRA_STATE_MODULES:
                key = f"{LAYERS_KEY_PREFIX}{module}._extra_state"
                entries.append(
                    ExtraStateObject(key, f"{key}/shard_{layer}_{bridge.num_layers}")
                )
    return entries


def checkpoint_layout(
    bridge: BridgeConfig, tp: int, pp: int
) -> list[TensorChunk | ExtraStateObject]:
    """Everything all ranks of a TP x PP GPTModel write, rank by rank (TP fastest, as in
    megatron's rank order)."""
    return [
        entry
        for pp_rank in range(pp)
        for tp_rank in range(tp)
        for entry in rank_layout(bridge, tp, pp, tp_rank, pp_rank)
    ]


def global_region(
    mapping: ParamMapping, bridge: BridgeConfig
) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """Where ``mapping``'s whole Megatron tensor lies in a checkpoint.

    Args:
        bridge: the checkpoint's bridge, whose ``padded_vocab_size`` is the saved one.

    Returns:
        ``(key, offset, shape)``; for decoder tensors the region is one layer of the
        layer-stacked tensor (a leading 1 in ``shape``).
    """
    shape = mapping.megatron_shape(bridge.dims(1))
    if mapping.layer is None:
        return checkpoint_key(mapping), (0,) * len(shape), shape
    return checkpoint_key(mapping), (mapping.layer, *[0] * len(shape)), (1, *shape)
