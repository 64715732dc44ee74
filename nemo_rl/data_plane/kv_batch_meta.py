"""KVBatchMeta: what the driver holds about a batch whose tensors live in the data plane.

A :class:`KVBatchMeta` names samples stored in one partition of a data plane (see
:mod:`nemo_rl.data_plane.interfaces`) by their keys, and carries the little the driver needs to
plan work on them without the tensors: the field names stored for every sample, each sample's
sequence length (tokens), small per-sample tags (group ids, rewards, flags), batch-level
``extra_info`` and, on DP shards made by :func:`nemo_rl.data_plane.preshard.shard_meta_for_dp`,
the micro-batch plan. All operations are on metadata only and return new objects.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_rl.distributed.shard_planner import MicroBatchPlan


@dataclass(frozen=True)
class KVBatchMeta:
    """Keys and metadata of a batch of samples held in one data-plane partition.

    Row ``i`` of the batch is the sample stored under ``keys[i]``; ``sequence_lengths[i]`` and
    ``tags[i]`` describe it. Lists and 1-D integer tensors are accepted and stored as tuples.

    Attributes:
        partition_id: data-plane partition holding the samples (e.g. ``"train"``).
        keys: per-sample keys, unique, ``[batch]``.
        sequence_lengths: per-sample true sequence length (tokens, >= 0), ``[batch]``.
        fields: names of the fields stored for every sample (unique, in order of writing).
        tags: per-sample small metadata dicts (str keys), ``[batch]``; empty (the default)
            means an empty dict per sample.
            Treat them as read-only; :meth:`stamp_tags` returns a meta with updated copies.
        extra_info: batch-level information (str keys), e.g. a global forward pad length.
            Every derived meta gets its own shallow copy.
        micro_batch_plan: how a DP shard is cut into micro-batches under dynamic batching or
            sequence packing (see :class:`MicroBatchPlan`); None otherwise.
    """

    partition_id: str
    keys: tuple[str, ...]
    sequence_lengths: tuple[int, ...]
    fields: tuple[str, ...] = ()
    tags: tuple[dict[str, Any], ...] = ()
    extra_info: dict[str, Any] = field(default_factory=dict)
    micro_batch_plan: MicroBatchPlan | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.partition_id, str) or not self.partition_id:
            raise ValueError(
                f"KVBatchMeta.partition_id must be a non-empty str, got {self.partition_id!r}"
            )
        keys = tuple(self.keys)
        bad = [k for k in keys if not isinstance(k, str) or not k]
        if bad:
            raise ValueError(f"KVBatchMeta.keys must be non-empty strs; got {bad[:4]!r}")
        _check_unique("keys", keys)
        lengths = _as_int_tuple(self.sequence_lengths)
        if len(lengths) != len(keys):
            raise ValueError(
                f"KVBatchMeta has {len(keys)} keys but {len(lengths)} sequence_lengths; give "
                "one length (tokens) per key"
            )
        negative = [(i, n) for i, n in enumerate(lengths) if n < 0]
        if negative:
            raise ValueError(
                f"KVBatchMeta.sequence_lengths must be >= 0; (row, length) {negative[:4]}"
            )
        fields = tuple(self.fields)
        if not all(isinstance(f, str) and f for f in fields):
            raise ValueError(f"KVBatchMeta.fields must be non-empty strs; got {fields!r}")
        _check_unique("fields", fields)
        tags = tuple(self.tags) or tuple({} for _ in keys)
        if len(tags) != len(keys):
            raise ValueError(
                f"KVBatchMeta has {len(keys)} keys but {len(tags)} tags; give one dict per key"
            )
        tags = tuple(_str_keyed(f"tags[{i}]", t) for i, t in enumerate(tags))
        extra_info = _str_keyed("extra_info", self.extra_info)
        plan = self.micro_batch_plan
        if plan is not None and plan.global_batch_offsets[-1] != len(keys):
            raise ValueError(
                f"KVBatchMeta.micro_batch_plan covers {plan.global_batch_offsets[-1]} rows but "
                f"the meta has {len(keys)} keys"
            )
        for name, value in (
            ("keys", keys),
            ("sequence_lengths", lengths),
            ("fields", fields),
            ("tags", tags),
            ("extra_info", extra_info),
        ):
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ size

    @property
    def size(self) -> int:
        """Number of samples (rows)."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    # ------------------------------------------------------------------ row selection

    def subset(self, indices: Sequence[int]) -> KVBatchMeta:
        """Rows ``indices`` (distinct, in ``[0, size)``), in that order; drops the plan."""
        idx = [int(i) for i in indices]
        outside = [i for i in idx if not 0 <= i < self.size]
        if outside:
            raise ValueError(f"indices {outside[:4]} are outside a batch of {self.size} rows")
        if len(set(idx)) != len(idx):
            raise ValueError("subset indices repeat; a key can appear only once in a batch")
        return self._rows(idx, micro_batch_plan=None)

    def slice(self, start: int, end: int) -> KVBatchMeta:
        """Rows ``[start, end)``; keeps the micro-batch plan when no micro-batch is cut."""
        if not 0 <= start <= end <= self.size:
            raise ValueError(f"slice [{start}, {end}) is outside a batch of {self.size} rows")
        plan = None if self.micro_batch_plan is None else self.micro_batch_plan.sliced(start, end)
        return self._rows(range(start, end), micro_batch_plan=plan)

    @staticmethod
    def concat(metas: Sequence[KVBatchMeta]) -> KVBatchMeta:
        """Rows of ``metas`` one after the other; drops micro-batch plans.

        All metas must name the same partition and the same set of fields (in the order of the
        first); ``extra_info`` dicts are merged and must agree on shared names.
        """
        if not metas:
            raise ValueError("KVBatchMeta.concat needs at least one meta")
        first = metas[0]
        extra_info: dict[str, Any] = {}
        for i, meta in enumerate(metas):
            if meta.partition_id != first.partition_id:
                raise ValueError(
                    f"cannot concat metas of partitions {first.partition_id!r} (meta 0) and "
                    f"{meta.partition_id!r} (meta {i}); keys are only meaningful in their partition"
                )
            if set(meta.fields) != set(first.fields):
                raise ValueError(
                    f"meta {i} has fields {sorted(meta.fields)} but meta 0 has "
                    f"{sorted(first.fields)}; write the missing fields (or select_fields the "
                    "common ones) before concatenating"
                )
            for name, value in meta.extra_info.items():
                if name in extra_info and extra_info[name] != value:
                    raise ValueError(
                        f"extra_info[{name!r}] differs between metas ({extra_info[name]!r} vs "
                        f"{value!r} in meta {i}); reconcile it before concatenating"
                    )
                extra_info[name] = value
        return KVBatchMeta(
            partition_id=first.partition_id,
            keys=tuple(k for m in metas for k in m.keys),
            sequence_lengths=tuple(n for m in metas for n in m.sequence_lengths),
            fields=first.fields,
            tags=tuple(t for m in metas for t in m.tags),
            extra_info=extra_info,
        )

    # ------------------------------------------------------------------ fields and tags

    def with_fields(self, fields: Iterable[str]) -> KVBatchMeta:
        """The meta after ``fields`` were written for every sample (new names appended)."""
        added = [f for f in dict.fromkeys(fields) if f not in self.fields]
        return dataclasses.replace(self, fields=self.fields + tuple(added))

    def select_fields(self, fields: Iterable[str]) -> KVBatchMeta:
        """The meta narrowed to ``fields`` (in that order), e.g. before a worker fetch."""
        wanted = tuple(dict.fromkeys(fields))
        missing = [f for f in wanted if f not in self.fields]
        if missing:
            raise ValueError(
                f"fields {missing} are not stored for this batch of partition "
                f"{self.partition_id!r} (it has {list(self.fields)})"
            )
        return dataclasses.replace(self, fields=wanted)

    def stamp_tags(self, tags: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> KVBatchMeta:
        """The meta with ``tags`` merged into every sample's tags.

        Args:
            tags: one mapping applied to every sample, or one mapping per sample ``[batch]``.
        """
        if isinstance(tags, Mapping):
            per_sample: Sequence[Mapping[str, Any]] = [tags] * self.size
        else:
            per_sample = list(tags)
            if len(per_sample) != self.size:
                raise ValueError(
                    f"stamp_tags got {len(per_sample)} tag dicts for a batch of {self.size}; "
                    "pass one mapping for all samples or one per sample"
                )
        merged = tuple({**old, **new} for old, new in zip(self.tags, per_sample))
        return dataclasses.replace(self, tags=merged)

    # ------------------------------------------------------------------ helpers

    def _rows(self, idx: Sequence[int], micro_batch_plan: MicroBatchPlan | None) -> KVBatchMeta:
        return KVBatchMeta(
            partition_id=self.partition_id,
            keys=tuple(self.keys[i] for i in idx),
            sequence_lengths=tuple(self.sequence_lengths[i] for i in idx),
            fields=self.fields,
            tags=tuple(self.tags[i] for i in idx),
            extra_info=self.extra_info,
            micro_batch_plan=micro_batch_plan,
        )


def _as_int_tuple(values: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """Sequence lengths as a tuple of python ints (from a list or a 1-D integer tensor)."""
    if isinstance(values, torch.Tensor):
        if values.ndim != 1 or values.is_floating_point() or values.dtype == torch.bool:
            raise ValueError(
                f"KVBatchMeta.sequence_lengths must be a 1-D integer tensor [batch], got "
                f"{values.dtype} of shape {tuple(values.shape)}"
            )
        return tuple(values.tolist())
    out = []
    for n in values:
        try:
            if isinstance(n, bool):
                raise TypeError
            out.append(operator.index(n))
        except TypeError:
            raise ValueError(f"KVBatchMeta.sequence_lengths must be ints, got {n!r}") from None
    return tuple(out)


def _check_unique(name: str, values: tuple[str, ...]) -> None:
    repeated = sorted(v for v, count in Counter(values).items() if count > 1)
    if repeated:
        raise ValueError(f"KVBatchMeta.{name} must be unique; repeated: {repeated[:8]}")


def _str_keyed(name: str, mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow dict copy of ``mapping``, checked to have str keys."""
    if not isinstance(mapping, Mapping):
        raise ValueError(f"KVBatchMeta.{name} must be a mapping, got {type(mapping).__name__}")
    bad = [k for k in mapping if not isinstance(k, str)]
    if bad:
        raise ValueError(f"KVBatchMeta.{name} keys must be strs; got {bad[:4]!r}")
    return dict(mapping)
