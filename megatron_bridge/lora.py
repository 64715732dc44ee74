"""LoRA adapters on megatron-core's tensor-parallel linear layers.

An adapted linear computes ``y = W x + scale * B (A x)`` with ``scale = alpha / dim``, ``A``
``[dim, in]`` and ``B`` ``[out, dim]``; ``B`` starts at zero, so a freshly adapted model is the
base model. The adapter is a module next to the linear it adapts (``linear_qkv_adapter`` beside
``linear_qkv``: the base parameters keep their names, so loading, export and checkpoints of the
base are unchanged); a forward hook on the linear adds the adapter's output to the linear's.

Tensor parallelism. Each rank holds the adapter slice that matches its slice of ``W``, so the
merged weight of a rank is ``W_r + scale * B_r A_r`` with no communication:

* column-parallel linear (``linear_qkv``, ``linear_fc1``; ``W_r`` = rows of ``W``): ``A`` is
  replicated, ``B_r`` holds the same rows as ``W_r``. The rank-``dim`` activation ``A x`` is
  the same on every rank; its gradient is summed over the TP ranks (each rank's ``B_r`` sees
  only its outputs), which :func:`copy_to_tensor_model_parallel_region` does in the backward.
* row-parallel linear (``linear_proj``, ``linear_fc2``; ``W_r`` = columns of ``W``): ``A_r``
  holds the same columns as ``W_r``, ``B`` is replicated. Each rank's ``A_r x_r`` is a partial
  sum, all-reduced (a ``[tokens, dim]`` tensor) before ``B``, as the base reduces its output.

Sequence parallelism (activations outside the TP region split along the sequence): the
column case all-gathers ``A x`` along the sequence (reduce-scatter in the backward) and the
row case reduce-scatters ``A_r x_r``. The replicated parameter then gets a partial gradient
from each rank's tokens; it is marked ``sequence_parallel`` so megatron's gradient
finalisation sums it over the TP group, as it does for the norms. Pipeline and context
parallelism need nothing: an adapter is per layer and per token.

Initialisation is independent of the layout: every rank draws the whole ``A`` from a generator
seeded by the run's seed and the linear's global name, and keeps its slice.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from megatron_bridge.config import dtype_from_name, dtype_name
from megatron_bridge.load import layer_offset
from megatron_bridge.lora_targets import ADAPTER_SUFFIX, LoraTarget, Parallel

InitMethod = Literal["xavier", "uniform"]


@dataclass(frozen=True)
class LoraSettings:
    """How every adapter of a model is shaped and initialised (no defaults: the caller's
    config holds them).

    Attributes:
        dim: rank of ``A``/``B``.
        alpha: ``scale = alpha / dim``.
        dropout: dropout probability on the adapter path (training only).
        dropout_position: "pre" (on the input of ``A``) or "post" (on the output of ``B``).
        a_init: "xavier" (Glorot normal) or "uniform" (Kaiming uniform, ``a = sqrt(5)``, the
            default of ``torch.nn.Linear``).
        dtype: parameter dtype of ``A``/``B``; None: the base linear's.
    """

    dim: int
    alpha: float
    dropout: float
    dropout_position: Literal["pre", "post"]
    a_init: InitMethod
    dtype: torch.dtype | None

    @property
    def scale(self) -> float:
        return self.alpha / self.dim


@dataclass(frozen=True)
class LoraSpec:
    """A model's adapters: their settings and which linears carry them (whole model).

    What a checkpoint records (``lora.json``) so that it is loaded into, and exported from, a
    model with the same adapters.
    """

    settings: LoraSettings
    targets: tuple[LoraTarget, ...]

    def stack_index(self, target: LoraTarget) -> tuple[int, int]:
        """``(index, count)`` of ``target`` among the adapted linears of its kind (e.g. every
        adapted ``linear_qkv``), in layer order: the layer axis of its checkpoint tensors."""
        same = [t for t in self.targets if t.linear == target.linear]
        return same.index(target), len(same)

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {
            "dim": s.dim,
            "alpha": s.alpha,
            "dropout": s.dropout,
            "dropout_position": s.dropout_position,
            "a_init": s.a_init,
            "dtype": None if s.dtype is None else dtype_name(s.dtype),
            "targets": [t.module_name() for t in self.targets],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LoraSpec:
        dtype = data["dtype"]
        settings = LoraSettings(
            dim=data["dim"],
            alpha=data["alpha"],
            dropout=data["dropout"],
            dropout_position=data["dropout_position"],
            a_init=data["a_init"],
            dtype=None if dtype is None else dtype_from_name(dtype),
        )
        targets = tuple(LoraTarget.from_module_name(name) for name in data["targets"])
        return cls(settings, targets)


def _init_a(shape: tuple[int, int], method: InitMethod, generator: torch.Generator) -> torch.Tensor:
    """The whole ``A`` ``[dim, in]`` in float32."""
    a = torch.empty(shape, dtype=torch.float32)
    if method == "xavier":
        return torch.nn.init.xavier_normal_(a, generator=generator)
    return torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)


def _seed(seed: int, global_name: str) -> int:
    """A per-linear seed that depends only on the run's seed and the linear's global name."""
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2**63)


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of one column- or row-parallel linear (this TP rank's slice).

    Parameters: ``lora_A`` ``[dim, in_r]`` and ``lora_B`` ``[out_r, dim]``, where
    ``[out_r, in_r]`` is the shape of this rank's base weight.

    Args:
        base: the megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` adapted.
        parallel: how ``base`` is split over the TP ranks.
        settings: shape and initialisation.
        global_name: the linear's name in a whole model (seeds ``A``).
        seed: the run's seed.
        stack_index: ``(index, count)`` of this linear among the model's adapted linears of
            its kind (:meth:`LoraSpec.stack_index`).
        gated_rows: ``base`` is a gated MLP's ``linear_fc1`` (each rank holds its gate rows,
            then its up rows), which checkpoints split as megatron splits the weight.
    """

    def __init__(
        self,
        base: torch.nn.Module,
        parallel: Parallel,
        settings: LoraSettings,
        global_name: str,
        seed: int,
        stack_index: tuple[int, int],
        gated_rows: bool = False,
    ) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        weight = base.weight
        out_r, in_r = weight.shape
        self.parallel = parallel
        self.settings = settings
        self.tp_group = base.tp_group
        self.sequence_parallel = bool(base.sequence_parallel)
        self.stack_index = stack_index
        self.gated_rows = gated_rows
        self.enabled = True
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        in_full = in_r * tp if parallel == "row" else in_r
        generator = torch.Generator().manual_seed(_seed(seed, global_name))
        a = _init_a((settings.dim, in_full), settings.a_init, generator)
        if parallel == "row":
            a = a[:, rank * in_r : (rank + 1) * in_r]
        dtype = settings.dtype or weight.dtype
        self.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=dtype).contiguous())
        self.lora_B = torch.nn.Parameter(
            torch.zeros(out_r, settings.dim, device=weight.device, dtype=dtype)
        )
        sharded, replicated = (
            (self.lora_B, self.lora_A) if parallel == "column" else (self.lora_A, self.lora_B)
        )
        set_tensor_model_parallel_attributes(sharded, True, 0 if parallel == "column" else 1, 1)
        if self.sequence_parallel:
            replicated.sequence_parallel = True  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        s = self.settings
        return f"{self.parallel}, dim={s.dim}, alpha={s.alpha}, dropout={s.dropout}"

    def _dropout(self, t: torch.Tensor, differs_across_tp: bool) -> torch.Tensor:
        """Dropout; a tensor whose values differ across the TP ranks draws its mask from the
        TP-rank-local RNG state (as megatron's own dropout in TP regions), a replicated one
        from the shared state, so replicas draw the same mask."""
        if not self.training or self.settings.dropout == 0.0:
            return t
        if differs_across_tp and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.dropout(t, self.settings.dropout, True)
        return F.dropout(t, self.settings.dropout, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update ``scale * B A x`` in the layout of the base linear's output.

        Args:
            x: the base linear's input: ``[s, b, in]`` (column; ``[s/tp, b, in]`` with
                sequence parallelism) or ``[s, b, in/tp]`` (row).

        Returns:
            ``[s, b, out/tp]`` (column) or ``[s, b, out]`` (row; ``[s/tp, b, out]`` with
            sequence parallelism), in ``A``'s dtype.
        """
        from megatron.core.tensor_parallel import mappings

        column, sp, group = self.parallel == "column", self.sequence_parallel, self.tp_group
        pre = self.settings.dropout_position == "pre"
        if pre:
            x = self._dropout(x, differs_across_tp=sp or not column)
        h = F.linear(x.to(self.lora_A.dtype), self.lora_A)
        if column:
            h = (
                mappings.gather_from_sequence_parallel_region(h, group=group)
                if sp
                else mappings.copy_to_tensor_model_parallel_region(h, group=group)
            )
        else:
            h = (
                mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
                if sp
                else mappings.reduce_from_tensor_model_parallel_region(h, group=group)
            )
        y = F.linear(h, self.lora_B) * self.settings.scale
        if not pre:
            y = self._dropout(y, differs_across_tp=column or sp)
        return y

    def add_to_output(
        self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook of the base linear: ``(out, bias)`` -> ``(out + update, bias)``."""
        if not self.enabled:
            return output
        out, bias = output
        x = args[0] if args else kwargs["input_"]
        return out + self(x).to(out.dtype), bias

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's base weight with the update folded in: ``W_r + scale * B_r A_r``,
        computed in float32, returned in ``weight``'s dtype (a new tensor)."""
        update = self.lora_B.float() @ self.lora_A.float()
        return (weight.float() + self.settings.scale * update).to(weight.dtype)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """megatron dist-checkpoint entries: the TP-split parameter sharded like the base
        weight (along rows, gate and up halves apart for a gated ``linear_fc1``; along
        columns), the other replicated.

        megatron stacks a layer's tensors along a leading layer axis (``sharded_offsets``
        starts with ``(0, layer, num_layers)``); when only some layers are adapted, that axis
        would have holes, so an adapter's position on it is its ``stack_index`` instead."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if sharded_offsets:
            layer_axis = sharded_offsets[0][0]
            sharded_offsets = ((layer_axis, *self.stack_index), *sharded_offsets[1:])
        axis = {"lora_B": 0} if self.parallel == "column" else {"lora_A": 1}
        entries = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.gated_rows:
            key = f"{prefix}lora_B"
            entries[key] = apply_swiglu_sharded_factory(
                entries[key], sharded_offsets, metadata.get("singleton_local_shards", False)
            )
        return entries


def attach_lora(model: torch.nn.Module, spec: LoraSpec, seed: int) -> dict[str, LoRAAdapter]:
    """Give this pipeline stage's linears among ``spec.targets`` an adapter each.

    Args:
        model: this rank's GPTModel stage (local layer spec), weights loaded.
        spec: the settings and the adapted linears of the whole model (global layer
            indices, from :func:`megatron_bridge.lora_targets.select_lora_targets`).
        seed: the run's seed (with each linear's global name, it seeds ``A``).

    Returns:
        This stage's base linear name -> its adapter.

    Raises:
        TypeError: a target is not megatron-core's ``ColumnParallelLinear`` /
            ``RowParallelLinear`` (e.g. TransformerEngine's, not supported).
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    offset, count = layer_offset(model), len(model.decoder.layers)
    modules = dict(model.named_modules())
    adapters = {}
    for target in spec.targets:
        if not offset <= target.layer < offset + count:
            continue
        name = target.module_name(target.layer - offset)
        base = modules[name]
        expected = ColumnParallelLinear if target.parallel == "column" else RowParallelLinear
        if not isinstance(base, expected) or getattr(base, "gather_output", False):
            raise TypeError(
                f"{name} is a {type(base).__name__}; LoRA adapts megatron-core's local "
                f"{expected.__name__} (build the model with the local layer spec)"
            )
        parent_name, _, linear = name.rpartition(".")
        gated = target.linear == "linear_fc1" and bool(base.config.gated_linear_unit)
        adapter = LoRAAdapter(
            base, target.parallel, spec.settings, target.module_name(), seed,
            spec.stack_index(target), gated,
        )
        modules[parent_name].add_module(linear + ADAPTER_SUFFIX, adapter)
        base.register_forward_hook(adapter.add_to_output, with_kwargs=True)
        adapters[name] = adapter
    return adapters


def lora_adapters(model: torch.nn.Module) -> dict[str, LoRAAdapter]:
    """This stage's base linear name -> its adapter (empty for a model without LoRA)."""
    return {
        name.removesuffix(ADAPTER_SUFFIX): module
        for name, module in model.named_modules()
        if isinstance(module, LoRAAdapter)
    }


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run the body with every adapter of ``model`` switched off: the base model."""
    adapters = list(lora_adapters(model).values())
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True
