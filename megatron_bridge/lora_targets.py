"""Which linear layers of a GPT model get LoRA adapters: names, matching, and the checks.

Pure names (no torch, no megatron-core), so a config is checked before any process starts.

A model's adaptable linear layers are the four of every decoder layer, named as megatron-core
names them in a whole (PP=1) model, with global layer indices:
``decoder.layers.{i}.self_attention.linear_qkv`` (q/k/v fused, column parallel),
``...self_attention.linear_proj`` (attention output, row parallel), ``...mlp.linear_fc1``
(gate/up fused, column parallel) and ``...mlp.linear_fc2`` (down projection, row parallel).

An entry of ``target_modules`` / ``exclude_modules`` is one of:

* a Megatron linear name (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``):
  that linear in every layer;
* a Hugging Face projection name (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
  ``gate_proj``, ``up_proj``, ``down_proj``): the Megatron linear holding it. q/k/v share one
  fused linear (one adapter) and gate/up another, so those names come as a whole group;
* a pattern (it holds ``*``, ``?``, ``[`` or a ``.``) matched with :func:`fnmatch.fnmatchcase`
  against the full names above, e.g. ``*.layers.0.*.linear_qkv`` (``*`` crosses dots).

An empty ``target_modules`` means every adaptable linear, minus ``exclude_modules``.

Mixture-of-experts layers: the experts' linears are not adaptable (no grouped adapters yet).
A selection that reaches the MLP of a sparse layer is refused, naming the layer and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

Parallel = Literal["column", "row"]

# Megatron linear -> (its block in the layer, its tensor-parallel split, the HF projections it
# holds in the order Megatron fuses them).
LINEARS: dict[str, tuple[str, Parallel, tuple[str, ...]]] = {
    "linear_qkv": ("self_attention", "column", ("q_proj", "k_proj", "v_proj")),
    "linear_proj": ("self_attention", "row", ("o_proj",)),
    "linear_fc1": ("mlp", "column", ("gate_proj", "up_proj")),
    "linear_fc2": ("mlp", "row", ("down_proj",)),
}
HF_NAMES: dict[str, str] = {hf: linear for linear, (_, _, hfs) in LINEARS.items() for hf in hfs}

# The adapter of linear ``X`` is the module ``X_adapter`` next to it; its parameters:
ADAPTER_SUFFIX = "_adapter"
ADAPTER_PARAMS = ("lora_A", "lora_B")


def is_adapter_param(name: str) -> bool:
    """Whether parameter ``name`` (dotted, any prefix) belongs to a LoRA adapter."""
    module, _, param = name.rpartition(".")
    return param in ADAPTER_PARAMS and module.endswith(ADAPTER_SUFFIX)


@dataclass(frozen=True, order=True)
class LoraTarget:
    """One adapted linear layer.

    Attributes:
        layer: global decoder-layer index.
        linear: Megatron linear name, a key of :data:`LINEARS`.
    """

    layer: int
    linear: str

    @property
    def parallel(self) -> Parallel:
        return LINEARS[self.linear][1]

    def module_name(self, layer: int | None = None) -> str:
        """The linear's module name in a GPTModel: with global layer index, or with ``layer``
        (a pipeline stage's local index)."""
        block = LINEARS[self.linear][0]
        return f"decoder.layers.{self.layer if layer is None else layer}.{block}.{self.linear}"

    @classmethod
    def from_module_name(cls, name: str, layer_offset: int = 0) -> LoraTarget:
        """The target of the linear ``name`` (:meth:`module_name`) in a pipeline stage whose
        first layer is global layer ``layer_offset``."""
        _, _, layer, _, linear = name.split(".")
        return cls(int(layer) + layer_offset, linear)


def _is_pattern(entry: str) -> bool:
    return any(c in entry for c in "*?[.")


def check_selection(target_modules: list[str], exclude_modules: list[str]) -> None:
    """The checks that need no model: known names, whole fused groups, one list at most.

    Raises:
        ValueError: naming the list (``target_modules`` / ``exclude_modules``), the entry and
            the names accepted.
    """
    for field, entries in (("target_modules", target_modules), ("exclude_modules", exclude_modules)):
        try:
            _check_module_names(entries)
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
    if target_modules and exclude_modules:
        raise ValueError(
            "target_modules and exclude_modules are both set; exclude_modules removes linears "
            "from all of them, so it needs an empty target_modules"
        )


def _check_module_names(entries: list[str]) -> None:
    """Refuse names that no model has, and HF projections split from their fused group."""
    for entry in entries:
        if _is_pattern(entry):
            continue
        if entry not in LINEARS and entry not in HF_NAMES:
            raise ValueError(
                f"unknown module {entry!r}; use a Megatron linear name {sorted(LINEARS)}, a "
                f"Hugging Face projection name {sorted(HF_NAMES)}, or a pattern over names like "
                "'decoder.layers.0.self_attention.linear_qkv' (e.g. '*.layers.0.*.linear_qkv')"
            )
    given = set(entries)
    for linear, (_, _, group) in LINEARS.items():
        named = [hf for hf in group if hf in given]
        if named and len(named) < len(group):
            raise ValueError(
                f"{named} without {[hf for hf in group if hf not in given]}: these projections "
                f"are one fused layer ({linear}) with one adapter; list all of {list(group)}, "
                f"or {linear!r}"
            )


def _matches(entry: str, target: LoraTarget) -> bool:
    if _is_pattern(entry):
        return fnmatchcase(target.module_name(), entry)
    return HF_NAMES.get(entry, entry) == target.linear


def select_lora_targets(
    num_layers: int,
    sparse_layers: tuple[bool, ...],
    target_modules: list[str],
    exclude_modules: list[str],
) -> list[LoraTarget]:
    """The linear layers a model of ``num_layers`` decoder layers adapts, in layer order.

    Args:
        num_layers: decoder layers of the model.
        sparse_layers: per layer, whether its MLP is a mixture of experts (empty: all dense).
        target_modules: entries selecting linears (empty: all of them).
        exclude_modules: entries removed from the selection; only with an empty
            ``target_modules``.

    Raises:
        ValueError: what :func:`check_selection` refuses; an entry that matches no linear of this model; a selection reaching
            the experts of a sparse layer; an empty selection.
    """
    check_selection(target_modules, exclude_modules)
    candidates = [LoraTarget(layer, linear) for layer in range(num_layers) for linear in LINEARS]
    for field, entries in (("target_modules", target_modules), ("exclude_modules", exclude_modules)):
        for entry in entries:
            if not any(_matches(entry, t) for t in candidates):
                raise ValueError(
                    f"{field} entry {entry!r} matches no linear layer of this model ({num_layers}"
                    f" layers; names look like {candidates[0].module_name()!r})"
                )
    if target_modules:
        chosen = [t for t in candidates if any(_matches(e, t) for e in target_modules)]
    else:
        chosen = [t for t in candidates if not any(_matches(e, t) for e in exclude_modules)]
    for target in chosen:
        if LINEARS[target.linear][0] == "mlp" and sparse_layers and sparse_layers[target.layer]:
            raise ValueError(
                f"{target.module_name()} is selected, but the MLP of layer {target.layer} is a "
                "mixture of experts and LoRA on experts is not supported; adapt the attention "
                "only (target_modules: [linear_qkv, linear_proj]) or exclude the MLP "
                "(exclude_modules: [linear_fc1, linear_fc2])"
            )
    if not chosen:
        raise ValueError("the selection adapts no linear layer; target at least one")
    return chosen
