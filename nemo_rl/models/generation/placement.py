"""Placement of tensor-parallel generation engines on a cluster's bundles.

An engine of ``vllm_cfg.tensor_parallel_size`` T spans T consecutive bundles of one node (vLLM's
multiprocessing executor runs its T ranks as processes of one machine, talking over shared
memory on CPU or NVLink on GPU), so every node's bundle count must be a multiple of T. Bundles
are numbered node by node (:class:`~nemo_rl.distributed.virtual_cluster.RayVirtualCluster`), so
replica ``r`` holds bundles ``r*T .. r*T + T - 1`` and the worker group's rank order
``{"dp": R, "tp": T}`` (last axis fastest) puts them there. Pure arithmetic, no Ray: config
validation and the engines' start share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TP_FIELD = "policy.generation.vllm_cfg.tensor_parallel_size"


@dataclass(frozen=True)
class GenerationLayout:
    """Data-parallel replicas x tensor-parallel ranks of the generation engines.

    Attributes:
        replicas: engines (data-parallel replicas); each takes a contiguous share of a batch.
        tensor_parallel_size: bundles (ranks) per engine, all on one node.
    """

    replicas: int
    tensor_parallel_size: int

    @property
    def sharding_axes(self) -> dict[str, int]:
        """Worker-group axes: rank ``r * T + t`` is rank ``t`` of replica ``r``."""
        return {"dp": self.replicas, "tp": self.tensor_parallel_size}

    def engine_bundles(self, replica: int) -> range:
        """Bundle indices of ``replica``'s ranks (its rank 0 first)."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica must be in [0, {self.replicas}), got {replica}")
        start = replica * self.tensor_parallel_size
        return range(start, start + self.tensor_parallel_size)


def plan_generation_layout(
    bundles_per_node: Sequence[int],
    tensor_parallel_size: int,
    source: str = "the cluster",
    field: str = TP_FIELD,
) -> GenerationLayout:
    """Engines of ``tensor_parallel_size`` bundles each over ``bundles_per_node``.

    Args:
        bundles_per_node: bundles (GPUs, or CPU worker slots) of each node, in node order.
        tensor_parallel_size: ranks per engine (``vllm_cfg.tensor_parallel_size``).
        source: where ``bundles_per_node`` comes from, for the error message (e.g.
            "cluster.gpus_per_node = 8").
        field: the config key of ``tensor_parallel_size``, for the error message.

    Raises:
        ValueError: ``tensor_parallel_size`` < 1, or a node whose bundles do not divide into
            engines of that size (the message names the field and the values that fit).
    """
    tp = tensor_parallel_size
    if tp < 1:
        raise ValueError(f"{field} must be >= 1, got {tp}")
    bad = sorted({n for n in bundles_per_node if n % tp})
    if bad:
        fits = [
            d for d in range(1, min(bundles_per_node) + 1)
            if all(n % d == 0 for n in bundles_per_node)
        ]
        raise ValueError(
            f"{field}={tp} does not divide the {bad[0]} bundles of a node ({source}): an "
            f"engine's ranks must share one node. Set it to one of {fits}, or give every node a "
            f"multiple of {tp} bundles"
        )
    return GenerationLayout(replicas=sum(bundles_per_node) // tp, tensor_parallel_size=tp)
