"""A dict-backed data plane living in the calling process, for unit tests.

Same contract and error messages as the TransferQueue adapter; values are copied in and out, so
callers cannot alias stored tensors.
"""

from __future__ import annotations

import torch

from nemo_rl.data_plane.interfaces import (
    Column,
    DataPlaneClient,
    Samples,
    leaked_samples_error,
    missing_fields_error,
    missing_keys_error,
    not_registered_error,
)


class InProcessDataPlane(DataPlaneClient):
    """Partitions as nested dicts: ``{partition_id: {key: {field: tensor}}}``."""

    def __init__(self) -> None:
        self._store: dict[str, dict[str, dict[str, torch.Tensor]]] = {}

    def register_partition(self, partition_id: str) -> None:
        samples = self._store.setdefault(partition_id, {})
        if samples:
            raise leaked_samples_error(partition_id, list(samples))

    def clear_partition(self, partition_id: str) -> None:
        self._store.pop(partition_id, None)

    def partitions(self) -> list[str]:
        return list(self._store)

    def list_keys(self, partition_id: str) -> list[str]:
        return list(self._partition(partition_id))

    def close(self) -> None:
        self._store.clear()

    def _put(self, partition_id: str, keys: list[str], columns: dict[str, Column]) -> None:
        samples = self._partition(partition_id)
        for name, column in columns.items():
            for key, value in zip(keys, column):
                samples.setdefault(key, {})[name] = value.clone()

    def _get(self, partition_id: str, keys: list[str], fields: list[str]) -> Samples:
        samples = self._partition(partition_id)
        missing = [k for k in keys if k not in samples]
        if missing:
            raise missing_keys_error(partition_id, missing, len(keys))
        absent = [f for f in fields if any(f not in samples[k] for k in keys)]
        if absent:
            lacking = [k for k in keys if any(f not in samples[k] for f in absent)]
            raise missing_fields_error(partition_id, absent, lacking, len(keys))
        return {f: [samples[k][f].clone() for k in keys] for f in fields}

    def _clear_samples(self, partition_id: str, keys: list[str]) -> None:
        samples = self._partition(partition_id)
        missing = [k for k in keys if k not in samples]
        if missing:
            raise missing_keys_error(partition_id, missing, len(keys))
        for key in keys:
            del samples[key]

    def _partition(self, partition_id: str) -> dict[str, dict[str, torch.Tensor]]:
        if partition_id not in self._store:
            raise not_registered_error(partition_id, list(self._store))
        return self._store[partition_id]
