"""Stream HF-layout tensors out of a (TP/PP-sharded) Megatron GPTModel.

:func:`export_hf_weights` walks the conversion plan one Megatron tensor at a time: the
pipeline stage that owns it all-gathers the TP shards, converts them to HF tensors, and
broadcasts them to the other stages. An expert's tensors are gathered over the expert
tensor-parallel group by the expert-parallel rank that holds the expert, which broadcasts them
to the other EP ranks of its stage first. Every rank yields the same ``(name, tensor)`` stream and
holds at most one full HF tensor group at a time, so memory stays bounded by the largest
tensor (the embedding), not the model.

A linear with a LoRA adapter (:mod:`megatron_bridge.lora`) is exported merged: each rank folds
its adapter slice into its weight shard (``W_r + scale * B_r A_r``) before the gather, so the
stream holds the weights of the adapted model and no adapter tensors.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from megatron_bridge.config import BridgeConfig
from megatron_bridge.families import ParamMapping
from megatron_bridge.load import expert_range, stage_mappings
from megatron_bridge.lora import lora_adapters
from megatron_bridge.parallel_state import collective_device


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 view (gloo lacks some dtypes, and mis-sends non-contiguous data)."""
    return tensor.contiguous().view(torch.uint8)


def gather_tp(tensor: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    """Every TP rank's copy of ``tensor`` (same shape on all ranks), in rank order."""
    if size == 1:
        return [tensor]
    local = _as_bytes(tensor)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return [p.view(tensor.dtype).view(tensor.shape) for p in parts]


def stage_layer_ranges(model: torch.nn.Module) -> list[tuple[int, int]]:
    """``[start, stop)`` of global layer indices held by each pipeline stage, stage order."""
    from megatron.core import parallel_state

    from megatron_bridge.load import layer_offset

    mine = (layer_offset(model), layer_offset(model) + len(model.decoder.layers))
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return [mine]
    ranges: list = [None] * pp
    dist.all_gather_object(ranges, mine, group=parallel_state.get_pipeline_model_parallel_group())
    return ranges


def owner_stage(mapping: ParamMapping, ranges: list[tuple[int, int]]) -> int:
    """The pipeline stage that holds ``mapping``'s tensor."""
    if mapping.layer is not None:
        return next(s for s, (lo, hi) in enumerate(ranges) if lo <= mapping.layer < hi)
    return 0 if mapping.megatron_name.startswith("embedding.") else len(ranges) - 1


@torch.no_grad()
def export_hf_weights(
    model: torch.nn.Module, bridge: BridgeConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every HF tensor of the model, identically on every rank.

    Must be consumed by all ranks of the model-parallel group in lockstep (it runs
    collectives). Vocabulary padding rows are dropped; tied embeddings yield no lm_head.

    Args:
        model: this rank's GPTModel stage.
        bridge: the model's :class:`BridgeConfig`.
        dtype: cast exported tensors to this dtype; None keeps the parameter dtype.

    Yields:
        HF name and a tensor in HF layout (contiguous) on the collective device (the CPU
        under gloo, the rank's GPU under NCCL: the TP gather and PP/EP broadcasts run there,
        and a refit packs it into a GPU ring without a round trip through host memory). Where
        no conversion is needed (TP=1, no dtype cast, every tensor but q/k/v) it is a view of
        the parameter: read it before the model changes, or clone it to keep it.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    ep = parallel_state.get_expert_model_parallel_world_size()
    ep_group = parallel_state.get_expert_model_parallel_group()
    experts = expert_range(bridge)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_ranks = parallel_state.get_pipeline_model_parallel_world_size()
    dims = bridge.dims(tp)
    ranges = stage_layer_ranges(model)
    # Global Megatron name -> this stage's parameter name (the tied output copy is not exported).
    local_names = {
        m.megatron_name: name
        for name, m in stage_mappings(model, bridge).items()
        if not (bridge.tie_word_embeddings and name == "output_layer.weight")
    }
    params = dict(model.named_parameters())
    adapters = lora_adapters(model)

    for mapping in bridge.plan():
        owner = owner_stage(mapping, ranges)
        tensors: list[torch.Tensor] = []
        expert = mapping.expert
        if owner == pp_rank and (expert is None or expert in experts):
            local_name = local_names[mapping.megatron_name]
            local = params[local_name].detach()
            module, _, kind = local_name.rpartition(".")
            if kind == "weight" and module in adapters:
                local = adapters[module].merged(local)
            local = local.to(collective_device())
            if expert is None:
                shards = gather_tp(local, tp_group, tp)
            else:
                shards = gather_tp(local, etp_group, etp)
            tensors = mapping.unshard(shards, dims)
            if dtype is not None:
                tensors = [t.to(dtype) for t in tensors]
        if owner == pp_rank and expert is not None and ep > 1:
            tensors = broadcast_from(tensors, expert // len(experts), ep_group)
        if pp_ranks > 1:
            tensors = broadcast_from(tensors, owner, pp_group)
        yield from zip(mapping.hf_names, tensors)


def broadcast_from(
    tensors: list[torch.Tensor], owner: int, group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Send group rank ``owner``'s tensors to every rank of ``group`` (the pipeline stage
    that holds them, or the expert-parallel rank that holds an expert)."""
    meta = [[(t.shape, t.dtype) for t in tensors]]
    dist.broadcast_object_list(meta, group=group, group_src=owner)
    out = []
    for i, (shape, dtype) in enumerate(meta[0]):
        buf = _as_bytes(tensors[i]) if tensors else torch.empty(
            torch.Size(shape).numel() * dtype.itemsize, dtype=torch.uint8,
            device=collective_device(),
        )
        dist.broadcast(buf, group=group, group_src=owner)
        out.append(buf.view(dtype).view(shape))
    return out
