"""LoRA adapter weights between a sharded Megatron model and the Hugging Face PEFT layout.

In PEFT's layout every HF projection has its own pair: ``<module>.lora_A.weight`` ``[r, in]``
and ``<module>.lora_B.weight`` ``[out, r]`` (``<module>`` e.g. ``model.layers.0.self_attn.q_proj``,
the HF weight's name without ``.weight``). A Megatron adapter on a fused linear is one pair for
several projections: q/k/v (or gate/up) share ``A``, and ``B``'s rows are the projections'
rows in Megatron's fused order. So the fused ``B`` converts with the transform of the fused
weight (:class:`~megatron_bridge.families.ParamMapping`'s ``shard``/``unshard``: same rows,
``r`` columns), a row-parallel ``A`` with that of its weight's columns, and the shared ``A``
is written once per projection (and must be equal across them when read back).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from megatron_bridge.config import BridgeConfig
from megatron_bridge.export import broadcast_from, gather_tp, owner_stage, stage_layer_ranges
from megatron_bridge.families import ParamMapping
from megatron_bridge.load import layer_offset
from megatron_bridge.lora import LoRAAdapter, lora_adapters
from megatron_bridge.lora_targets import LoraTarget
from megatron_bridge.parallel_state import collective_device


def _hf_modules(mapping: ParamMapping) -> list[str]:
    """The HF projections a linear's weight is made of, as module names."""
    return [name.removesuffix(".weight") for name in mapping.hf_names]


def _all_targets(model: torch.nn.Module, adapters: dict[str, LoRAAdapter]) -> list[LoraTarget]:
    """Every pipeline stage's adapted linears, in layer order (the same list on every rank)."""
    from megatron.core import parallel_state

    offset = layer_offset(model)
    mine = [LoraTarget.from_module_name(name, offset) for name in adapters]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        stages: list = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
        mine = [t for stage in stages for t in stage]
    return sorted(mine)


@torch.no_grad()
def export_lora_weights(
    model: torch.nn.Module, bridge: BridgeConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(peft_name, tensor)`` for every adapter of the model, identically on every rank
    (collective over TP and PP, like :func:`~megatron_bridge.export.export_hf_weights`).

    Names are ``<hf module>.lora_A.weight`` / ``.lora_B.weight`` (without PEFT's
    ``base_model.model.`` prefix); tensors are contiguous, in ``dtype`` (None: the adapters'
    own dtype). Where no conversion is needed a tensor may be a view of the parameter.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_ranks = parallel_state.get_pipeline_model_parallel_world_size()
    dims = bridge.dims(tp)
    adapters = lora_adapters(model)
    offset, ranges = layer_offset(model), stage_layer_ranges(model)
    plan = {m.megatron_name: m for m in bridge.plan()}
    for target in _all_targets(model, adapters):
        mapping = plan[f"{target.module_name()}.weight"]
        owner = owner_stage(mapping, ranges)
        tensors: list[torch.Tensor] = []
        if owner == pp_rank:
            adapter = adapters[target.module_name(target.layer - offset)]
            a = adapter.lora_A.detach().to(collective_device())
            b = adapter.lora_B.detach().to(collective_device())
            if target.parallel == "column":
                tensors = [a.contiguous(), *mapping.unshard(gather_tp(b, tp_group, tp), dims)]
            else:
                tensors = [*mapping.unshard(gather_tp(a, tp_group, tp), dims), b.contiguous()]
        if pp_ranks > 1:
            tensors = broadcast_from(tensors, owner, parallel_state.get_pipeline_model_parallel_group())
        a, *bs = tensors  # A (shared by the fused projections), then each projection's B
        if dtype is not None:
            a, bs = a.to(dtype), [b.to(dtype) for b in bs]
        for module, b in zip(_hf_modules(mapping), bs, strict=True):
            yield f"{module}.lora_A.weight", a
            yield f"{module}.lora_B.weight", b


class _Tensors:
    """A :class:`~megatron_bridge.transforms.TensorReader` over tensors in memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        tensor = self._tensors[name]
        return tensor if dim is None else tensor.narrow(dim, start, (stop or tensor.shape[dim]) - start)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype


@torch.no_grad()
def load_lora_weights(
    model: torch.nn.Module, bridge: BridgeConfig, tensors: Mapping[str, torch.Tensor]
) -> None:
    """Fill every adapter of this rank from PEFT-layout ``tensors`` (names as
    :func:`export_lora_weights` yields them), taking this TP rank's slice.

    Raises:
        KeyError: an adapter's tensor is missing.
        ValueError: the projections of a fused linear have different ``A`` (one adapter
            cannot hold them), or a tensor's shape does not fit.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dims = bridge.dims(tp)
    offset = layer_offset(model)
    plan = {m.megatron_name: m for m in bridge.plan()}
    for name, adapter in lora_adapters(model).items():
        target = LoraTarget.from_module_name(name, offset)
        mapping = plan[f"{target.module_name()}.weight"]
        modules = _hf_modules(mapping)
        a_all = [tensors[f"{m}.lora_A.weight"] for m in modules]
        if any(not torch.equal(a_all[0], a) for a in a_all[1:]):
            raise ValueError(
                f"{modules} have different lora_A; Megatron's fused {target.linear} has one "
                "adapter for all of them, so they must share A"
            )
        b_all = [tensors[f"{m}.lora_B.weight"] for m in modules]
        if target.parallel == "column":
            a = a_all[0]
            b = mapping.shard(_Tensors(dict(zip(mapping.hf_names, b_all))), dims, tp_rank, tp)
        else:
            a = mapping.shard(_Tensors({mapping.hf_names[0]: a_all[0]}), dims, tp_rank, tp)
            b = b_all[0]
        for param, value, label in ((adapter.lora_A, a, "lora_A"), (adapter.lora_B, b, "lora_B")):
            if param.shape != value.shape:
                raise ValueError(
                    f"{name} {label}: the tensors give shape {tuple(value.shape)} on this rank, "
                    f"the adapter has {tuple(param.shape)} (another rank r?)"
                )
            param.copy_(value)
