"""A slice of a Ray cluster reserved as placement groups: one group of bundles per node.

A bundle is the resources of one worker slot: ``{"CPU": num_cpus_per_bundle}`` plus
``{"GPU": 1}`` when GPUs are used. Each node's group is packed on one Ray node and no two
groups of a cluster share a Ray node (``cluster.num_nodes`` means machines, also when one node
could hold every bundle, as logical CPUs can); a Ray cluster with fewer nodes than groups is
refused. Bundles are numbered in node order (all bundles of node 0, then node 1, ...); worker
groups place rank ``r`` on bundle ``r``. Several worker groups (e.g.
colocated training and generation) can share the bundles: each of their workers then asks for
``1 / max_colocated_worker_groups`` of a bundle. The cluster counts the groups on each bundle
(:meth:`RayVirtualCluster.claim_bundles`), so a group that would not fit fails when it is built
instead of waiting for resources Ray can never give it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl.distributed.cpu_threads import bundle_threads, node_cores
from nemo_rl.utils.errors import InputError, ResumableFault

logger = logging.getLogger(__name__)

# Label every Ray node carries with its node id; a bundle label selector on it keeps a
# placement group off (or on) given nodes.
NODE_ID_LABEL = "ray.io/node-id"
# Seconds a node has to report its CPU cores (RayVirtualCluster.cpu_threads).
NODE_CORES_TIMEOUT_S = 60.0


class NodeTimeout(ResumableFault, TimeoutError):
    """A node did not answer within its bound (its Ray stopped, hung or out of reach); the
    message names it. Exit code 75: a rerun may find it back."""


class TooFewNodesError(InputError, ValueError):
    """The Ray cluster has fewer nodes able to hold a bundle than the cluster has groups."""


@dataclass(frozen=True)
class BundleLocation:
    """Where one worker slot lives.

    Attributes:
        placement_group: the node's placement group.
        bundle_index: index of the bundle inside ``placement_group``.
        node_id: Ray node id (hex) the bundle was placed on.
    """

    placement_group: PlacementGroup
    bundle_index: int
    node_id: str


@ray.remote(num_cpus=0)
def _address_and_free_port() -> tuple[str, int]:
    """This node's advertised address and a TCP port free on it right now."""
    address = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return address, sock.getsockname()[1]


class RayVirtualCluster:
    """Placement groups reserving ``bundle_ct_per_node_list[i]`` bundles on node ``i``, a Ray
    node of its own for each ``i``.

    Placement groups are created (and awaited) in the constructor; on timeout the ones already
    made are removed again and a ``TimeoutError`` says what was requested and what Ray has free.

    Args:
        bundle_ct_per_node_list: bundles (worker slots) per node, e.g. ``[8, 8]`` for two nodes
            of 8 GPUs.
        use_gpus: give each bundle one GPU.
        num_cpus_per_bundle: logical CPUs per bundle (may be fractional).
        max_colocated_worker_groups: how many worker groups may share each bundle; each of their
            workers asks for ``1 / max_colocated_worker_groups`` of the bundle's resources.
        name: prefix of the placement group names (``{name}-node{i}``); empty for unnamed.
        placement_timeout_s: seconds to wait for all placement groups to be placed.
        other_bundles_per_node: bundles of other clusters on each node that compute at the same
            time as this one's (a separate generation cluster): CPU workers split a node's
            cores over all of them (:mod:`nemo_rl.distributed.cpu_threads`).

    Raises:
        ValueError: a malformed argument (the message names it).
        TooFewNodesError: fewer Ray nodes can hold a bundle than ``bundle_ct_per_node_list``
            has entries.
        TimeoutError: the placement groups could not be placed in time.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: Sequence[int],
        use_gpus: bool,
        num_cpus_per_bundle: float,
        max_colocated_worker_groups: int = 1,
        name: str = "",
        placement_timeout_s: float = 180.0,
        other_bundles_per_node: int = 0,
    ) -> None:
        counts = list(bundle_ct_per_node_list)
        if not counts or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts
        ):
            raise ValueError(
                f"bundle_ct_per_node_list must be a non-empty list of positive ints (bundles per "
                f"node), got {bundle_ct_per_node_list!r}"
            )
        if not num_cpus_per_bundle > 0:
            raise ValueError(f"num_cpus_per_bundle must be > 0, got {num_cpus_per_bundle!r}")
        if (
            isinstance(max_colocated_worker_groups, bool)
            or not isinstance(max_colocated_worker_groups, int)
            or max_colocated_worker_groups < 1
        ):
            raise ValueError(
                f"max_colocated_worker_groups must be a positive int, got "
                f"{max_colocated_worker_groups!r}"
            )
        if isinstance(other_bundles_per_node, bool) or not isinstance(
            other_bundles_per_node, int
        ) or other_bundles_per_node < 0:
            raise ValueError(
                f"other_bundles_per_node must be an int >= 0, got {other_bundles_per_node!r}"
            )
        if not placement_timeout_s > 0:
            raise ValueError(f"placement_timeout_s must be > 0, got {placement_timeout_s!r}")
        if not ray.is_initialized():
            raise RuntimeError(
                "Ray is not initialised; call nemo_rl.distributed.ray_bootstrap.init_ray() first"
            )
        self.bundle_ct_per_node_list = counts
        self.use_gpus = use_gpus
        self.num_cpus_per_bundle = float(num_cpus_per_bundle)
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.name = name
        self.other_bundles_per_node = other_bundles_per_node
        self._node_cores: dict[Any, int] = {}  # placement group id -> its node's cores
        self._placement_groups: list[PlacementGroup] = []
        self._locations: list[BundleLocation] | None = None
        # Worker groups currently placed on each bundle (see claim_bundles); worker groups may
        # start from several threads at once (worker_groups.start_together).
        self._groups_per_bundle = [0] * sum(counts)
        self._claims = threading.Lock()
        self._create_placement_groups(placement_timeout_s)

    def _bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus_per_bundle}
        if self.use_gpus:
            bundle["GPU"] = 1.0
        return bundle

    def _create_placement_groups(self, timeout_s: float) -> None:
        # One STRICT_PACK placement group per node, each kept off the Ray nodes of the groups
        # placed before it, so that group i is node i: bundle order follows nodes. The groups
        # are placed one after another (each needs its predecessors' nodes).
        nodes = _nodes_holding(self._bundle())
        groups = len(self.bundle_ct_per_node_list)
        if len(nodes) < groups:
            raise TooFewNodesError(
                f"RayVirtualCluster{f' {self.name!r}' if self.name else ''} needs {groups} "
                f"Ray nodes (bundle_ct_per_node_list={self.bundle_ct_per_node_list}: one node "
                f"each, cluster.num_nodes) but the Ray cluster has {len(nodes)} node(s) able to "
                f"hold a bundle of {self._bundle()}. Set cluster.num_nodes={len(nodes)} (with "
                f"more bundles per node), or start Ray on {groups} nodes (nemo-rl launch slurm)."
            )
        deadline = time.monotonic() + timeout_s
        taken: list[str] = []
        for i, count in enumerate(self.bundle_ct_per_node_list):
            selector = [{NODE_ID_LABEL: f"!in({','.join(taken)})"}] * count if taken else None
            pg = ray.util.placement_group(
                [self._bundle() for _ in range(count)],
                strategy="STRICT_PACK",
                name=f"{self.name}-node{i}" if self.name else "",
                bundle_label_selector=selector,
            )
            self._placement_groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError as err:
                self._placement_timeout(i, len(nodes), timeout_s, err)
            taken.append(ray.util.placement_group_table(pg)["bundles_to_node_id"][0])

    def _placement_timeout(
        self, group: int, nodes: int, timeout_s: float, err: Exception
    ) -> NoReturn:
        """Remove the groups made so far and raise the TimeoutError saying what Ray has free."""
        free = _base_resources(ray.available_resources())
        total = _base_resources(ray.cluster_resources())
        self.shutdown()
        raise TimeoutError(
            f"RayVirtualCluster{f' {self.name!r}' if self.name else ''} could not place "
            f"{len(self.bundle_ct_per_node_list)} placement group(s) with "
            f"{self.bundle_ct_per_node_list} bundles of {self._bundle()} (STRICT_PACK, each on a "
            f"node of its own, total {self._requested_total()}) within {timeout_s:g} s: group "
            f"{group} found no room. Ray has {free} available of {total} on {nodes} node(s). "
            f"Ask for fewer bundles or CPUs per bundle, or add nodes."
        ) from err

    def _requested_total(self) -> dict[str, float]:
        bundles = self.world_size()
        return {key: value * bundles for key, value in self._bundle().items()}

    def world_size(self) -> int:
        """Total number of bundles (worker slots) over all nodes."""
        return sum(self.bundle_ct_per_node_list)

    def get_placement_groups(self) -> list[PlacementGroup]:
        """The placement groups, one per node, in node order."""
        return list(self._placement_groups)

    def get_bundle_locations(self) -> list[BundleLocation]:
        """Every bundle in rank order (node by node, bundle by bundle), with its node id."""
        if not self._placement_groups:
            raise RuntimeError("this RayVirtualCluster was shut down")
        if self._locations is None:
            locations = []
            for pg in self._placement_groups:
                nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
                for index in range(pg.bundle_count):
                    locations.append(BundleLocation(pg, index, nodes[index]))
            self._locations = locations
        return list(self._locations)

    def cpu_threads(self, location: BundleLocation) -> int | None:
        """Threads of a CPU worker on ``location``: its node's cores split over the bundles
        computing there at once (this cluster's and ``other_bundles_per_node``, see
        :mod:`nemo_rl.distributed.cpu_threads`); None on a GPU cluster.

        Raises:
            NodeTimeout: the node did not report its cores within ``NODE_CORES_TIMEOUT_S``."""
        if self.use_gpus:
            return None
        pg = location.placement_group
        if pg.id not in self._node_cores:
            strategy = PlacementGroupSchedulingStrategy(pg, location.bundle_index)
            try:
                self._node_cores[pg.id] = ray.get(
                    node_cores.options(scheduling_strategy=strategy).remote(),
                    timeout=NODE_CORES_TIMEOUT_S,
                )
            except ray.exceptions.GetTimeoutError:
                raise NodeTimeout(
                    f"the node of bundle {location.bundle_index} of {self!r} (Ray node "
                    f"{location.node_id}) did not report its CPU cores within "
                    f"{NODE_CORES_TIMEOUT_S:g} s (fixed: reading the count takes milliseconds once "
                    "the task runs): its Ray is stopped, hung or out of reach"
                ) from None
        return bundle_threads(self._node_cores[pg.id], pg.bundle_count + self.other_bundles_per_node)

    def __getstate__(self) -> dict[str, Any]:
        # Handles travel to actors (the rollout actor holds the engines' worker group): the
        # claims' lock stays behind, each copy gets its own.
        state = dict(self.__dict__)
        del state["_claims"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._claims = threading.Lock()

    def claim_bundles(self, count: int) -> None:
        """Record a worker group on bundles ``0 .. count - 1`` (where its ranks go).

        Raises:
            ValueError: one of those bundles already holds ``max_colocated_worker_groups``
                groups (the new group's workers could never be scheduled), or ``count`` is
                not in ``1 .. world_size()``.
        """
        if not 1 <= count <= self.world_size():
            raise ValueError(
                f"a worker group needs 1 to {self.world_size()} bundles of this cluster, got {count}"
            )
        with self._claims:
            if max(self._groups_per_bundle[:count]) >= self.max_colocated_worker_groups:
                limit = self.max_colocated_worker_groups
                raise ValueError(
                    f"{self!r} has no room for another worker group on bundles 0..{count - 1}: "
                    f"they already hold max_colocated_worker_groups={limit} group(s). Shut one "
                    f"down first, or build the cluster with max_colocated_worker_groups={limit + 1} "
                    "(each worker then asks for that fraction of a bundle)"
                )
            for index in range(count):
                self._groups_per_bundle[index] += 1

    def release_bundles(self, count: int) -> None:
        """Undo one :meth:`claim_bundles` of ``count`` bundles (the group was shut down)."""
        with self._claims:
            for index in range(count):
                self._groups_per_bundle[index] = max(0, self._groups_per_bundle[index] - 1)

    def worker_resources(self) -> dict[str, float]:
        """Ray resources of one worker: its share of a bundle (``num_cpus``, ``num_gpus``)."""
        share = 1.0 / self.max_colocated_worker_groups
        return {
            "num_cpus": self.num_cpus_per_bundle * share,
            "num_gpus": share if self.use_gpus else 0.0,
        }

    def get_master_address_and_port(self, timeout_s: float = 60.0) -> tuple[str, int]:
        """Address of the node of bundle 0 and a TCP port that was free there.

        Found by a zero-resource task scheduled on bundle 0; each call returns a fresh port, so
        two worker groups on one cluster get distinct rendezvous ports. On a local cluster the
        address is 127.0.0.1.
        """
        if not self._placement_groups:
            raise RuntimeError("this RayVirtualCluster was shut down")
        strategy = PlacementGroupSchedulingStrategy(self._placement_groups[0], 0)
        ref = _address_and_free_port.options(scheduling_strategy=strategy).remote()
        return ray.get(ref, timeout=timeout_s)

    def shutdown(self) -> None:
        """Remove this cluster's placement groups (which ends actors still placed in them)."""
        for pg in self._placement_groups:
            ray.util.remove_placement_group(pg)
        self._placement_groups = []
        self._locations = None

    def __repr__(self) -> str:
        return (
            f"RayVirtualCluster(name={self.name!r}, bundles={self.bundle_ct_per_node_list}, "
            f"bundle={self._bundle()}, colocated={self.max_colocated_worker_groups})"
        )


def _nodes_holding(bundle: dict[str, float]) -> list[str]:
    """Ids of the alive Ray nodes whose total resources hold one ``bundle``."""
    return [
        node["NodeID"]
        for node in ray.nodes()
        if node["Alive"]
        and all(node["Resources"].get(key, 0.0) >= value for key, value in bundle.items())
    ]


def _base_resources(resources: dict[str, Any]) -> dict[str, float]:
    """The CPU and GPU entries of a Ray resource dict (no placement-group or node labels)."""
    return {key: resources[key] for key in ("CPU", "GPU") if key in resources}
