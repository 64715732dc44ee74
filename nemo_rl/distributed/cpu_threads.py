"""CPU threads of a worker on a CPU-only cluster: its bundle's share of the node's cores.

Ray gives an actor ``OMP_NUM_THREADS`` equal to its logical CPUs, and ``cluster.cpus_per_node``
(logical CPUs) may exceed the cores: on a 2-core node two bundles of 4 logical CPUs would each
run 2 threads (torch caps them at the cores). Workers on different bundles that compute at the
same time (generation beside training in async GRPO, the ranks of a TP group) then spin against
each other's threads. Instead each worker of a bundle takes ``cores // bundles on the node``
threads (at least 1), as each bundle of a GPU node owns its GPU; workers sharing one bundle
(colocated training and generation) take the same share, as they take turns. The worker group
passes it as ``OMP_NUM_THREADS``, which torch (and the vLLM rank processes a worker starts)
read at start-up. GPU clusters are left as Ray starts them.
"""

from __future__ import annotations

import os

import ray


def bundle_threads(cores: int, bundles_on_node: int) -> int:
    """Threads of one bundle's worker: the node's ``cores`` split over ``bundles_on_node``."""
    if cores < 1 or bundles_on_node < 1:
        raise ValueError(f"cores ({cores}) and bundles_on_node ({bundles_on_node}) must be >= 1")
    return max(1, cores // bundles_on_node)


@ray.remote(num_cpus=0)
def node_cores() -> int:
    """Cores a process on this node may run on (its CPU affinity)."""
    return len(os.sched_getaffinity(0))
