"""The data plane over Ray's own object store: bulk tensors in shared memory, keys in one actor.

A put stores its columns as one Ray object (raw bytes per field, written once into the object
store of the writer's node) and tells a directory actor which object and row hold each
``(key, field)``. A get asks the directory where the requested fields of the requested keys
are, fetches each object once (zero-copy from the node's shared memory; Ray pulls it from
another node when needed) and copies out only the requested rows. Nothing passes through the
driver, and on one node no byte crosses a socket.

Ray ties an object to the process that put it (its owner): samples are guaranteed to live as
long as their writer, which in a GRPO run are the driver, the rollout actor and the policy
workers, alive for the whole run. Once a writer died, reading its samples may fail (naming the
keys); TransferQueue's storage units instead hold the bytes themselves. An object is freed once no ``(key, field)`` entry refers
to it any more (overwritten, cleared) and its writer no longer holds it.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from nemo_rl.data_plane.interfaces import (
    Column,
    DataPlaneClient,
    DataPlaneError,
    Samples,
    describe_request,
    leaked_samples_error,
    missing_fields_error,
    missing_keys_error,
    not_registered_error,
)
from nemo_rl.distributed.ray_actors import kill_actors

DIRECTORY_NAME = "nemo_rl_data_plane_directory"
DIRECTORY_NAMESPACE = "nemo_rl"
DEFAULT_OP_TIMEOUT_S = 300.0

# (object id, row) of one field of one sample
_Location = tuple[int, int]


@dataclass(frozen=True)
class _PackedColumn:
    """One field of a put as raw bytes: a regular ``[batch, ...]`` tensor, or per-sample
    tensors concatenated along dimension 0 with ``offsets`` ``[batch + 1]`` (rows of dim 0)."""

    data: np.ndarray  # uint8, the C-contiguous bytes of the tensor / concatenation
    dtype: torch.dtype
    shape: tuple[int, ...]  # of the whole tensor / concatenation
    offsets: tuple[int, ...] | None = None  # jagged only

    @classmethod
    def pack(cls, column: Column) -> _PackedColumn:
        if isinstance(column, torch.Tensor):
            return cls(_raw_bytes(column), column.dtype, tuple(column.shape))
        joined = torch.cat(column)
        offsets = tuple(itertools.accumulate((s.shape[0] for s in column), initial=0))
        return cls(_raw_bytes(joined), joined.dtype, tuple(joined.shape), offsets)

    def rows(self, rows: list[int]) -> list[torch.Tensor]:
        """Copies of the samples at ``rows`` (the stored bytes are read-only shared memory)."""
        with warnings.catch_warnings():
            # torch warns on read-only numpy memory; nothing here writes to it.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(self.data)
        full = flat.view(self.dtype).view(self.shape)
        if self.offsets is None:
            return list(full[torch.tensor(rows, dtype=torch.long)].unbind(0))
        return [full[self.offsets[r] : self.offsets[r + 1]].clone() for r in rows]


def _raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of ``tensor`` as a uint8 numpy array (any dtype, bf16 and bool included)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


@ray.remote(num_cpus=0)
class _Directory:
    """Where each ``(partition, key, field)`` lives, and the objects holding them.

    Methods answer ``(status, payload)``; the client turns a non-"ok" status into the shared
    data-plane errors, so every backend words them the same.
    """

    def __init__(self) -> None:
        self._partitions: dict[str, dict[str, dict[str, _Location]]] = {}
        self._objects: dict[int, list[ray.ObjectRef]] = {}  # id -> [ref] (boxed: not resolved)
        self._uses: dict[int, int] = {}
        self._next_id = 0

    def register(self, partition_id: str) -> tuple[str, Any]:
        samples = self._partitions.setdefault(partition_id, {})
        return ("leaked", list(samples)) if samples else ("ok", None)

    def clear_partition(self, partition_id: str) -> None:
        for fields in self._partitions.pop(partition_id, {}).values():
            self._release(fields.values())

    def partitions(self) -> list[str]:
        return list(self._partitions)

    def list_keys(self, partition_id: str) -> tuple[str, Any]:
        if partition_id not in self._partitions:
            return "not_registered", self.partitions()
        return "ok", list(self._partitions[partition_id])

    def add(
        self, partition_id: str, keys: list[str], fields: list[str], boxed: list[ray.ObjectRef]
    ) -> tuple[str, Any]:
        """Record that ``boxed[0]`` holds rows ``0..len(keys)-1`` of ``fields`` for ``keys``."""
        if partition_id not in self._partitions:
            return "not_registered", self.partitions()
        object_id = self._next_id
        self._next_id += 1
        self._objects[object_id] = boxed
        self._uses[object_id] = 0
        samples = self._partitions[partition_id]
        replaced: list[_Location] = []
        for row, key in enumerate(keys):
            entry = samples.setdefault(key, {})
            for name in fields:
                if name in entry:
                    replaced.append(entry[name])
                entry[name] = (object_id, row)
                self._uses[object_id] += 1
        self._release(replaced)
        return "ok", None

    def locate(self, partition_id: str, keys: list[str], fields: list[str]) -> tuple[str, Any]:
        """Per field, the ``(object id, row)`` of every key, and the objects they name."""
        status, samples = self._samples(partition_id, keys)
        if status != "ok":
            return status, samples
        absent = [f for f in fields if any(f not in s for s in samples)]
        if absent:
            lacking = [k for k, s in zip(keys, samples) if any(f not in s for f in absent)]
            return "missing_fields", (absent, lacking)
        where = {f: [s[f] for s in samples] for f in fields}
        needed = {obj for locations in where.values() for obj, _ in locations}
        return "ok", (where, {obj: self._objects[obj] for obj in needed})

    def remove(self, partition_id: str, keys: list[str]) -> tuple[str, Any]:
        status, samples = self._samples(partition_id, keys)
        if status != "ok":
            return status, samples
        for key in keys:
            self._release(self._partitions[partition_id].pop(key).values())
        return "ok", None

    def _samples(self, partition_id: str, keys: list[str]) -> tuple[str, Any]:
        if partition_id not in self._partitions:
            return "not_registered", self.partitions()
        stored = self._partitions[partition_id]
        missing = [k for k in keys if k not in stored]
        if missing:
            return "missing_keys", missing
        return "ok", [stored[k] for k in keys]

    def _release(self, locations: Any) -> None:
        for object_id, _ in locations:
            self._uses[object_id] -= 1
            if self._uses[object_id] == 0:
                del self._uses[object_id], self._objects[object_id]


class RayObjectStoreDataPlane(DataPlaneClient):
    """A :class:`DataPlaneClient` over Ray's object store and one directory actor.

    Build it with :meth:`start` (driver: starts the directory, owns it) or :meth:`attach` (any
    other process of the same Ray cluster). :meth:`close` stops the directory only on the
    owner.
    """

    def __init__(
        self, directory: Any, owner: bool, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S
    ) -> None:
        """Wrap the directory actor handle; use start/attach instead."""
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be positive (seconds), got {op_timeout_s!r}")
        self._directory = directory
        self._owner = owner
        self._timeout_s = op_timeout_s
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S) -> RayObjectStoreDataPlane:
        """Start the directory actor (no logical CPU) in the current Ray cluster.

        Raises:
            DataPlaneError: Ray is not initialised, or a directory already runs.
        """
        if not ray.is_initialized():
            raise DataPlaneError(
                "Ray is not initialised; call nemo_rl.distributed.ray_bootstrap.init_ray() "
                "before starting the Ray object-store data plane"
            )
        if _find_directory() is not None:
            raise DataPlaneError(
                "a Ray object-store data plane already runs in this Ray cluster; attach to it "
                "with RayObjectStoreDataPlane.attach() or close its owner first"
            )
        directory = _Directory.options(name=DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE).remote()
        plane = cls(directory, owner=True, op_timeout_s=op_timeout_s)
        plane._wait("start of the data-plane directory", directory.__ray_ready__.remote())
        return plane

    @classmethod
    def attach(cls, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S) -> RayObjectStoreDataPlane:
        """A client of the directory :meth:`start` created in this cluster.

        Raises:
            DataPlaneError: no directory runs.
        """
        directory = _find_directory()
        if directory is None:
            raise DataPlaneError(
                "no Ray object-store data plane runs in this Ray cluster; start one on the "
                "driver with RayObjectStoreDataPlane.start() before attaching"
            )
        return cls(directory, owner=False, op_timeout_s=op_timeout_s)

    def close(self) -> None:
        """Close the client; on the owner, also stop the directory (stored objects are freed)."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            kill_actors([self._directory])

    # ------------------------------------------------------------------ partitions

    def register_partition(self, partition_id: str) -> None:
        self._ask(f"register_partition({partition_id!r})", partition_id, "register", partition_id)

    def clear_partition(self, partition_id: str) -> None:
        self._wait(
            f"clear_partition({partition_id!r})",
            self._remote("clear_partition", partition_id),
        )

    def partitions(self) -> list[str]:
        return self._wait("partitions()", self._remote("partitions"))

    def list_keys(self, partition_id: str) -> list[str]:
        return self._ask(f"list_keys({partition_id!r})", partition_id, "list_keys", partition_id)

    # ------------------------------------------------------------------ samples

    def _put(self, partition_id: str, keys: list[str], columns: dict[str, Column]) -> None:
        what = describe_request("put", partition_id, keys)
        packed = {name: _PackedColumn.pack(column) for name, column in columns.items()}
        self._require_open(what)
        ref = ray.put(packed)
        self._ask(what, partition_id, "add", partition_id, keys, list(packed), [ref])

    def _get(self, partition_id: str, keys: list[str], fields: list[str]) -> Samples:
        what = describe_request("get", partition_id, keys)
        where, objects = self._ask(what, partition_id, "locate", partition_id, keys, fields)
        object_ids = list(objects)
        fetched = dict(zip(object_ids, self._wait(what, [objects[i][0] for i in object_ids])))
        out: Samples = {}
        for name in fields:
            samples: list[torch.Tensor] = [torch.empty(0)] * len(keys)
            by_object: dict[int, list[int]] = {}  # object id -> positions of its rows in keys
            for position, (object_id, _) in enumerate(where[name]):
                by_object.setdefault(object_id, []).append(position)
            for object_id, positions in by_object.items():
                rows = [where[name][p][1] for p in positions]
                for position, tensor in zip(positions, fetched[object_id][name].rows(rows)):
                    samples[position] = tensor
            out[name] = samples
        return out

    def _clear_samples(self, partition_id: str, keys: list[str]) -> None:
        what = describe_request("clear_samples", partition_id, keys)
        self._ask(what, partition_id, "remove", partition_id, keys)

    # ------------------------------------------------------------------ helpers

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise DataPlaneError(f"{what}: this Ray object-store data-plane client is closed")

    def _remote(self, method: str, *args: Any) -> ray.ObjectRef:
        return getattr(self._directory, method).remote(*args)

    def _wait(self, what: str, refs: Any) -> Any:
        """``ray.get(refs)`` within ``op_timeout_s``; Ray failures as :class:`DataPlaneError`."""
        self._require_open(what)
        try:
            return ray.get(refs, timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DataPlaneError(
                f"{what} got no answer within op_timeout_s={self._timeout_s:g} s; the data-plane "
                "directory actor or the node holding the samples may be down (see the Ray logs)"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
            raise DataPlaneError(
                f"{what} failed: the data-plane directory actor or the objects holding the "
                f"samples are gone ({type(err).__name__}); restart the data plane"
            ) from err

    def _ask(self, what: str, partition_id: str, method: str, *args: Any) -> Any:
        """The payload of a directory call, or the data-plane error its status stands for."""
        self._require_open(what)
        status, payload = self._wait(what, self._remote(method, *args))
        if status == "ok":
            return payload
        if status == "not_registered":
            raise not_registered_error(partition_id, payload)
        if status == "leaked":
            raise leaked_samples_error(partition_id, payload)
        requested = len(args[1])  # (partition_id, keys, ...) for every keyed call
        if status == "missing_keys":
            raise missing_keys_error(partition_id, payload, requested)
        absent, lacking = payload
        raise missing_fields_error(partition_id, absent, lacking, requested)


def _find_directory() -> Any:
    """The directory actor of this Ray cluster, or None."""
    try:
        return ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)
    except ValueError:
        return None
