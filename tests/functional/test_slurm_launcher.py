"""``nemo-rl launch slurm`` against a real two-node slurm on loopback.

The fixture runs slurmctld and two slurmd (node1, node2; both 127.0.0.1, distinct ports) with
munge inside a network namespace that has only ``lo``, so Ray cannot wander off to the machine's
outward address and nothing listens outside the namespace. All state lives in a temporary folder;
the daemons are stopped by the pids the fixture started. Needs root (network namespaces) and the
Debian slurm packages (``scripts/setup_slurm.sh``). A requeued job waits ``cred_expire`` (10 s
here, slurm's default 120 s; a job step's launch credential must reach its slurmd within it) before
it starts again, then for the next pass of the scheduler (every 1-2 s here; by default the
backfill's, every 30 s). The launcher's waits (the head's port, the nodes' registration, the
monitor) look every ``NRL_POLL_S`` = 0.2 s here (1 s by default).
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
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemo_rl.launch import exit_codes
from nemo_rl.utils import fault_injection
from nemo_rl.utils.config import config_to_yaml

from tiny_grpo import WARM_RUN_STEPS, assert_same_steps, train_records, warm_started_config

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
SLURM_BINARIES = (
    "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel", "munged"
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(b) is None for b in SLURM_BINARIES),
        reason="slurm binaries absent (slurmctld, slurmd, slurm-client, munge): run "
        "scripts/setup_slurm.sh",
    ),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("nsenter") is None,
        reason="needs root, ip and nsenter for the loopback-only network namespace",
    ),
]

# Wait bounds (seconds): generous, for a loaded 2-core machine.
DAEMONS_UP_S = 60
JOB_DONE_S = 240
FAILURE_DONE_S = 90  # the job must end this soon after a Ray node's step is killed
GRPO_JOB_S = 900  # a tiny GRPO job, run twice (requeued)
LEFTOVERS_GONE_S = 30
POLL_S = 0.25  # between looks at a job's state, a log or the namespace's processes


@dataclass
class LoopbackSlurm:
    """A running two-node slurm: run client commands in its namespace with :meth:`run`."""

    base: Path
    netns: str
    conf: Path
    daemons: dict[str, subprocess.Popen[bytes]]
    baseline: frozenset[int] = frozenset()  # the daemons' own helpers (slurmscriptd)

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
            "RAY_AUTH_MODE": "disabled",
            "NRL_POLL_S": "0.2",  # the job script's waits (sbatch passes the environment on)
        }

    def run(self, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.netns}", *cmd],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.base,
        )

    def job_fields(self, job_id: str) -> dict[str, str]:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job_done(self, job_id: str, timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.job_fields(job_id)
            if fields.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
                return fields
            time.sleep(POLL_S)
        fields = self.job_fields(job_id)
        raise AssertionError(f"job {job_id} not done after {timeout_s} s: {fields}")

    def namespace_processes(self) -> dict[int, str]:
        """Processes in the namespace other than the daemons: ``{pid: command line}``."""
        ns = os.readlink(f"/proc/{self.daemons['slurmctld'].pid}/ns/net")
        daemon_pids = {p.pid for p in self.daemons.values()} | self.baseline
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemon_pids:
                continue
            try:
                if os.readlink(entry / "ns/net") != ns:
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            # nsenter itself and the client commands of other fixture calls are not the job's.
            if cmdline and not cmdline.startswith(("nsenter", "scontrol", "squeue")):
                found[int(entry.name)] = cmdline
        return found


def _write_slurm_conf(base: Path) -> Path:
    host = socket.gethostname().split(".")[0]
    conf = base / "slurm.conf"
    nodes = "\n".join(
        f"NodeName=node{i} NodeAddr=127.0.0.1 NodeHostname={host} Port={6817 + i} CPUs=2 "
        f"State=UNKNOWN"
        for i in (1, 2)
    )
    conf.write_text(
        textwrap.dedent(
            f"""\
            ClusterName=nrltest
            SlurmctldHost={host}(127.0.0.1)
            SlurmctldPort=6817
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={base}/munge/munge.sock,cred_expire=10
            SchedulerParameters=sched_interval=2,bf_interval=1
            CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            SlurmdParameters=config_overrides
            AccountingStorageType=accounting_storage/none
            JobAcctGatherType=jobacct_gather/none
            JobCompType=jobcomp/none
            MpiDefault=none
            ReturnToService=2
            KillWait=30
            StateSaveLocation={base}/state
            SlurmdSpoolDir={base}/spool/%n
            SlurmctldPidFile={base}/slurmctld.pid
            SlurmdPidFile={base}/slurmd-%n.pid
            SlurmctldLogFile={base}/log/slurmctld.log
            SlurmdLogFile={base}/log/slurmd-%n.log
            """
        )
        + nodes
        + "\nPartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP\n"
    )
    return conf


def _start_munge(base: Path) -> subprocess.Popen[bytes]:
    munge_dir = base / "munge"  # munged wants its socket folder searchable by all, owned by it
    munge_dir.mkdir(mode=0o755)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    for path in (munge_dir, key):
        shutil.chown(path, "munge", "munge")
    key.chmod(0o400)
    return subprocess.Popen(
        ["setpriv", "--reuid=munge", "--regid=munge", "--clear-groups", "munged", "-F",
         f"--socket={munge_dir}/munge.sock", f"--key-file={key}",
         f"--pid-file={munge_dir}/munged.pid", f"--seed-file={munge_dir}/seed",
         f"--log-file={munge_dir}/munged.log"],
        stdout=subprocess.DEVNULL,
        stderr=open(base / "log/munged.out", "wb"),
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)


@pytest.fixture(scope="module")
def slurm() -> Iterator[LoopbackSlurm]:
    base = Path(tempfile.mkdtemp(prefix="nrls", dir="/tmp"))  # short: Ray's socket paths
    base.chmod(0o755)
    for sub in ("state", "spool", "log", "logs"):
        (base / sub).mkdir()
    netns = f"nrl-slurm-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    try:
        inside = ["ip", "netns", "exec", netns, "ip"]
        subprocess.run([*inside, "link", "set", "lo", "up"], check=True)
        # slurmctld cannot resolve 127.0.0.1 in a namespace holding only that address.
        subprocess.run([*inside, "addr", "add", "127.0.0.2/8", "dev", "lo"], check=True)
        conf = _write_slurm_conf(base)
        daemons["munged"] = _start_munge(base)
        enter = ["nsenter", f"--net=/run/netns/{netns}"]  # `ip netns exec` remounts /sys
        for name, cmd in (
            ("slurmctld", ["slurmctld", "-D", "-f", str(conf)]),
            ("node1", ["slurmd", "-D", "-f", str(conf), "-N", "node1"]),
            ("node2", ["slurmd", "-D", "-f", str(conf), "-N", "node2"]),
        ):
            daemons[name] = subprocess.Popen(
                [*enter, *cmd],
                stdout=subprocess.DEVNULL,
                stderr=open(base / f"log/{name}.out", "wb"),
                env={**os.environ, "SLURM_CONF": str(conf)},
            )
        cluster = LoopbackSlurm(base=base, netns=netns, conf=conf, daemons=daemons)
        deadline = time.monotonic() + DAEMONS_UP_S
        while True:
            states = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
            if states.count("idle") == 2:
                break
            if time.monotonic() > deadline:
                logs = (base / "log/slurmctld.log").read_text()[-2000:]
                raise RuntimeError(f"slurm nodes not idle after {DAEMONS_UP_S} s: {states}\n{logs}")
            time.sleep(0.5)
        cluster.baseline = frozenset(cluster.namespace_processes())
        yield cluster
    finally:
        for name in ("node1", "node2", "slurmctld", "munged"):
            if name in daemons:
                _stop(daemons[name])
        subprocess.run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(base, ignore_errors=True)


DRIVER = '''\
"""Tiny CPU driver: joins the job's Ray cluster, checks its 2 nodes, runs an actor on each."""
import os
import signal
import sys
import time

import ray

from nemo_rl.distributed.ray_bootstrap import init_ray, shutdown_ray
from nemo_rl.launch.wait_for_nodes import registered_slurm_nodes, slurm_node_resource


@ray.remote(num_cpus=0.1)
class Probe:
    def where(self):
        return os.environ.get("SLURMD_NODENAME"), ray.get_runtime_context().get_node_id()


def main() -> int:
    init_ray()  # RAY_ADDRESS from the launcher
    nodes = registered_slurm_nodes()
    names = sorted(nodes)
    print(f"DRIVER ray nodes: {names}", flush=True)
    probes = [Probe.options(resources={slurm_node_resource(n): 0.01}).remote() for n in names]
    seen = ray.get([p.where.remote() for p in probes], timeout=180)
    print(f"DRIVER actors ran on: {[s[0] for s in seen]}", flush=True)
    ok = names == ["node1", "node2"] and seen == [(n, nodes[n]) for n in names]
    if sys.argv[1] == "hold":
        print("DRIVER holding", flush=True)
        time.sleep(600)
    marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stopped_once")
    if sys.argv[1] == "stop-once" and not os.path.exists(marker):
        # as `nemo-rl grpo` does with checkpointing.stop_signals: save, stop, exit 75
        received = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
        print("DRIVER waiting for SIGUSR1", flush=True)
        while not received:
            time.sleep(0.2)
        open(marker, "w").close()
        shutdown_ray()
        return 75
    shutdown_ray()
    return 7 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
'''


def _submit(
    slurm: LoopbackSlurm, name: str, mode: str | None, *options: str,
    command: list[str] | None = None,
) -> tuple[str, Path]:
    """Submit the tiny driver in ``mode`` ("hold" or "stop-once"), or an attach job (None), or
    ``command``, with extra launcher ``options``."""
    driver = slurm.base / "driver.py"
    driver.write_text(DRIVER)
    log_dir = slurm.base / "logs"
    nodes = ["--nodes", "2"]
    if command is not None:  # a recipe's command: its cluster section gives the nodes
        command, nodes = ["--", *command], []
    else:
        command = ["--attach"] if mode is None else ["--", sys.executable, str(driver), mode]
    proc = slurm.run(
        str(VENV_BIN / "nemo-rl"), "launch", "slurm", *nodes, "--job-name", name,
        "--time", "10", "--log-dir", str(log_dir), "--ray-port-base", "21000",
        "--ray-worker-ports", "64", "--ray-num-cpus", "2", "--ray-temp-dir",
        str(slurm.base / "ray"), "--head-timeout-s", "120", "--nodes-timeout-s", "120",
        "--teardown-timeout-s", "20", *options, *command,
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"submitted slurm job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1), log_dir


def _wait_for_line(path: Path, text: str, slurm: LoopbackSlurm, job_id: str) -> None:
    deadline = time.monotonic() + JOB_DONE_S
    while not (path.is_file() and text in path.read_text()):
        assert time.monotonic() < deadline, f"no {text!r} in {path}: {slurm.job_fields(job_id)}"
        time.sleep(POLL_S)


def _assert_no_job_processes(slurm: LoopbackSlurm) -> None:
    deadline = time.monotonic() + LEFTOVERS_GONE_S
    while (left := slurm.namespace_processes()) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    assert not left, f"processes of the job remain: {left}"


def test_killing_a_worker_nodes_step_ends_the_job_with_the_launchers_error(
    slurm: LoopbackSlurm,
) -> None:
    job_id, log_dir = _submit(slurm, "nrl-kill", "hold")
    _wait_for_line(log_dir / job_id / "driver.log", "DRIVER holding", slurm, job_id)
    steps = slurm.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j").stdout.split("\n")
    worker_step = next(s.split()[0] for s in steps if s.endswith(" ray-worker-node2"))
    killed = time.monotonic()
    assert slurm.run("scancel", worker_step).returncode == 0
    fields = slurm.wait_job_done(job_id, FAILURE_DONE_S)
    output = (log_dir / f"slurm-{job_id}.out").read_text()
    assert fields["ExitCode"] == f"{exit_codes.NODE_DIED}:0", output
    assert "error: the Ray worker step on node2 (step ray-worker-node2) ended" in output, output
    print(f"job {job_id} ended {time.monotonic() - killed:.1f} s after its worker step was killed")
    assert time.monotonic() - killed < FAILURE_DONE_S
    _assert_no_job_processes(slurm)


def test_attach_job_serves_shells_until_scancel(slurm: LoopbackSlurm) -> None:
    job_id, log_dir = _submit(slurm, "nrl-attach", None)
    output = log_dir / f"slurm-{job_id}.out"
    _wait_for_line(output, "attach mode: Ray is up on 2 node(s)", slurm, job_id)
    # attach.sh without a terminal: srun drops --pty and the shell reads these commands.
    # `ray status` shows the autoscaler's view, refreshed every few seconds: it can list one
    # node for a moment after both registered, so it is asked until it lists two (20 tries).
    count_nodes = "ray status --address $RAY_ADDRESS | grep -c '^ 1 node_'"
    try:
        shell = subprocess.run(
            ["nsenter", f"--net=/run/netns/{slurm.netns}", "bash", str(log_dir / job_id / "attach.sh")],
            input='echo "ATTACHED to=$RAY_ADDRESS on=$SLURMD_NODENAME"\n'
            f'for i in $(seq 20); do n=$({count_nodes}); [ "$n" = 2 ] && break; sleep 1; done\n'
            'echo "$n"\nexit\n',
            capture_output=True, text=True, env=slurm.env(), timeout=180,
        )
        assert "ATTACHED to=127.0.0.1:21000 on=node1" in shell.stdout, shell.stderr
        assert shell.stdout.strip().endswith("\n2"), shell.stdout  # two active Ray nodes
    finally:  # a failed check must not leave the job (and its Ray) running
        cancelled = slurm.run("scancel", job_id).returncode
    assert cancelled == 0
    fields = slurm.wait_job_done(job_id, FAILURE_DONE_S)
    assert fields["ExitCode"] == "143:0"  # 128 + SIGTERM
    assert "received SIGTERM (scancel, the time limit or Ctrl-C); stopping the job" in (
        output.read_text()
    )
    _assert_no_job_processes(slurm)


def test_usr1_reaches_the_driver_and_the_chained_job_runs_across_two_nodes(
    slurm: LoopbackSlurm,
) -> None:
    job_id, log_dir = _submit(
        slurm, "nrl-stop", "stop-once", "--chain-jobs", "1", "--stop-signal-lead-s", "120"
    )
    ids = slurm.run("squeue", "-h", "--name", "nrl-stop", "-o", "%i").stdout.split()
    (chained,) = set(ids) - {job_id}
    _wait_for_line(log_dir / job_id / "driver.log", "DRIVER waiting for SIGUSR1", slurm, job_id)
    # what slurm does N s before the time limit with --signal=B:USR1@N
    assert slurm.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    fields = slurm.wait_job_done(job_id, FAILURE_DONE_S)
    output = (log_dir / f"slurm-{job_id}.out").read_text()
    assert fields["ExitCode"] == "75:0", output
    assert "received SIGUSR1; passing it to the driver" in output, output
    assert "driver exited with code 75" in output
    # exit 75 is "not ok": the follow-up job starts and runs the same command, which this time
    # checks the job's Ray (both nodes, an actor on each) and exits 7: the job's exit code
    fields = slurm.wait_job_done(chained, JOB_DONE_S)
    output = (log_dir / f"slurm-{chained}.out").read_text()
    driver_log = (log_dir / chained / "driver.log").read_text()
    assert fields["ExitCode"] == "7:0", output
    assert "DRIVER ray nodes: ['node1', 'node2']" in driver_log, output
    assert "DRIVER actors ran on: ['node1', 'node2']" in driver_log, output
    assert "all 2 Ray node(s) registered" in output
    assert "driver exited with code 7" in output
    for log in ("ray-head-node1.log", "ray-worker-node2.log", "attach.sh", "sbatch.sh"):
        assert (log_dir / chained / log).is_file(), log
    assert "--jobid=" + chained in (log_dir / chained / "attach.sh").read_text()
    print(f"job {chained}: {fields['StartTime']} -> {fields['EndTime']}")
    _assert_no_job_processes(slurm)


def test_a_run_whose_policy_worker_is_killed_is_requeued_resumes_and_finishes(
    slurm: LoopbackSlurm,
    tiny_llama_path: Path,
    request: pytest.FixtureRequest,
    arm_faults,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiny GRPO run (the session's warm-started run, saving every step) as a job with
    --requeue; its policy worker's process is killed (SIGKILL, as the OOM killer does) as it
    starts training step 2, after step 1 is saved (an injected fault: a kill from outside
    could land after the short run's last step). The driver stops within FAILURE_DONE_S in one
    line naming the worker, its slurm node, the call and the newest checkpoint (step 1's: no
    other is written, none is lost), exits 75, the job requeues itself, the requeued job
    resumes from that checkpoint and finishes; every checkpoint is there and every step's
    numbers are the uninterrupted run's. (The suite's one run of a killed policy worker.)"""
    root = slurm.base / "requeue"
    cfg = warm_started_config(root, tiny_llama_path, WARM_RUN_STEPS, save_period=1)
    recipe = root / "recipe.yaml"
    root.mkdir()
    recipe.write_text(config_to_yaml(cfg))
    # the job's environment carries the fault to its Ray workers; it fires once across the
    # requeue (the shared folder records that it fired)
    fired = arm_faults({"point": "policy.train", "step": 2, "action": "kill"}) / "fired-0"
    job_id, log_dir = _submit(
        slurm, "nrl-requeue", None, "--requeue", "--max-requeues", "1", "--ray-num-cpus", "8",
        command=[str(VENV_BIN / "nemo-rl"), "grpo", "--config", str(recipe)],
    )
    output = log_dir / f"slurm-{job_id}.out"
    deadline = time.monotonic() + GRPO_JOB_S
    while not fired.exists():
        assert time.monotonic() < deadline, (output.read_text(), slurm.job_fields(job_id))
        time.sleep(0.2)
    killed = time.monotonic()
    _wait_for_line(output, f"requeueing job {job_id} (restart 1 of at most 1)", slurm, job_id)
    print(f"job {job_id} requeued {time.monotonic() - killed:.1f} s after its worker was killed")
    assert time.monotonic() - killed < FAILURE_DONE_S
    # the stopped run's checkpoints (the requeued job starts cred_expire = 10 s later)
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["sft_warmup", "step_1"]
    fields = slurm.wait_job_done(job_id, GRPO_JOB_S)
    text = output.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    assert fields["Restarts"] == "1", fields
    newest = root / "ckpt" / "step_1"
    assert (
        "nemo-rl grpo: error: policy worker rank 0 on node1 (127.0.0.1) died during train (its "
        f"worker process has died); the newest checkpoint is {newest}: rerun the same command "
        "to resume from it (exit code 75)\n"
    ) in text, text
    assert "the driver exited with code 75 (a rerun resumes the run): requeueing" in text
    assert f"job {job_id} (requeued: restart 1)" in text
    assert f"resumed from {newest} (step 1)" in text
    # no checkpoint lost: the warm start's and every step's
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == [
        "sft_warmup", *(f"step_{k}" for k in range(1, WARM_RUN_STEPS + 1))
    ]
    _assert_no_job_processes(slurm)
    got = train_records(root / "logs")
    assert sorted(got) == list(range(1, WARM_RUN_STEPS + 1))
    # asked for only now: unless an earlier test ran it, it runs on a stack of workers held in
    # a local Ray, which would compete with the job's run for the cores and memory (unarmed)
    monkeypatch.delenv(fault_injection.FAULTS_ENV)
    fault_injection._armed.cache_clear()
    expected = train_records(request.getfixturevalue("warm_colocated_run") / "logs")
    assert_same_steps(got, expected, range(1, WARM_RUN_STEPS + 1))
