"""Stack a mixture-of-experts layer's expert tensors into the grouped tensors vLLM loads.

The policy exports each expert's projections as separate HF tensors
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ...: 3 x num_experts tensors per layer).
vLLM's fused-MoE loader (``RoutedExperts.load_weights`` with its fused checkpoint mapping) also
takes a layer's experts stacked, which is how it stores them (``w13_weight`` [E, 2I, H],
``w2_weight`` [E, H, I]):

* ``{prefix}experts.gate_up_proj`` [E, 2I, H]: expert ``e``'s gate rows then its up rows
  (Mixtral's names: ``w1`` and ``w3`` -> ``{prefix}experts.w13``);
* ``{prefix}experts.down_proj`` [E, H, I] (Mixtral: ``w2`` -> ``{prefix}experts.w2``).

So a refit sends 2 tensors per MoE layer, each one record of the stream and one call of the
layer's loader, instead of 3 x E. Nothing is copied to stack them: a :class:`StackedTensor`
lists its parts (views of the exported tensors, in the stacked byte order) and the bucket
packer copies each part straight into its place in the stream.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping

import torch

# One expert's projection: prefix (up to and including "experts."), expert index, projection.
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts\.)(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")

# Projection -> (stacked tensor it joins, its place among that tensor's parts per expert),
# in vLLM's two spellings (FusedMoE's fused checkpoint names for gate/up/down and w1/w3/w2).
STACKS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("w13", 0),
    "w3": ("w13", 1),
    "w2": ("w2", 0),
}


@dataclasses.dataclass(frozen=True)
class StackedTensor:
    """A stacked expert tensor as a list of parts, not yet copied anywhere.

    Attributes:
        shape: ``(num_experts, rows, *rest)``: e.g. [E, 2I, H] for gate/up.
        dtype: every part's dtype.
        parts: the tensors whose concatenated bytes are the stacked tensor's, in order
            (expert 0's parts, expert 1's ...; within an expert, gate before up).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[torch.Tensor, ...]


def _member(name: str) -> tuple[str, int, int] | None:
    """``(stacked name, expert, part index)`` of an expert projection's HF name, else None."""
    match = _EXPERT_TENSOR.match(name)
    if match is None or match["proj"] not in STACKS:
        return None
    stack, part = STACKS[match["proj"]]
    return match["prefix"] + stack, int(match["expert"]), part


def _stack_shape(name: str, shapes: Mapping[tuple[int, int], tuple[int, ...]]) -> tuple[int, ...]:
    """Shape of stacked tensor ``name`` from its members' ``{(expert, part): shape}``.

    Raises:
        ValueError: an expert or a part is missing, or the experts' shapes differ.
    """
    experts = 1 + max(e for e, _ in shapes)
    parts = 1 + max(p for _, p in shapes)
    want = {(e, p) for e in range(experts) for p in range(parts)}
    per_expert = [[shapes.get((e, p)) for p in range(parts)] for e in range(experts)]
    if set(shapes) != want or any(row != per_expert[0] for row in per_expert):
        raise ValueError(
            f"the experts of {name!r} do not stack: expected parts {sorted(want)} of one "
            f"shape per part, got {dict(sorted(shapes.items()))}; every expert of a layer "
            "must be exported, one after another"
        )
    first = per_expert[0]
    if any(tuple(s[1:]) != tuple(first[0][1:]) for s in first):
        raise ValueError(f"the parts of {name!r} differ beyond their rows: {first}")
    return (experts, sum(s[0] for s in first), *first[0][1:])


def group_expert_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``shapes`` (``{hf_name: shape}``) with every layer's expert tensors replaced by its
    stacked ones (:data:`STACKS`), each where its first member was; others unchanged."""
    members: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}
    out: dict[str, tuple[int, ...] | None] = {}
    for name, shape in shapes.items():
        member = _member(name)
        if member is None:
            out[name] = tuple(shape)
            continue
        stack, expert, part = member
        out.setdefault(stack, None)
        members.setdefault(stack, {})[(expert, part)] = tuple(shape)
    for stack, shapes_of in members.items():
        out[stack] = _stack_shape(stack, shapes_of)
    return {name: shape for name, shape in out.items() if shape is not None}


def group_experts(
    stream: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor | StackedTensor]]:
    """The export ``stream`` with each MoE layer's expert tensors as :class:`StackedTensor`s.

    Other tensors pass through unchanged and in order. The expert tensors of one layer must
    come one after another (the bridge exports them so); they are held (by reference) until
    the layer's last one arrived, then its stacks are yielded in the order their first member
    came (gate/up before down).

    Raises:
        ValueError: a layer's experts are incomplete or interleaved with other tensors.
    """
    pending: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    done: set[str] = set()

    def flush() -> Iterator[tuple[str, StackedTensor]]:
        for stack, tensors in pending.items():
            if stack in done:
                raise ValueError(
                    f"the experts of {stack!r} are exported in two runs; a layer's expert "
                    "tensors must come one after another"
                )
            shape = _stack_shape(stack, {k: tuple(t.shape) for k, t in tensors.items()})
            dtypes = {t.dtype for t in tensors.values()}
            if len(dtypes) != 1:
                raise ValueError(f"the experts of {stack!r} mix dtypes {sorted(map(str, dtypes))}")
            done.add(stack)
            yield stack, StackedTensor(shape, dtypes.pop(), tuple(t for _, t in sorted(tensors.items())))
        pending.clear()

    prefix = None
    for name, tensor in stream:
        member = _member(name)
        this_prefix = None if member is None else member[0].rsplit(".", 1)[0]
        if pending and this_prefix != prefix:
            yield from flush()
        if member is None:
            yield name, tensor
            continue
        prefix = this_prefix
        stack, expert, part = member
        pending.setdefault(stack, {})[(expert, part)] = tensor
    yield from flush()
