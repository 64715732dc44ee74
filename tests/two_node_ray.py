"""A Ray cluster of two nodes on this machine, kept apart as far as two machines would be.

Two raylets (``ray.cluster_utils.Cluster``: the head and one worker node), each a Ray node of
its own, whose processes differ in what they can tell about their machine:

* shared memory: each node's processes see ``NEMO_RL_SHM_DIR`` = a fresh folder under
  /dev/shm of that node only (made here, removed at teardown), where colocated refit puts its
  buffers, so a buffer of one node is not where the other node's processes look (the refit
  receivers also refuse a buffer handle whose Ray node id is not their own);
* cores: each node's processes run on their own half of this process's CPU affinity (one core
  each on a 2-core machine), so per-node thread counts see the node's cores, not the machine's;
* a marker, ``NEMO_RL_TEST_NODE`` = ``node0`` / ``node1``, for tests to ask a worker where it is.

The variables reach every worker through the raylet's environment (``add_node(env_vars=)``);
:func:`two_node_ray` checks on start that a task pinned to each node sees its own.

Both nodes advertise 127.0.0.1. A second loopback address for node 1 (127.0.0.2) would tell
the nodes apart by address too, but Ray binds the gRPC servers of a node whose address is not
127.0.0.1 (its raylet, its workers) and its dashboard agent to every interface (measured with
Ray 2.60: "::" and 0.0.0.0), and servers a test starts must listen on loopback only. Importable
as ``two_node_ray``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray

from nemo_rl.distributed.ray_bootstrap import (
    DEFAULT_OBJECT_STORE_BYTES,
    LOOPBACK,
    local_cluster_settings,
    ray_cluster,
)

# Workers cannot import this test helper: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHM_DIR_ENV = "NEMO_RL_SHM_DIR"
NODE_MARKER_ENV = "NEMO_RL_TEST_NODE"


@dataclass(frozen=True)
class TestNode:
    """One of the two nodes.

    Attributes:
        name: ``node0`` or ``node1`` (its processes' ``NEMO_RL_TEST_NODE``).
        node_id: Ray node id (hex).
        shm_dir: its processes' ``NEMO_RL_SHM_DIR``.
        cores: the CPU cores its processes may run on.
    """

    __test__ = False  # not a test class

    name: str
    node_id: str
    shm_dir: Path
    cores: frozenset[int]


def where_am_i() -> dict[str, object]:
    """What this process sees of its node: Ray node id, address, the node variables, cores."""
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "address": ray.util.get_node_ip_address(),
        SHM_DIR_ENV: os.environ.get(SHM_DIR_ENV),
        NODE_MARKER_ENV: os.environ.get(NODE_MARKER_ENV),
        "cores": sorted(os.sched_getaffinity(0)),
    }


def _where_this_actor_is(_actor: object) -> dict[str, object]:
    return where_am_i()


@dataclass(frozen=True)
class TwoNodeCluster:
    """The running cluster: its GCS ``address`` and its two ``nodes`` (head first)."""

    address: str
    nodes: tuple[TestNode, TestNode]

    def ask_node(self, node: TestNode, timeout_s: float = 60.0) -> dict[str, object]:
        """:func:`where_am_i` of a task run on ``node``."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        task = ray.remote(num_cpus=0)(where_am_i).options(scheduling_strategy=strategy)
        return ray.get(task.remote(), timeout=timeout_s)

    def nodes_of(self, actors: list[ray.actor.ActorHandle], timeout_s: float = 60.0) -> list[str]:
        """The node (``node0`` / ``node1``) each actor runs on, as the actor's own process
        tells it (``NEMO_RL_TEST_NODE``), checked against its Ray node id.

        Raises:
            RuntimeError: an actor's marker disagrees with its Ray node.
        """
        calls = [actor.__ray_call__.remote(_where_this_actor_is) for actor in actors]
        name_of = {node.node_id: node.name for node in self.nodes}
        names = []
        for where in ray.get(calls, timeout=timeout_s):
            if where[NODE_MARKER_ENV] != name_of.get(str(where["node_id"])):
                raise RuntimeError(f"an actor's process sees {where}; the nodes are {self.nodes}")
            names.append(str(where[NODE_MARKER_ENV]))
        return names


def _split_cores() -> tuple[frozenset[int], frozenset[int]]:
    """This process's cores in two halves (both all of them on a one-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return frozenset(cores), frozenset(cores)
    half = len(cores) // 2
    return frozenset(cores[:half]), frozenset(cores[half:])


@contextlib.contextmanager
def two_node_ray(cpus_per_node: int = 8, start_timeout_s: float = 60.0) -> Iterator[TwoNodeCluster]:
    """Start the two nodes, connect this process (through ``ray_bootstrap``, so runs inside
    reuse the connection), check that each node's processes see their own node, and stop
    everything on exit.

    Args:
        cpus_per_node: logical CPUs of each node (may exceed its cores).
        start_timeout_s: seconds the nodes may take to register, and each check to answer.

    Raises:
        RuntimeError: a node's processes do not see their node's variables or cores.
    """
    from ray.cluster_utils import Cluster

    shm_dirs = [Path(tempfile.mkdtemp(prefix=f"nemo_rl_node{i}_", dir="/dev/shm")) for i in (0, 1)]
    cores = _split_cores()
    everywhere = os.sched_getaffinity(0)
    try:
        with local_cluster_settings():
            cluster = Cluster(shutdown_at_exit=True)
            try:
                node_ids = []
                for i in (0, 1):
                    # the node's processes inherit the affinity of this thread while it starts them
                    os.sched_setaffinity(0, cores[i])
                    try:
                        node = cluster.add_node(
                            num_cpus=cpus_per_node,
                            num_gpus=0,
                            node_ip_address=LOOPBACK,
                            include_dashboard=False,
                            object_store_memory=DEFAULT_OBJECT_STORE_BYTES,
                            env_vars={SHM_DIR_ENV: str(shm_dirs[i]), NODE_MARKER_ENV: f"node{i}"},
                        )
                    finally:
                        os.sched_setaffinity(0, everywhere)
                    node_ids.append(node.node_id)
                cluster.wait_for_nodes(timeout=start_timeout_s)
                with ray_cluster(address=cluster.address):
                    nodes = [
                        TestNode(f"node{i}", node_ids[i], shm_dirs[i], cores[i]) for i in (0, 1)
                    ]
                    yield _checked(TwoNodeCluster(cluster.address, (nodes[0], nodes[1])),
                                   start_timeout_s)
            finally:
                cluster.shutdown()
    finally:
        for path in shm_dirs:
            shutil.rmtree(path, ignore_errors=True)


def _checked(cluster: TwoNodeCluster, timeout_s: float) -> TwoNodeCluster:
    """``cluster``, once a task on each of its nodes sees that node's settings."""
    for node in cluster.nodes:
        seen = cluster.ask_node(node, timeout_s)
        expected = {
            "node_id": node.node_id,
            "address": LOOPBACK,
            SHM_DIR_ENV: str(node.shm_dir),
            NODE_MARKER_ENV: node.name,
            "cores": sorted(node.cores),
        }
        if seen != expected:
            raise RuntimeError(f"a process on {node.name} sees {seen}, expected {expected}")
    return cluster
