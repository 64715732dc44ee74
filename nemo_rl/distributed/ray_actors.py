"""Ending Ray actors for good: kill, then wait until each one's process has exited.

``ray.kill`` only sends the request, and Ray reports the actor dead (calls to it fail with
``ActorDiedError``) as soon as the kill is recorded, while the actor's process is still running:
it exits tens to hundreds of milliseconds later. Until then an idle actor can still run a call
submitted right after the kill (measured here: 4 of 30 calls answered), anything it serves
outside Ray calls keeps serving (a TransferQueue storage unit answered reads over its ZMQ
socket after ``ActorDiedError``, 2 of 7 times), and its resources are not yet free for the
next actor placed on the same bundle. Callers that stop actors use :func:`kill_actors` so
"stopped" means the process is gone.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

import psutil
import ray
from ray._private import state as ray_state
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

logger = logging.getLogger(__name__)


def kill_actors(actors: Sequence[ActorHandle], timeout_s: float = 30.0) -> list[ActorHandle]:
    """Kill ``actors`` (no restart) and wait up to ``timeout_s`` seconds for their processes
    to exit.

    A stopped (SIGSTOP) process on this node is sent SIGKILL at once (Ray would wait 5 s for
    it to answer the kill first). Then each actor is pinged (``__ray_ready__``) until Ray
    reports it dead (``ActorDiedError``); then the process Ray's actor table recorded for it
    (found on its own node: locally by this process, on another node by a zero-CPU task pinned
    there) is waited for until it has exited.

    Returns:
        The actors whose death was not seen within ``timeout_s`` (empty when all are gone);
        they are also logged as a warning.
    """
    for actor in actors:
        ray.kill(actor, no_restart=True)
    _kill_stopped_here(actors)
    deadline = time.monotonic() + timeout_s
    alive = _wait_reported_dead(list(actors), deadline)
    dead = [actor for actor in actors if actor not in alive]
    alive += _wait_processes_exited(dead, deadline)
    if alive:
        logger.warning("%d killed actor(s) still alive after %g s", len(alive), timeout_s)
    return alive


def _kill_stopped_here(actors: Sequence[ActorHandle]) -> None:
    """SIGKILL the processes of ``actors`` on this node that are stopped (SIGSTOP: a hung rank
    or engine). Ray's kill asks an actor's process to exit and kills it only once the request
    has gone unanswered for 5 s (measured), which a stopped process never answers."""
    here = _local_node_id()
    for actor in actors:
        entry = ray_state.actors(actor._actor_id.hex())
        if not entry or not entry["Pid"] or entry["Address"]["NodeID"] != here:
            continue
        try:
            process = psutil.Process(entry["Pid"])
            # the actor's own worker process (its title is "ray::<class>..."), not a process
            # that took over the pid of an actor that exited
            if process.status() == psutil.STATUS_STOPPED and " ".join(
                process.cmdline()
            ).startswith("ray::"):
                process.kill()
        except psutil.NoSuchProcess:
            pass


def _wait_reported_dead(actors: list[ActorHandle], deadline: float) -> list[ActorHandle]:
    """Ping ``actors`` until each ping fails with ``ActorDiedError``; the rest at ``deadline``."""
    alive = actors
    while alive and time.monotonic() < deadline:
        pings = [actor.__ray_ready__.remote() for actor in alive]
        ray.wait(pings, num_returns=len(pings), timeout=1.0, fetch_local=False)
        alive = [actor for actor, ping in zip(alive, pings) if not _died(ping)]
        if alive:
            time.sleep(0.05)
    return alive


def _died(ping: ray.ObjectRef) -> bool:
    """True if ``ping`` (an actor call) failed because its actor is dead."""
    try:
        ray.get(ping, timeout=0)
    except ray.exceptions.ActorDiedError:
        return True
    except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
        pass  # still running, or busy: ask again
    return False


def _wait_processes_exited(actors: list[ActorHandle], deadline: float) -> list[ActorHandle]:
    """Wait until the processes of ``actors`` (all reported dead) have exited; the actors
    whose process still runs at ``deadline``."""
    by_node: dict[str, dict[int, ActorHandle]] = defaultdict(dict)
    for actor in actors:
        # The entry of a dead actor keeps the pid and node of its last process (pid 0 if it
        # never started).
        entry = ray_state.actors(actor._actor_id.hex())
        if entry and entry["Pid"]:
            by_node[entry["Address"]["NodeID"]][entry["Pid"]] = actor
    here = _local_node_id()
    waits = {
        node_id: _remote_wait_pids_exited.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        ).remote(list(pids), deadline - time.monotonic())
        for node_id, pids in by_node.items()
        if node_id != here
    }
    still: list[ActorHandle] = []
    if here in by_node:
        local = by_node[here]
        still += [local[pid] for pid in _wait_pids_exited(list(local), deadline - time.monotonic())]
    for node_id, ref in waits.items():
        try:
            running = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0) + 10.0)
        except (ray.exceptions.NodeDiedError, ray.exceptions.TaskUnschedulableError):
            running = []  # the node, and so its processes, are gone
        except ray.exceptions.GetTimeoutError:
            running = list(by_node[node_id])
        still += [by_node[node_id][pid] for pid in running]
    return still


def _local_node_id() -> str:
    """Hex id of the Ray node this process runs on."""
    return ray.get_runtime_context().get_node_id()


def _wait_pids_exited(pids: list[int], timeout_s: float) -> list[int]:
    """Wait up to ``timeout_s`` seconds for the processes ``pids`` of this machine to exit
    (a zombie counts as exited: its sockets and memory are released); those still running."""
    deadline = time.monotonic() + timeout_s
    running = list(pids)
    while True:
        running = [pid for pid in running if _runs(pid)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.01)


_remote_wait_pids_exited = ray.remote(num_cpus=0)(_wait_pids_exited)


def _runs(pid: int) -> bool:
    """True if process ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
