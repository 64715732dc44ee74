"""Which TCP sockets a process tree listens on: :class:`ListenerScan` lists, every 0.2 s, the
sockets in LISTEN state of this process and all its descendants (Ray's GCS, raylet and agents,
the actors' worker processes and what they start), for tests that a local run listens on
loopback only."""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field

import psutil


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
