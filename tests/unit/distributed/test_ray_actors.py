"""kill_actors against a real local Ray cluster: it returns once the actors' processes are gone.

Ray reports a killed actor dead (``ActorDiedError``) before its process exits, and a process
that serves outside Ray calls (a TransferQueue storage unit's ZMQ socket) keeps serving until
then. The actors here serve a TCP socket from a thread the same way: after ``kill_actors``
nobody may answer there any more.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

import psutil
import pytest
import ray

from nemo_rl.distributed import ray_actors
from nemo_rl.distributed.ray_actors import kill_actors
from nemo_rl.distributed.ray_bootstrap import LOOPBACK

pytestmark = pytest.mark.slow


class SocketServer:
    """Accepts connections on a loopback TCP port from a thread, outside any Ray call."""

    def __init__(self) -> None:
        self.server = socket.create_server((LOOPBACK, 0))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.server.accept()
            conn.sendall(b"alive")
            conn.close()

    def where(self) -> tuple[int, int]:
        """(pid, port) of this actor's process and socket."""
        return os.getpid(), self.server.getsockname()[1]


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def answers(port: int) -> bool:
    """True if something accepts a connection on ``LOOPBACK:port``."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=5) as conn:
            return conn.recv(5) == b"alive"
    except OSError:
        return False


def running(pid: int) -> bool:
    """True if process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_servers(n: int) -> tuple[list[ray.actor.ActorHandle], list[int], list[int]]:
    """``n`` started :class:`SocketServer` actors, their pids and their ports."""
    actors = [ray.remote(num_cpus=0)(SocketServer).remote() for _ in range(n)]
    pids, ports = zip(*ray.get([a.where.remote() for a in actors], timeout=120))
    assert all(answers(port) for port in ports)
    return actors, list(pids), list(ports)


def test_kill_actors_returns_once_the_processes_have_exited(local_ray_8cpu: None) -> None:
    # Several rounds: right after ray.kill the process still runs most of the time.
    for _ in range(5):
        actors, pids, ports = start_servers(2)
        assert kill_actors(actors, timeout_s=60) == []
        assert [running(pid) for pid in pids] == [False, False]
        assert [answers(port) for port in ports] == [False, False]
        for actor in actors:
            with pytest.raises(ray.exceptions.ActorDiedError):
                ray.get(actor.where.remote(), timeout=30)


def test_kill_actors_waits_on_another_node_with_a_task_there(
    local_ray_8cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pretend the driver runs elsewhere: the actors' node is then waited on by a pinned task.
    monkeypatch.setattr(ray_actors, "_local_node_id", lambda: "another node")
    actors, pids, ports = start_servers(2)
    assert kill_actors(actors, timeout_s=60) == []
    assert [running(pid) for pid in pids] == [False, False]
    assert [answers(port) for port in ports] == [False, False]


def test_kill_actors_of_an_actor_that_never_started(local_ray_8cpu: None) -> None:
    # Asks for more CPUs than the cluster has: pending forever, no process to wait for.
    pending = ray.remote(num_cpus=64)(SocketServer).remote()
    assert kill_actors([pending], timeout_s=60) == []
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(pending.where.remote(), timeout=30)
