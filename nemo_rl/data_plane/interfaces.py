"""The data-plane client interface: per-sample tensors stored by key, in named partitions.

A data plane holds the bulk tensors of a step (token ids, logprobs, advantages, ...) outside the
driver, so that producers (rollout actors, workers) write them once and consumers fetch exactly
the samples and fields they need. The driver only holds :class:`KVBatchMeta` objects naming the
keys.

Model of the store: partitions (e.g. ``"train"``, ``"val"``) are registered, filled and cleared
explicitly; inside one, a sample is a key with any number of fields, each field a tensor. Fields
of a sample may be written at different times (a worker writes ``prev_logprobs`` under the keys
the rollout minted); a read names the fields it wants and fails loudly when a key or a field is
missing instead of returning less.

Tensors go in as a ``[batch, ...]`` tensor or as ``batch`` per-sample tensors that may differ in
their first dimension only (jagged, e.g. ``[seq_i]`` or ``[seq_i, k]``), and come out as
per-sample CPU tensors. Adapters: :class:`~nemo_rl.data_plane.in_process.InProcessDataPlane`
(dicts, for unit tests) and
:class:`~nemo_rl.data_plane.transfer_queue_client.TransferQueueDataPlane` (TransferQueue actors).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Union

import torch

from nemo_rl.data_plane.kv_batch_meta import KVBatchMeta

# One field of a put: a tensor [batch, ...] or ``batch`` per-sample tensors (jagged in dim 0).
Column = Union[torch.Tensor, list[torch.Tensor]]
# What a get returns: per field, the per-sample CPU tensors in the order of the requested keys.
Samples = dict[str, list[torch.Tensor]]

_PREVIEW = 8


class DataPlaneError(RuntimeError):
    """A data-plane request that cannot be served as asked (the message says why and what to do)."""


class MissingSamplesError(DataPlaneError):
    """Requested keys, or fields of them, are not in the partition.

    Attributes:
        partition_id: the partition asked.
        keys: the requested keys that are missing or lack ``fields``.
        fields: the missing fields; empty when the keys themselves are missing.
    """

    def __init__(
        self, message: str, partition_id: str, keys: Sequence[str], fields: Sequence[str] = ()
    ) -> None:
        super().__init__(message)
        self.partition_id = partition_id
        self.keys = list(keys)
        self.fields = list(fields)


class DataPlaneClient(ABC):
    """Put, get and clear per-sample tensors by key in registered partitions.

    Subclasses implement the partition methods and the ``_put`` / ``_get`` / ``_clear_samples``
    hooks; the public sample methods here validate arguments the same way for every backend.
    A client is also a context manager that closes itself.
    """

    # ------------------------------------------------------------------ partitions

    @abstractmethod
    def register_partition(self, partition_id: str) -> None:
        """Open ``partition_id`` for puts. Idempotent on an empty partition.

        Raises:
            DataPlaneError: the partition still holds samples (a leak from an earlier step).
        """

    @abstractmethod
    def clear_partition(self, partition_id: str) -> None:
        """Drop every sample of ``partition_id`` and unregister it (no-op if unregistered)."""

    @abstractmethod
    def partitions(self) -> list[str]:
        """Ids of the registered partitions."""

    @abstractmethod
    def list_keys(self, partition_id: str) -> list[str]:
        """Keys stored in a registered partition.

        Raises:
            DataPlaneError: the partition is not registered.
        """

    @abstractmethod
    def close(self) -> None:
        """Release this client (and whatever it started). Idempotent."""

    # ------------------------------------------------------------------ samples

    def put(self, partition_id: str, keys: Sequence[str], fields: Mapping[str, Column]) -> None:
        """Write ``fields`` of the samples ``keys`` (new keys are created, fields overwritten).

        Args:
            partition_id: a registered partition.
            keys: distinct sample keys ``[batch]``.
            fields: per field name, a tensor ``[batch, ...]`` or ``batch`` tensors that may
                differ in their first dimension only. Moved to CPU.

        Raises:
            DataPlaneError: unregistered partition.
            ValueError / TypeError: malformed keys or fields (the message names the field).
        """
        key_list = _checked_keys(partition_id, keys)
        columns = _checked_columns(len(key_list), fields)
        if key_list:
            self._put(partition_id, key_list, columns)

    def get(self, partition_id: str, keys: Sequence[str], select_fields: Sequence[str]) -> Samples:
        """Read ``select_fields`` of the samples ``keys``.

        Returns:
            Per field, one CPU tensor per key, in the order of ``keys``.

        Raises:
            MissingSamplesError: some keys are not in the partition, or lack some fields.
            DataPlaneError: unregistered partition.
        """
        key_list = _checked_keys(partition_id, keys)
        names = _checked_field_names(select_fields)
        if not key_list:
            self._require_registered(partition_id)
            return {name: [] for name in names}
        return self._get(partition_id, key_list, names)

    def clear_samples(self, partition_id: str, keys: Sequence[str]) -> None:
        """Drop the samples ``keys`` (all their fields); the partition stays registered.

        Raises:
            MissingSamplesError: some keys are not in the partition (nothing is dropped then).
            DataPlaneError: unregistered partition.
        """
        key_list = _checked_keys(partition_id, keys)
        if key_list:
            self._clear_samples(partition_id, key_list)
        else:
            self._require_registered(partition_id)

    def put_by_meta(self, meta: KVBatchMeta, fields: Mapping[str, Column]) -> KVBatchMeta:
        """:meth:`put` ``fields`` under ``meta``'s keys; returns ``meta`` with those fields."""
        self.put(meta.partition_id, meta.keys, fields)
        return meta.with_fields(fields)

    def get_by_meta(
        self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None
    ) -> Samples:
        """:meth:`get` ``select_fields`` (default: all of ``meta.fields``) of ``meta``'s keys."""
        names = meta.fields if select_fields is None else meta.select_fields(select_fields).fields
        return self.get(meta.partition_id, meta.keys, names)

    def __enter__(self) -> DataPlaneClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    def _put(self, partition_id: str, keys: list[str], columns: dict[str, Column]) -> None:
        """Store validated, CPU ``columns`` for ``keys`` (non-empty)."""

    @abstractmethod
    def _get(self, partition_id: str, keys: list[str], fields: list[str]) -> Samples:
        """Read validated ``fields`` of ``keys`` (non-empty)."""

    @abstractmethod
    def _clear_samples(self, partition_id: str, keys: list[str]) -> None:
        """Drop ``keys`` (non-empty), all or none."""

    def _require_registered(self, partition_id: str) -> None:
        if partition_id not in self.partitions():
            raise not_registered_error(partition_id, self.partitions())


# ---------------------------------------------------------------------- errors shared by adapters


def preview(keys: Sequence[str]) -> str:
    """The first few keys and how many more, for error messages."""
    shown = ", ".join(repr(k) for k in keys[:_PREVIEW])
    more = f", ... (+{len(keys) - _PREVIEW} more)" if len(keys) > _PREVIEW else ""
    return f"[{shown}{more}]"


def describe_request(op: str, partition_id: str, keys: Sequence[str]) -> str:
    """``"get of 4 keys ['k0', ...] in partition 'train'"``: how errors name a request."""
    return f"{op} of {len(keys)} keys {preview(keys)} in partition {partition_id!r}"


def not_registered_error(partition_id: str, registered: Sequence[str]) -> DataPlaneError:
    return DataPlaneError(
        f"data-plane partition {partition_id!r} is not registered (registered: "
        f"{sorted(registered)}); call register_partition({partition_id!r}) first"
    )


def missing_keys_error(
    partition_id: str, missing: Sequence[str], requested: int
) -> MissingSamplesError:
    return MissingSamplesError(
        f"data-plane partition {partition_id!r} has no samples under {len(missing)} of the "
        f"{requested} requested keys: {preview(missing)}; they were never put or were already "
        "cleared (clear_samples / clear_partition)",
        partition_id,
        missing,
    )


def missing_fields_error(
    partition_id: str, fields: Sequence[str], lacking: Sequence[str], requested: int
) -> MissingSamplesError:
    return MissingSamplesError(
        f"data-plane partition {partition_id!r}: fields {list(fields)} are missing for "
        f"{len(lacking)} of the {requested} requested keys: {preview(lacking)}; put those fields "
        "under these keys before reading them",
        partition_id,
        lacking,
        fields,
    )


def leaked_samples_error(partition_id: str, keys: Sequence[str]) -> DataPlaneError:
    return DataPlaneError(
        f"data-plane partition {partition_id!r} still holds {len(keys)} samples {preview(keys)} "
        "from earlier use; clear them (clear_samples / clear_partition) before registering it "
        "again"
    )


# ---------------------------------------------------------------------- argument checks


def _checked_keys(partition_id: str, keys: Sequence[str]) -> list[str]:
    if not isinstance(partition_id, str) or not partition_id:
        raise ValueError(f"partition_id must be a non-empty str, got {partition_id!r}")
    if isinstance(keys, str):
        raise TypeError(f"keys must be a sequence of strs, not the single str {keys!r}")
    key_list = list(keys)
    bad = [k for k in key_list if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"keys must be non-empty strs; got {bad[:4]!r}")
    repeated = sorted(k for k, count in Counter(key_list).items() if count > 1)
    if repeated:
        raise ValueError(f"keys repeat: {preview(repeated)}; keys must be distinct")
    return key_list


def _checked_field_names(select_fields: Sequence[str]) -> list[str]:
    if isinstance(select_fields, str):
        raise TypeError(
            f"select_fields must be a sequence of field names, not the str {select_fields!r}"
        )
    names = list(dict.fromkeys(select_fields))
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"select_fields must name at least one field; got {select_fields!r}")
    return names


def _checked_columns(rows: int, fields: Mapping[str, Column]) -> dict[str, Column]:
    """``fields`` validated for ``rows`` samples, detached and on CPU."""
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError("put needs a non-empty mapping of field name -> tensor(s)")
    out: dict[str, Column] = {}
    for name, value in fields.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"field names must be non-empty strs, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.shape[0] != rows:
                raise ValueError(
                    f"field {name!r} has shape {tuple(value.shape)} but {rows} keys were given; "
                    "a tensor field needs the batch as dimension 0"
                )
            out[name] = value.detach().cpu()
        elif isinstance(value, Sequence) and all(isinstance(v, torch.Tensor) for v in value):
            out[name] = _checked_samples(name, rows, value)
        else:
            raise TypeError(
                f"field {name!r} is a {type(value).__name__}; give a tensor [batch, ...] or a "
                "list of per-sample tensors"
            )
    return out


def _checked_samples(name: str, rows: int, samples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-sample tensors that share dtype, rank and every dimension but the first."""
    if len(samples) != rows:
        raise ValueError(f"field {name!r} has {len(samples)} samples but {rows} keys were given")
    if not samples:
        return []
    first = samples[0]
    for i, sample in enumerate(samples):
        if sample.dtype != first.dtype:
            raise ValueError(
                f"field {name!r}: sample {i} is {sample.dtype} but sample 0 is {first.dtype}; "
                "all samples of a field share one dtype"
            )
        same_shape = sample.shape == first.shape
        jagged_ok = sample.ndim == first.ndim >= 1 and sample.shape[1:] == first.shape[1:]
        if not (same_shape or jagged_ok):
            raise ValueError(
                f"field {name!r}: sample {i} has shape {tuple(sample.shape)} but sample 0 has "
                f"{tuple(first.shape)}; samples of a field may differ in their first dimension "
                "only"
            )
    return [sample.detach().cpu() for sample in samples]
