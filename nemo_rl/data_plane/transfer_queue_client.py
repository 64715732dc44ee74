"""The data plane over TransferQueue (``transferqueue`` package): the only module importing it.

TransferQueue runs a controller actor (keys, per-field production status) and storage-unit
actors (the tensors, in memory, reached over ZMQ) in the Ray cluster. The driver starts them
with :meth:`TransferQueueDataPlane.start` and owns them; every other process (rollout actors,
policy workers) attaches its own client with :meth:`TransferQueueDataPlane.attach`. The actors
listen on the Ray node address, 127.0.0.1 for a local cluster from
:func:`nemo_rl.distributed.ray_bootstrap.init_ray`.

Each request runs as one coroutine on the client's event loop, bounded by ``op_timeout_s``, so a
dead controller or storage unit surfaces as a :class:`DataPlaneError` naming the request instead
of a hang.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Coroutine
from typing import Any, Optional

import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict

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

# Name and namespace under which transfer_queue.init registers its controller actor.
_CONTROLLER_NAME = "TransferQueueController"
_CONTROLLER_NAMESPACE = "transfer_queue"
# Name under which transfer_queue.init registers storage unit `rank` (in the caller's namespace).
_STORAGE_UNIT_NAME = "TransferQueueStorageUnit#{rank}"
DEFAULT_OP_TIMEOUT_S = 300.0


class TransferQueueDataPlane(DataPlaneClient):
    """A :class:`DataPlaneClient` backed by TransferQueue's controller and storage actors.

    Build it with :meth:`start` (driver: starts the actors, owns them) or :meth:`attach` (any
    other process of the same Ray cluster). :meth:`close` stops the actors only on the owner.
    """

    def __init__(
        self, client: Any, conf: Any, owner: bool, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S
    ) -> None:
        """Wrap a connected ``transfer_queue.TransferQueueClient``; use start/attach instead."""
        if op_timeout_s <= 0:
            raise ValueError(f"op_timeout_s must be positive (seconds), got {op_timeout_s!r}")
        self._client = client
        self._conf = conf
        self._owner = owner
        self._timeout_s = op_timeout_s
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(
        cls,
        num_data_storage_units: int = 2,
        total_storage_size: Optional[int] = None,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
    ) -> TransferQueueDataPlane:
        """Start the TransferQueue controller and storage units in the current Ray cluster.

        Args:
            num_data_storage_units: storage-unit actors (1 logical CPU each; the controller
                takes 1 more), spread round-robin over the nodes.
            total_storage_size: most samples held over all units; None for no limit.
            op_timeout_s: bound of every request of this client (seconds).

        Raises:
            DataPlaneError: Ray is not initialised, a controller already runs, or too few free
                logical CPUs (TransferQueue would wait for them forever).
        """
        if not ray.is_initialized():
            raise DataPlaneError(
                "Ray is not initialised; call nemo_rl.distributed.ray_bootstrap.init_ray() "
                "before starting the TransferQueue data plane"
            )
        if _find_controller() is not None:
            raise DataPlaneError(
                "a TransferQueue controller already runs in this Ray cluster; attach to it with "
                "TransferQueueDataPlane.attach() or close its owner first"
            )
        if num_data_storage_units < 1:
            raise ValueError(
                f"num_data_storage_units must be >= 1, got {num_data_storage_units!r}"
            )
        needed = num_data_storage_units + 1
        free = ray.available_resources().get("CPU", 0.0)
        if free < needed:
            raise DataPlaneError(
                f"TransferQueue needs {needed} free logical Ray CPUs (1 controller + "
                f"{num_data_storage_units} storage units, 1 CPU each) but {free:g} are free; "
                "start Ray with more logical CPUs (init_ray(num_cpus=...)) or lower "
                "num_data_storage_units"
            )
        conf = tq.init(
            {
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {
                        "num_data_storage_units": num_data_storage_units,
                        "total_storage_size": total_storage_size,
                    },
                }
            }
        )
        return cls(tq.get_client(), conf, owner=True, op_timeout_s=op_timeout_s)

    @classmethod
    def attach(cls, op_timeout_s: float = DEFAULT_OP_TIMEOUT_S) -> TransferQueueDataPlane:
        """Connect a new client to the TransferQueue started by :meth:`start` in this cluster.

        Raises:
            DataPlaneError: no controller runs, or it has not finished starting.
        """
        controller = _find_controller()
        if controller is None:
            raise DataPlaneError(
                "no TransferQueue controller runs in this Ray cluster; start one on the driver "
                "with TransferQueueDataPlane.start() before attaching"
            )
        conf = ray.get(controller.get_config.remote(), timeout=op_timeout_s)
        if conf is None:
            raise DataPlaneError(
                "the TransferQueue controller has not finished starting; attach after "
                "TransferQueueDataPlane.start() returned on the driver"
            )
        client = tq.TransferQueueClient(
            client_id=f"nemo_rl-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            controller_info=conf.controller.zmq_info,
        )
        backend = conf.backend.storage_backend
        client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
        return cls(client, conf, owner=False, op_timeout_s=op_timeout_s)

    def close(self) -> None:
        """Close the client; on the owner, also stop the controller and storage units and
        return once their processes have exited (their CPUs are free again)."""
        if self._closed:
            return
        self._closed = True
        if self._owner:
            actors = self._started_actors()
            tq.close()
            kill_actors(actors)
        else:
            self._client.close()

    def _started_actors(self) -> list[Any]:
        """The controller and storage-unit actors :meth:`start` created (those still named)."""
        units = range(self._conf.backend.SimpleStorage.num_data_storage_units)
        actors = [_find_controller()]
        actors += [_find_actor(_STORAGE_UNIT_NAME.format(rank=rank)) for rank in units]
        return [actor for actor in actors if actor is not None]

    @property
    def server_ips(self) -> set[str]:
        """Addresses the controller and the storage units listen on."""
        ips = {self._conf.controller.zmq_info.ip}
        storage = self._conf.backend.get(self._conf.backend.storage_backend, {})
        ips.update(info.ip for info in (storage.get("zmq_info") or {}).values())
        return ips

    # ------------------------------------------------------------------ partitions

    def register_partition(self, partition_id: str) -> None:
        async def op() -> None:
            if partition_id in await self._client.async_get_partition_list():
                stored = await self._stored_keys(partition_id)
                if stored:
                    raise leaked_samples_error(partition_id, stored)
                return
            # An insert of zero samples creates the partition in the controller.
            await self._client.async_get_meta(
                data_fields=[], batch_size=0, partition_id=partition_id, mode="insert"
            )

        self._run(f"register_partition({partition_id!r})", op())

    def clear_partition(self, partition_id: str) -> None:
        async def op() -> None:
            if partition_id not in await self._client.async_get_partition_list():
                return
            if await self._stored_keys(partition_id):
                await self._client.async_clear_partition(partition_id)
            else:
                # transferqueue 0.1.11's clear_partition skips partitions without samples.
                await self._client._clear_partition_in_controller(partition_id)

        self._run(f"clear_partition({partition_id!r})", op())

    def partitions(self) -> list[str]:
        return list(self._run("partitions()", self._client.async_get_partition_list()))

    def list_keys(self, partition_id: str) -> list[str]:
        async def op() -> list[str]:
            await self._check_registered(partition_id)
            return await self._stored_keys(partition_id)

        return self._run(f"list_keys({partition_id!r})", op())

    # ------------------------------------------------------------------ samples

    def _put(self, partition_id: str, keys: list[str], columns: dict[str, Column]) -> None:
        data = TensorDict(
            {name: _batched(column) for name, column in columns.items()}, batch_size=[len(keys)]
        )

        async def op() -> None:
            await self._check_registered(partition_id)
            meta = await self._client.async_kv_retrieve_meta(
                keys=keys, partition_id=partition_id, create=True
            )
            await self._client.async_put(data, meta)

        self._run(describe_request("put", partition_id, keys), op())

    def _get(self, partition_id: str, keys: list[str], fields: list[str]) -> Samples:
        async def op() -> TensorDict:
            meta = await self._client.async_kv_retrieve_meta(
                keys=keys, partition_id=partition_id, create=False
            )
            if meta.size != len(keys):
                raise await self._missing_keys(partition_id, keys)
            absent = [f for f in fields if f not in meta.field_names]
            if absent:
                lacking = await self._keys_lacking(partition_id, keys, meta.global_indexes, absent)
                raise missing_fields_error(partition_id, absent, lacking, len(keys))
            return await self._client.async_get_data(meta.select_fields(fields))

        data = self._run(describe_request("get", partition_id, keys), op())
        return {name: list(data[name].unbind(0)) for name in fields}

    def _clear_samples(self, partition_id: str, keys: list[str]) -> None:
        async def op() -> None:
            meta = await self._client.async_kv_retrieve_meta(
                keys=keys, partition_id=partition_id, create=False
            )
            if meta.size != len(keys):
                raise await self._missing_keys(partition_id, keys)
            await self._client.async_clear_samples(meta)

        self._run(describe_request("clear_samples", partition_id, keys), op())

    # ------------------------------------------------------------------ helpers

    def _run(self, what: str, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the client's loop within ``op_timeout_s``."""
        if self._closed:
            coro.close()
            raise DataPlaneError(f"{what}: this TransferQueue data-plane client is closed")
        try:
            return self._client._run_coroutine(asyncio.wait_for(coro, self._timeout_s))
        except TimeoutError:
            raise DataPlaneError(
                f"{what} got no answer within op_timeout_s={self._timeout_s:g} s; a TransferQueue "
                "controller or storage unit may have died (see the Ray logs)"
            ) from None

    async def _stored_keys(self, partition_id: str) -> list[str]:
        listing = await self._client.async_kv_list(partition_id)
        return list(listing.get(partition_id, {}))

    async def _check_registered(self, partition_id: str) -> None:
        registered = await self._client.async_get_partition_list()
        if partition_id not in registered:
            raise not_registered_error(partition_id, registered)

    async def _missing_keys(self, partition_id: str, keys: list[str]) -> DataPlaneError:
        """The error for a request some of whose ``keys`` the controller does not know."""
        await self._check_registered(partition_id)
        stored = set(await self._stored_keys(partition_id))
        return missing_keys_error(partition_id, [k for k in keys if k not in stored], len(keys))

    async def _keys_lacking(
        self, partition_id: str, keys: list[str], global_indexes: list[int], fields: list[str]
    ) -> list[str]:
        """Those of ``keys`` (at ``global_indexes``) lacking at least one of ``fields``."""
        lacking: set[int] = set()
        for name in fields:
            indexes, status = await self._client.async_get_production_status(
                data_fields=[name], partition_id=partition_id
            )
            ready = (
                set()
                if indexes is None
                else {int(i) for i, s in zip(indexes.tolist(), status[:, 0].tolist()) if s}
            )
            lacking.update(g for g in global_indexes if g not in ready)
        return [k for k, g in zip(keys, global_indexes) if g in lacking]


def _find_controller() -> Any:
    """The TransferQueue controller actor of this Ray cluster, or None."""
    return _find_actor(_CONTROLLER_NAME, namespace=_CONTROLLER_NAMESPACE)


def _find_actor(name: str, namespace: Optional[str] = None) -> Any:
    """The live actor named ``name`` (in ``namespace``, default: this job's), or None."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _batched(column: Column) -> torch.Tensor:
    """A column as one tensor [batch, ...]: stacked when samples agree, else jagged nested."""
    if isinstance(column, torch.Tensor):
        return column
    if all(sample.shape == column[0].shape for sample in column):
        return torch.stack(column)
    return torch.nested.as_nested_tensor(column, layout=torch.jagged)
