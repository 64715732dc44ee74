"""The ``data_plane`` config section and the two ways of getting a client from it.

``data_plane.enabled`` runs GRPO over :mod:`nemo_rl.algorithms.grpo_step.data_plane`, in which
the driver holds only :class:`~nemo_rl.data_plane.KVBatchMeta` objects and bulk per-sample
tensors go rollout actor -> store -> policy workers. :func:`start_data_plane` (driver: starts and
owns the store) and :func:`attach_data_plane` (rollout actor, policy workers) build the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

from pydantic import Field

from nemo_rl.data_plane.in_process import InProcessDataPlane
from nemo_rl.data_plane.interfaces import DataPlaneClient, DataPlaneError
from nemo_rl.utils.config import ConfigModel


class DataPlaneConfig(ConfigModel):
    """Where a step's bulk tensors live (``data_plane``)."""

    enabled: bool = Field(
        default=False,
        description="Run GRPO through the data plane: the driver carries keys, lengths and "
        "small scalars only; rollouts write samples to the store and policy workers read "
        "their shards from it. False: the in-memory loop (batches pass through the driver).",
    )
    backend: Literal["ray_object_store", "transfer_queue", "in_process"] = Field(
        default="ray_object_store",
        description='"ray_object_store": tensors in Ray\'s shared-memory object store of the '
        "node that wrote them (alive as long as their writer), one directory actor for the "
        "keys; zero-copy reads on the same node, Ray's transfer between nodes; the faster "
        'store in docs/performance.md "Data plane". "transfer_queue": TransferQueue '
        "controller and storage-unit Ray actors (the units hold the tensors, moved over ZMQ; "
        "1 logical CPU each). Both are reachable from every process of the cluster. "
        '"in_process": dicts in the driver process (unit tests of driver-side code; no other '
        "process can attach).",
    )
    num_data_storage_units: int = Field(
        default=2,
        ge=1,
        description="TransferQueue storage-unit actors (1 logical Ray CPU each, plus 1 for the "
        "controller).",
    )
    total_storage_size: Optional[int] = Field(
        default=None,
        ge=1,
        description="Most samples TransferQueue holds over all storage units. None: no limit.",
    )
    op_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Seconds one data-plane request (put, get, clear) may take before it fails "
        "naming the request, partition and keys (a dead storage actor ends up here).",
    )


DataPlaneConfigLike = Union[DataPlaneConfig, Mapping[str, Any]]


def as_data_plane_config(cfg: DataPlaneConfigLike) -> DataPlaneConfig:
    """``cfg`` validated (a :class:`DataPlaneConfig` or its ``model_dump()``)."""
    return cfg if isinstance(cfg, DataPlaneConfig) else DataPlaneConfig.model_validate(dict(cfg))


def start_data_plane(cfg: DataPlaneConfigLike) -> DataPlaneClient:
    """On the driver: start the store of ``cfg.backend`` and return its owning client.

    Raises:
        DataPlaneError: the store cannot start (Ray down, one already runs; TransferQueue:
            too few free logical CPUs).
    """
    cfg = as_data_plane_config(cfg)
    if cfg.backend == "in_process":
        return InProcessDataPlane()
    if cfg.backend == "ray_object_store":
        from nemo_rl.data_plane.ray_object_store import RayObjectStoreDataPlane

        return RayObjectStoreDataPlane.start(op_timeout_s=cfg.op_timeout_s)
    from nemo_rl.data_plane.transfer_queue_client import TransferQueueDataPlane

    return TransferQueueDataPlane.start(
        num_data_storage_units=cfg.num_data_storage_units,
        total_storage_size=cfg.total_storage_size,
        op_timeout_s=cfg.op_timeout_s,
    )


def attach_data_plane(cfg: DataPlaneConfigLike) -> DataPlaneClient:
    """In any process but the driver: a client of the store the driver started.

    Raises:
        DataPlaneError: ``backend`` is "in_process" (its dicts live in the driver only) or the
            driver's store does not run.
    """
    cfg = as_data_plane_config(cfg)
    if cfg.backend == "in_process":
        raise DataPlaneError(
            "data_plane.backend='in_process' keeps samples in the driver process, which policy "
            "workers and rollout actors cannot reach; set data_plane.backend='transfer_queue' "
            "or 'ray_object_store'"
        )
    if cfg.backend == "ray_object_store":
        from nemo_rl.data_plane.ray_object_store import RayObjectStoreDataPlane

        return RayObjectStoreDataPlane.attach(op_timeout_s=cfg.op_timeout_s)
    from nemo_rl.data_plane.transfer_queue_client import TransferQueueDataPlane

    return TransferQueueDataPlane.attach(op_timeout_s=cfg.op_timeout_s)
