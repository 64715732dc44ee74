"""Wait until the Ray node of every slurm node of a job registered with the head.

Run by ``launchers/ray_on_slurm.sh`` as a step on the head node (inside the job's container)::

    python -m nemo_rl.launch.wait_for_nodes --address HOST:PORT --nodes node1,node2 --timeout-s 600 \
        --poll-s 1

Each Ray node of a slurm job carries the resource ``slurm_node:<slurm node name>`` (amount 1),
so nodes are told apart by their slurm names even when they share an address. Drivers can use
it to place work on a given node: ``actor.options(resources={"slurm_node:node2": 0.01})``. The
same name is the node's label ``slurm_node``, which Ray still lists once the node is dead.
Exits 0 when all are registered, ``exit_codes.NODES_MISSING`` naming the missing ones otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

from nemo_rl.launch import exit_codes

SLURM_NODE_RESOURCE_PREFIX = "slurm_node:"
SLURM_NODE_LABEL = "slurm_node"


def slurm_node_resource(node: str) -> str:
    """The Ray resource that marks the Ray node of slurm node ``node``."""
    return f"{SLURM_NODE_RESOURCE_PREFIX}{node}"


def registered_slurm_nodes() -> dict[str, str]:
    """``{slurm node name: Ray node id}`` of the alive Ray nodes of the connected cluster."""
    import ray

    found: dict[str, str] = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        for resource in node["Resources"]:
            if resource.startswith(SLURM_NODE_RESOURCE_PREFIX):
                found[resource.removeprefix(SLURM_NODE_RESOURCE_PREFIX)] = node["NodeID"]
    return found


def wait_for_nodes(expected: list[str], timeout_s: float, poll_s: float = 1.0) -> dict[str, str]:
    """Poll the connected cluster until every node in ``expected`` is alive.

    Returns:
        ``{slurm node name: Ray node id}`` of the expected nodes.

    Raises:
        TimeoutError: some did not register within ``timeout_s`` seconds (the message names
            them and the ones that did).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = registered_slurm_nodes()
        missing = [node for node in expected if node not in found]
        if not missing:
            return {node: found[node] for node in expected}
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"Ray nodes of slurm node(s) {', '.join(missing)} did not register with the head "
                f"within {timeout_s:g} s (registered: {', '.join(sorted(found)) or 'none'}); "
                f"see ray-worker-<node>.log in the job's log folder, or raise --nodes-timeout-s"
            )
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    """Command line: connect to ``--address``, wait for ``--nodes``; returns the exit code."""
    from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray

    parser = argparse.ArgumentParser(prog="python -m nemo_rl.launch.wait_for_nodes")
    parser.add_argument("--address", required=True, help="GCS address HOST:PORT of the head")
    parser.add_argument("--nodes", required=True, help="comma-separated slurm node names")
    parser.add_argument("--timeout-s", type=float, required=True, help="seconds to wait")
    parser.add_argument(
        "--poll-s", type=float, default=1.0, help="seconds between looks at the cluster"
    )
    args = parser.parse_args(argv)
    expected = [node for node in args.nodes.split(",") if node]
    start = time.monotonic()
    try:
        init_ray(address=args.address, connect_timeout_s=min(args.timeout_s, 30.0))
        try:
            remaining = max(args.timeout_s - (time.monotonic() - start), 0.0)
            wait_for_nodes(expected, remaining, args.poll_s)
        finally:
            shutdown_ray()
    except (TimeoutError, ConnectionError) as err:
        print(f"[nemo-rl launch] error: {err}", file=sys.stderr, flush=True)
        return exit_codes.NODES_MISSING
    print(
        f"[nemo-rl launch] all {len(expected)} Ray node(s) registered after "
        f"{time.monotonic() - start:.1f} s: {', '.join(expected)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
