"""Running untrusted Python (model-written code) in a contained subprocess.

:class:`Sandbox` runs one program at a time per call (calls may run in parallel from several
threads, each with its own uid slot) and returns a :class:`SandboxResult`. Every run gets:

- a wall-clock limit (the whole process group, and in the isolated mode the whole PID
  namespace, is killed with SIGKILL when it passes), a CPU-time limit (RLIMIT_CPU), an
  address-space limit (RLIMIT_AS), a process limit (RLIMIT_NPROC of its own uid) and a
  file-size limit (RLIMIT_FSIZE);
- a private working folder, removed after the run, and stdout/stderr capped at
  ``max_output_bytes`` each (written to files the runner opened, the cap enforced by
  RLIMIT_FSIZE and the text cut with :data:`TRUNCATION_MARKER`);
- unbuffered output (what a program printed before it was killed is kept);
- stdin from the given text only (empty: end of file at once), and an environment of
  ``PATH``, ``LANG``, ``HOME``/``TMPDIR`` (the working folder) and single-thread BLAS settings:
  nothing of the trainer's environment.

Isolated mode (:func:`isolation_problem` is None: root and a working ``unshare``): the program
also runs in new network (no interface up but a down loopback: no connection anywhere, not
even 127.0.0.1), PID (it sees only its own processes; all die with the run) and mount
namespaces, as an unprivileged uid with no capabilities and no_new_privs, /tmp, /var/tmp,
/dev/shm and /run hidden, every mount read-only and nosuid except its private tmpfs working
folder (``work_dir_mb``). See :mod:`nemo_rl.environments.sandbox_init`.

Unisolated mode (only when the caller allows it; the code environment's
``allow_no_network_isolation``): the same limits, folder, environment and output cap, but the
program runs as the trainer's user with its network and file system (it can connect anywhere
and write wherever that user can), and when that user is root RLIMIT_NPROC does not bound its
processes; processes that leave the process group (``setsid``) survive the run.
"""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

TRUNCATION_MARKER = "\n[... output truncated at {limit} bytes]"

# The first process of a run (a standalone script: nothing of nemo_rl is imported in a sandbox).
INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")

# Exit status sandbox_init.py gives when it could not set the sandbox up.
SETUP_FAILED = 125

_CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
_UNSHARE = ["unshare", "--net", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc",
            "--propagation", "private"]


class Outcome(str, enum.Enum):
    """How a run ended (the first that applies, in this order). The refusals are recognised
    from a traceback's exception line in stderr when the run fails; a program that catches the
    error and exits 0 ends ``ok``."""

    TIMEOUT = "timeout"  # past the wall-clock limit, killed
    CPU_LIMIT = "cpu_limit"  # past RLIMIT_CPU (SIGXCPU or SIGKILL at the hard limit)
    OUTPUT_LIMIT = "output_limit"  # wrote past RLIMIT_FSIZE (SIGXFSZ): output or a file capped
    MEMORY = "memory"  # an uncaught MemoryError, or killed by SIGKILL/SIGSEGV (no allocation)
    # An uncaught error from an operation the sandbox refuses (the last line of stderr):
    PROCESS_LIMIT = "process_limit"  # fork/thread start over max_processes (EAGAIN)
    NETWORK_DENIED = "network_denied"  # a connection with no network (ENETUNREACH)
    FILESYSTEM_DENIED = "filesystem_denied"  # a write outside the folder (EROFS, EACCES)
    SETUP_FAILED = "setup_failed"  # the sandbox could not be set up; the program never ran
    OK = "ok"  # exit code 0
    ERROR = "error"  # any other exit code


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run.

    Attributes:
        timeout_s: wall-clock seconds before the run is killed.
        cpu_time_s: CPU seconds (RLIMIT_CPU, whole seconds, at least 1).
        memory_mb: address space of each process, MiB (RLIMIT_AS).
        max_processes: processes (and threads) of the sandbox uid (RLIMIT_NPROC).
        max_output_bytes: bytes kept of stdout and of stderr each; also the largest file the
            program may write (RLIMIT_FSIZE).
        work_dir_mb: size of the private tmpfs working folder, MiB (isolated mode).
    """

    timeout_s: float = 5.0
    cpu_time_s: int = 5
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 4096
    work_dir_mb: int = 64


@dataclass(frozen=True)
class SandboxResult:
    """What a run printed and how it ended.

    Attributes:
        stdout, stderr: the program's output (UTF-8, undecodable bytes replaced), each cut at
            ``max_output_bytes`` and ended with :data:`TRUNCATION_MARKER` when cut.
        exit_code: the program's exit code, 128 + signal when a signal ended it, None when
            the run was killed at the wall-clock limit.
        outcome: how it ended.
        output_truncated: stdout or stderr was cut.
        wall_s: seconds the run took.
    """

    stdout: str
    stderr: str
    exit_code: Optional[int]
    outcome: Outcome
    output_truncated: bool
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class SandboxUnavailable(RuntimeError):
    """Isolation was required and this machine cannot provide it; the message says why."""


def isolation_problem() -> Optional[str]:
    """Why the isolated mode cannot run here (None: it can).

    It needs root (to make the namespaces, remount and change uid) and ``unshare`` making
    network, PID and mount namespaces: the probe runs ``unshare ... true``.
    """
    if os.geteuid() != 0:
        return (
            f"the trainer runs as uid {os.geteuid()}, not root: it cannot make the network, "
            "PID and mount namespaces or switch the program to an unprivileged uid"
        )
    if shutil.which("unshare") is None:
        return "the 'unshare' command (util-linux) is not installed"
    probe = subprocess.run(
        [*_UNSHARE, "true"], capture_output=True, timeout=30, env={"PATH": _CLEAN_PATH}
    )
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip() or f"exit {probe.returncode}"
        return f"'unshare' cannot make the namespaces here ({reason})"
    return None


# An exception's line in a traceback ("OSError: [Errno 30] ...").
_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit): ")
# Errors of refused operations, as such a line reads (the last one of stderr that matches
# decides: with several processes writing, the main program's traceback need not be last).
_REFUSALS = (
    ("[Errno 27] File too large", Outcome.OUTPUT_LIMIT),
    ("[Errno 11] Resource temporarily unavailable", Outcome.PROCESS_LIMIT),
    ("can't start new thread", Outcome.PROCESS_LIMIT),
    ("[Errno 101] Network is unreachable", Outcome.NETWORK_DENIED),
    ("[Errno 30] Read-only file system", Outcome.FILESYSTEM_DENIED),
    ("[Errno 13] Permission denied", Outcome.FILESYSTEM_DENIED),
)


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    """The first ``limit`` bytes of the file as text, and whether there was more."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    cut = len(data) > limit
    text = data[:limit].decode(errors="replace")
    return (text + TRUNCATION_MARKER.format(limit=limit) if cut else text), cut


def _outcome(exit_code: Optional[int], stderr: str) -> Outcome:
    if exit_code is None:
        return Outcome.TIMEOUT
    if exit_code == SETUP_FAILED and stderr.startswith("sandbox setup failed"):
        return Outcome.SETUP_FAILED
    if exit_code == 128 + signal.SIGXCPU:
        return Outcome.CPU_LIMIT
    if exit_code == 128 + signal.SIGXFSZ:
        return Outcome.OUTPUT_LIMIT
    if exit_code == 0:
        return Outcome.OK
    last_line = stderr.rstrip().rsplit("\n", 1)[-1]
    if exit_code in (128 + signal.SIGKILL, 128 + signal.SIGSEGV) or last_line.startswith(
        "MemoryError"
    ):
        return Outcome.MEMORY
    for line in reversed(stderr.splitlines()):
        for pattern, outcome in _REFUSALS:
            if pattern in line and _EXCEPTION_LINE.match(line):
                return outcome
    return Outcome.ERROR


class Sandbox:
    """Runs Python programs under :class:`SandboxLimits` (see the module docstring).

    Args:
        limits: the limits of every run.
        isolate: run in the isolated mode; :class:`SandboxUnavailable` if this machine cannot.
        uid: first unprivileged uid (and gid) of the isolated mode; run slot ``k`` uses
            ``uid + k``, so parallel runs never share a process count. These uids must own no
            other processes on the machine.
        slots: runs that may be in flight at once (each caller passes its slot to :meth:`run`).
        python: interpreter of the programs (default: the trainer's).

    Raises:
        SandboxUnavailable: ``isolate`` and :func:`isolation_problem` says why not, or a probe
            program (``print``) does not run (the message holds its error).
    """

    def __init__(
        self,
        limits: SandboxLimits,
        isolate: bool = True,
        uid: int = 62000,
        slots: int = 1,
        python: Optional[str] = None,
    ) -> None:
        if isolate and (problem := isolation_problem()) is not None:
            raise SandboxUnavailable(problem)
        self.limits = limits
        self.isolate = isolate
        self.uid = uid
        self.slots = slots
        self.python = python or sys.executable
        if isolate:  # what a previous owner of the slots (an actor that died) left running
            for slot in range(slots):
                _kill_uid(uid + slot)
        probe = self.run("print('sandbox ok')")
        if probe.stdout != "sandbox ok\n":
            raise SandboxUnavailable(
                f"a test program did not run in the sandbox ({probe.outcome.value}, exit "
                f"{probe.exit_code}): {probe.stderr.strip()[-500:]}"
            )

    def _environment(self, work_dir: str) -> dict[str, str]:
        return {
            "PATH": _CLEAN_PATH,
            "LANG": "C.UTF-8",
            "HOME": work_dir,
            "TMPDIR": work_dir,
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }

    def _spec(self, run_dir: Path, work_dir: Path, slot: int) -> dict:
        limits = self.limits
        program = str(run_dir / "main.py") if self.isolate else str(work_dir / "main.py")
        return {
            "isolate": self.isolate,
            "uid": self.uid + slot,
            "gid": self.uid + slot,
            "work_dir": str(work_dir),
            "work_dir_mb": limits.work_dir_mb,
            "files": {"main.py": program},
            # the interpreter's folders, and the way to the work folder (TMPDIR may lie
            # under a folder closed to other users)
            "expose": sorted(
                {
                    sys.base_prefix,
                    sys.prefix,
                    str(Path(self.python).resolve().parent.parent),
                    str(run_dir),
                }
            ),
            "python": self.python,
            "argv": ["main.py"],
            "env": self._environment(str(work_dir)),
            "limits": {
                "cpu_time_s": max(1, int(limits.cpu_time_s)),
                "memory_bytes": limits.memory_mb * 2**20,
                "max_processes": limits.max_processes,
                "max_file_bytes": limits.max_output_bytes + 1,
            },
        }

    def run(self, source: str, stdin: str = "", slot: int = 0) -> SandboxResult:
        """Run ``source`` as ``main.py`` in a fresh folder, feeding it ``stdin``.

        Args:
            source: the program's text.
            stdin: its standard input ("" : end of file at once).
            slot: the caller's run slot, ``0 <= slot < slots``.
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
        run_dir = Path(tempfile.mkdtemp(prefix="nemo_rl_sandbox_"))
        try:
            return self._run_in(run_dir, source, stdin, slot)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _run_in(self, run_dir: Path, source: str, stdin: str, slot: int) -> SandboxResult:
        # run_dir (root's, 0711): the program text, stdin and output files the sandbox uid
        # cannot open by path; work/ is the program's folder (the tmpfs mount point).
        os.chmod(run_dir, 0o711)
        work_dir = run_dir / "work"
        work_dir.mkdir(mode=0o700)
        program_dir = run_dir if self.isolate else work_dir
        (program_dir / "main.py").write_text(source)
        (run_dir / "stdin").write_text(stdin)
        spec = self._spec(run_dir, work_dir, slot)
        command = [self.python, "-E", "-s", str(INIT_SCRIPT), json.dumps(spec)]
        if self.isolate:
            command = [*_UNSHARE, "--", *command]
        start = time.monotonic()
        with (
            open(run_dir / "stdin", "rb") as stdin_file,
            open(run_dir / "stdout", "wb") as stdout_file,
            open(run_dir / "stderr", "wb") as stderr_file,
        ):
            process = subprocess.Popen(
                command,
                stdin=stdin_file,
                stdout=stdout_file,
                stderr=stderr_file,
                env={"PATH": _CLEAN_PATH, "LANG": "C.UTF-8"},
                cwd=run_dir,
                start_new_session=True,
            )
            try:
                exit_code: Optional[int] = process.wait(timeout=self.limits.timeout_s)
            except subprocess.TimeoutExpired:
                exit_code = None
            finally:
                _kill_group(process)
                if self.isolate:
                    _kill_uid(self.uid + slot)
        wall = time.monotonic() - start
        limit = self.limits.max_output_bytes
        stdout, out_cut = _read_capped(run_dir / "stdout", limit)
        stderr, err_cut = _read_capped(run_dir / "stderr", limit)
        if exit_code is not None and exit_code < 0:  # the runner's child itself was signalled
            exit_code = 128 - exit_code
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            outcome=_outcome(exit_code, stderr),
            output_truncated=out_cut or err_cut,
            wall_s=wall,
        )


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's whole process group (its session leader's group) and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def processes_of(uid: int) -> list[int]:
    """Pids of the processes whose real owner is ``uid`` (from /proc)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                pass
    return pids


def _kill_uid(uid: int, patience_s: float = 10.0) -> None:
    """Wait until the sandbox uid ``uid`` owns no process, SIGKILLing any left.

    The kernel kills a PID namespace's processes when its first process dies, but not
    synchronously with the runner reaping ``unshare``; the next run of the slot must start with
    none of them still counted against its process limit.
    """
    deadline = time.monotonic() + patience_s
    while pids := processes_of(uid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sandbox processes of uid {uid} survive SIGKILL: {pids}")
        time.sleep(0.01)
