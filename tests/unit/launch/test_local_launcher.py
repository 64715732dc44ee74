"""``nemo-rl launch local`` with a real Ray head: exit code, environment, signals, head failure.

Every process the launcher starts inherits NEMO_RL_TEST_MARKER (a name the Ray environment
filter keeps), so "nothing left behind" is checked by scanning /proc for it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemo_rl.launch import exit_codes

pytestmark = pytest.mark.slow

NEMO_RL = Path(sys.executable).parent / "nemo-rl"
STARTUP_S = 180  # bound on the Ray head coming up on a loaded machine
GONE_S = 30

DRIVER = textwrap.dedent(
    """\
    import os, signal, sys, time
    import ray
    from nemo_rl.distributed.ray_bootstrap import init_ray

    def on_term(signum, frame):
        open(sys.argv[2], "w").write("got SIGTERM")
        sys.exit(0)

    handle = init_ray()  # RAY_ADDRESS from the launcher
    signal.signal(signal.SIGTERM, on_term)  # after ray.init, which installs its own

    @ray.remote(num_cpus=1)
    def actor_env():
        return os.environ.get("HF_HOME"), os.environ.get("MY_SECRET")

    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    print(f"DRIVER address={handle.address} nodes={nodes} cpus={ray.cluster_resources()['CPU']}")
    print(f"DRIVER actor env={ray.get(actor_env.remote())}", flush=True)
    if sys.argv[1] == "hold":
        time.sleep(600)
    sys.exit(7)
    """
)


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="nrll", dir="/tmp"))  # short: Ray's socket paths
    (path / "driver.py").write_text(DRIVER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _free_base() -> int:
    """A port base whose GCS port nothing listens on (the launcher refuses a busy one)."""
    for base in range(24000 + os.getpid() % 4000, 32000, 97):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", base)) != 0:
                return base
    raise RuntimeError("no free port base")


def _start(
    workdir: Path, mode: str, marker: str, teardown_s: int = 20
) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "NEMO_RL_TEST_MARKER": marker,
        "HF_HOME": "/hf",
        "MY_SECRET": "s3cret",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [str(NEMO_RL), "launch", "local", "--ray-num-cpus", "4", "--ray-port-base",
         str(_free_base()), "--ray-worker-ports", "64", "--ray-temp-dir", str(workdir / "ray"),
         "--log-dir", str(workdir / "logs"), "--head-timeout-s", str(STARTUP_S),
         "--teardown-timeout-s", str(teardown_s), "--",
         sys.executable, str(workdir / "driver.py"), mode, str(workdir / "term.txt")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir,
    )


def _read_until(proc: subprocess.Popen[str], pattern: str) -> tuple[str, re.Match[str]]:
    """Output of ``proc`` up to the first line matching ``pattern`` (fails if it exits first)."""
    assert proc.stdout is not None
    seen = ""
    for line in proc.stdout:
        seen += line
        if match := re.search(pattern, line):
            return seen, match
    raise AssertionError(f"launcher exited (code {proc.wait()}) before {pattern!r}:\n{seen}")


def _marked_processes(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return found


def _assert_all_gone(marker: str) -> None:
    deadline = time.monotonic() + GONE_S
    while (left := _marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left behind: {left}"


def test_command_joins_the_head_and_its_exit_code_is_returned(workdir: Path) -> None:
    marker = uuid.uuid4().hex
    proc = _start(workdir, "exit", marker)
    out = proc.communicate(timeout=STARTUP_S + 120)[0]
    assert proc.returncode == 7, out
    assert "DRIVER address=127.0.0.1:" in out and "nodes=['127.0.0.1'] cpus=4.0" in out
    # Actors see the base list (HF_HOME) but not the rest of the launcher's environment.
    assert "DRIVER actor env=('/hf', None)" in out
    assert list((workdir / "logs").glob("ray-head-*.log"))
    _assert_all_gone(marker)


def test_sigterm_reaches_the_command_and_stops_ray(workdir: Path) -> None:
    marker = uuid.uuid4().hex
    proc = _start(workdir, "hold", marker)
    out, _ = _read_until(proc, r"DRIVER actor env=")
    proc.send_signal(signal.SIGTERM)
    out += proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "received SIGTERM; stopping the command and Ray" in out
    assert (workdir / "term.txt").read_text() == "got SIGTERM"
    _assert_all_gone(marker)


def test_ray_head_death_ends_the_command_with_the_launchers_error(workdir: Path) -> None:
    marker = uuid.uuid4().hex
    # The driver, its head gone, takes ~16 s to end after SIGTERM (Ray's shutdown retries the
    # dead GCS): the launcher's bounded wait then kills it, which is what this checks.
    proc = _start(workdir, "hold", marker, teardown_s=3)
    out, match = _read_until(proc, r"Ray head up at \S+ \(pid (\d+),")
    out += _read_until(proc, r"DRIVER actor env=")[0]
    os.kill(int(match.group(1)), signal.SIGKILL)
    out += proc.communicate(timeout=60)[0]
    assert proc.returncode == exit_codes.NODE_DIED, out
    assert f"error: the Ray head (pid {match.group(1)}) ended (exit code 137)" in out
    _assert_all_gone(marker)
