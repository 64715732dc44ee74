"""launchers/ray_common.sh: the port layout, the Ray environment filter, bounded waits/stops."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
COMMON = REPO / "launchers" / "ray_common.sh"


def bash(script: str, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run ``script`` in bash after sourcing ray_common.sh."""
    return subprocess.run(
        ["bash", "-c", f"source {COMMON}\n{script}"],
        capture_output=True,
        text=True,
        env=env if env is not None else {"PATH": os.environ["PATH"]},
        cwd=cwd,
        timeout=60,
    )


def ray_args(role: str, block: int, base: int = 21000, worker_ports: int = 64) -> list[str]:
    out = bash(
        f"NRL_RAY_PORT_BASE={base} NRL_RAY_WORKER_PORTS={worker_ports} NRL_RAY_NUM_CPUS=3 "
        f"NRL_GPUS_PER_NODE=8\nnrl_ray_start_args {role} 10.0.0.{block + 5} {block} 10.0.0.1\n"
        'printf "%s\\n" "${NRL_RAY_ARGS[@]}"'
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def ports_of(args: list[str]) -> list[int]:
    """Every port a `ray start` argument list pins (worker ranges expanded)."""
    values = dict(a.removeprefix("--").split("=", 1) for a in args if "=" in a)
    ports = [int(v) for k, v in values.items() if k.endswith("port") and k != "max-worker-port"]
    ports.remove(int(values["min-worker-port"]))
    ports += range(int(values["min-worker-port"]), int(values["max-worker-port"]) + 1)
    return ports


def test_head_and_worker_blocks_are_disjoint_and_fill_the_span() -> None:
    base, worker_ports, nodes_per_address = 21000, 64, 3
    head = ray_args("head", 0, base, worker_ports)
    assert "--head" in head and f"--port={base}" in head and "--include-dashboard=false" in head
    assert "--num-cpus=3" in head and "--num-gpus=8" in head and "--block" in head
    workers = [ray_args("worker", k, base, worker_ports) for k in (1, 2)]
    assert all(f"--address=10.0.0.1:{base}" in w and "--head" not in w for w in workers)
    assert "--node-ip-address=10.0.0.7" in workers[1]
    all_ports = ports_of(head) + [p for w in workers for p in ports_of(w)]
    assert len(all_ports) == len(set(all_ports)), "two listeners share a port"
    span_out = bash(f"NRL_RAY_WORKER_PORTS={worker_ports}\nnrl_port_span {nodes_per_address}")
    span = int(span_out.stdout)
    assert min(all_ports) == base and max(all_ports) == base + span - 1


def test_extra_ray_start_args_are_appended() -> None:
    out = bash(
        "NRL_RAY_PORT_BASE=21000 NRL_RAY_WORKER_PORTS=64 "
        "NRL_RAY_START_ARGS='--object-store-memory=100000000 --log-style=record'\n"
        'nrl_ray_start_args head 127.0.0.1 0\nprintf "%s\\n" "${NRL_RAY_ARGS[@]}"'
    )
    assert out.stdout.splitlines()[-2:] == ["--object-store-memory=100000000", "--log-style=record"]


def test_port_range_reaching_the_ephemeral_range_is_refused() -> None:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    check = "NRL_RAY_WORKER_PORTS=64\nnrl_check_ports 152"
    out = bash(f"NRL_RAY_PORT_BASE={first_ephemeral - 100} {check}")
    assert out.returncode == 2
    assert f"must lie within 1024-{first_ephemeral - 1}" in out.stderr
    assert "lower --ray-port-base (NRL_RAY_PORT_BASE) or --ray-worker-ports" in out.stderr
    ok = bash(f"NRL_RAY_PORT_BASE={first_ephemeral - 152} {check}")
    assert ok.returncode == 0, ok.stderr


def test_default_port_base_follows_the_job_id_and_fits() -> None:
    first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    bases = [int(bash(f"nrl_default_port_base 1016 {job}").stdout) for job in (7, 8, 7)]
    assert bases[0] == bases[2] and bases[0] != bases[1]
    assert all(20000 <= b and b + 1016 <= first_ephemeral for b in bases)
    too_big = bash("nrl_default_port_base 20000 7")
    assert too_big.returncode == 2 and "lower --ray-worker-ports" in too_big.stderr


def test_ray_env_keeps_the_base_list_and_passthrough_only(tmp_path: Path) -> None:
    (tmp_path / "HF_zzz").touch()  # a file an unquoted glob HF_* would expand to
    env = {
        "PATH": os.environ["PATH"],
        "HF_HOME": "/hf",
        "NCCL_DEBUG": "INFO",
        "SLURM_JOB_ID": "12",
        "WANDB_API_KEY": "secret",
        "MY_SETTING": "a b",
        "MY_OTHER": "x",
        "UNRELATED": "y",
        "NRL_ENV_PASSTHROUGH": "MY_SET* NOT_SET",
    }
    out = bash("nrl_exec_with_ray_env env", env=env, cwd=tmp_path)
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert seen == {
        "PATH": os.environ["PATH"],
        "HF_HOME": "/hf",
        "NCCL_DEBUG": "INFO",
        "SLURM_JOB_ID": "12",
        "MY_SETTING": "a b",
    }
    everything = bash("nrl_exec_with_ray_env env", env={**env, "NRL_ENV_PASSTHROUGH": "*"})
    assert "WANDB_API_KEY=secret" in everything.stdout.splitlines()


def test_wait_tcp_answers_fails_on_exit_and_times_out() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        up = bash(f"sleep 30 >/dev/null & nrl_wait_tcp 127.0.0.1 {port} 10 $!; echo rc=$?; kill $!")
        assert up.stdout.strip() == "rc=0"
    dead = bash(f"true & p=$!; sleep 0.2; nrl_wait_tcp 127.0.0.1 {port} 10 $p; echo rc=$?")
    assert dead.stdout.strip() == "rc=1"
    slow = bash(f"sleep 30 >/dev/null & nrl_wait_tcp 127.0.0.1 {port} 1 $!; echo rc=$?; kill $!")
    assert slow.stdout.strip() == "rc=2"


def test_monitor_returns_the_exit_code_or_fails_when_a_watched_process_ends() -> None:
    ok = bash(
        "sleep 30 >/dev/null & head=$!; nrl_watch $head 'Ray head' /x.log\n"
        "bash -c 'sleep 1; exit 9' & nrl_monitor $!\necho rc=$NRL_MONITOR_RC; kill $head"
    )
    assert ok.stdout.strip() == "rc=9"
    died = bash(
        "bash -c 'exit 3' & nrl_watch $! 'Ray worker step on n2' /n2.log\n"
        "sleep 30 >/dev/null & driver=$!; trap 'kill $driver' EXIT\n"
        "nrl_monitor $driver\necho not reached"
    )
    assert died.returncode == 5 and "not reached" not in died.stdout
    assert "the Ray worker step on n2 ended (exit code 3) while the job was running" in died.stderr
    assert "Its log: /n2.log" in died.stderr


@pytest.mark.parametrize(("ignores_term", "status"), [(False, 143), (True, 137)])
def test_stop_terminates_then_kills(ignores_term: bool, status: int) -> None:
    trap = "trap '' TERM; " if ignores_term else ""
    child = f"bash -c \"{trap}exec sleep 30\" & p=$!\nsleep 0.3\n"
    out = bash(child + "nrl_stop 2 $p\nwait $p\necho $?")
    assert out.stdout.strip() == str(status)  # SIGTERM (128+15), or SIGKILL (128+9) after 2 s


@pytest.mark.parametrize(
    "settings, rc, requeued",
    [
        ("NRL_REQUEUE=1", 75, True),  # the driver stopped early, or a worker died or hung
        ("NRL_REQUEUE=1", 5, True),  # a Ray node died under the driver
        ("NRL_REQUEUE=1", 1, False),  # a failure a rerun would repeat
        ("NRL_REQUEUE=1", 143, False),  # scancel or the time limit
        ("NRL_REQUEUE=0", 75, False),
        ("NRL_REQUEUE=1 SLURM_RESTART_COUNT=3", 75, False),  # the default limit reached
        ("NRL_REQUEUE=1 NRL_MAX_REQUEUES=4 SLURM_RESTART_COUNT=3", 75, True),
    ],
)
def test_requeue_follows_the_exit_code_and_the_limit(
    tmp_path: Path, settings: str, rc: int, requeued: bool
) -> None:
    scontrol = tmp_path / "scontrol"  # records its arguments instead of asking slurm
    scontrol.write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/calls\n')
    scontrol.chmod(0o755)
    out = bash(
        f"SLURM_JOB_ID=41 {settings} nrl_requeue_if_resumable {rc}",
        env={"PATH": f"{tmp_path}:{os.environ['PATH']}"},
    )
    assert out.returncode == 0, out.stderr
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    assert calls == ("requeue 41\n" if requeued else "")
    if requeued:
        assert "requeueing job 41 (restart" in out.stdout and "resumes from the newest" in out.stdout
    elif "SLURM_RESTART_COUNT=3" in settings:
        assert "not requeued: job 41 was requeued 3 time(s) already (--max-requeues 3)" in out.stdout
