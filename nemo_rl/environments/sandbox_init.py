"""The first process of a sandbox run: sets the run up, starts the program, reports its end.

Run by :class:`nemo_rl.environments.sandbox.Sandbox` as ``python -E -s sandbox_init.py SPEC``
(SPEC: a JSON object, below); standalone (it imports nothing of nemo_rl, so it starts fast and
nothing of the trainer is loaded into the sandbox). In the isolated mode it runs as root as
PID 1 of fresh PID, mount and network namespaces made by ``unshare`` and, before the program
starts:

1. hides /tmp, /var/tmp, /dev/shm and /run, makes the interpreter's folders and the work
   folder reachable (``expose``), and remounts every mount of its mount namespace read-only
   and nosuid (a bind remount: the change is seen only in this namespace, the trainer's view
   is untouched);
2. mounts a private tmpfs of ``work_dir_mb`` MiB on ``work_dir`` (owned by the sandbox uid)
   and copies the program's files into it;
3. drops to the unprivileged ``uid``/``gid`` with no supplementary groups and no capabilities,
   and sets no_new_privs (no setuid program or file capability can give any back).

In every mode it then forks the program (``python -E -s -u -B main.py`` in ``work_dir`` with the
spec's environment, stdin/stdout/stderr inherited from the runner), sets the child's rlimits
(CPU seconds, address space, processes of its uid, file size, no core files) just before the
exec, reaps every process until the program ends and exits with the program's status (its
exit code, or 128 + the signal that killed it). When PID 1 exits the kernel kills every other
process of the PID namespace, so nothing the program started outlives the run.

SPEC keys: ``isolate`` (bool), ``expose`` (folders the interpreter needs: where one lies
under a folder other users cannot enter, such as /root, that folder is hidden under a tmpfs
into which only these are bound), ``uid``, ``gid``, ``work_dir``, ``work_dir_mb``, ``files``
(``{name in work_dir: source path}`` copied in the isolated mode; in the other mode the runner
writes them itself), ``python``, ``argv`` (the program's arguments after the interpreter),
``env`` (its whole environment), ``limits`` (``cpu_time_s``, ``memory_bytes``,
``max_processes``, ``max_file_bytes``).
"""

import ctypes
import json
import os
import resource
import shutil
import sys

# Exit status of this script when the sandbox could not be set up (the program never ran).
SETUP_FAILED = 125

_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_PR_SET_NO_NEW_PRIVS = 38
# statvfs f_flag bits kept on a read-only remount (nosuid, nodev, noexec, sync, mandlock,
# noatime, nodiratime, relatime: their ST_* values equal the MS_* mount flags).
_KEPT_FLAGS = 2 | 4 | 8 | 16 | 64 | 1024 | 2048 | 4096


def _fail(message):
    os.write(2, f"sandbox setup failed: {message}\n".encode())
    os._exit(SETUP_FAILED)


def _mount(libc, source, target, fstype, flags, data):
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), target)


def _mount_points():
    """Mount points of this mount namespace, parents before children."""
    points = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            point = line.split()[4]
            points.append(point.encode().decode("unicode_escape"))
    return points


def _private_ancestor(path):
    """The outermost folder on the way to ``path`` that other users may not enter, or None."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


# Shared scratch folders hidden from the program (empty tmpfs in their place): what other
# processes keep there (files, unix sockets) is out of its reach.
HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/run")


def _expose(libc, paths):
    """Hide :data:`HIDDEN` and every folder closed to other users on the way to ``paths`` (the
    interpreter's install, e.g. under /root; the work folder) under empty tmpfs, then bind
    ``paths`` back into them: the sandbox uid reaches exactly those, and nothing else kept
    there (the rest of /root, the trainer's /tmp)."""
    tops = [top for top in HIDDEN if os.path.isdir(top) and not os.path.islink(top)]
    tops += [top for top in map(_private_ancestor, paths) if top is not None]

    def outermost(path):
        return min(
            (t for t in tops if path == t or path.startswith(t.rstrip("/") + "/")),
            key=len,
            default=None,
        )

    roots = sorted({outermost(top) for top in tops})
    handles = {
        path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in paths if outermost(path)
    }
    for top in roots:
        _mount(libc, "sandbox", top, "tmpfs", 0, "size=1m,mode=0755")
    for path, handle in handles.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{handle}", path, "", _MS_BIND | _MS_REC, "")
        os.close(handle)


def _isolate_filesystem(spec):
    """Interpreter reachable, every mount read-only, then a fresh tmpfs at ``work_dir``
    holding the program's files."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.umask(0o022)
    try:
        _expose(libc, spec["expose"])
    except OSError as err:
        _fail(f"cannot expose the interpreter's folders {spec['expose']} ({err})")
    for point in _mount_points():
        try:
            kept = os.statvfs(point).f_flag & _KEPT_FLAGS
            flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | kept
            _mount(libc, "none", point, "", flags, "")
        except OSError as err:
            if point == "/":
                _fail(f"cannot remount / read-only ({err})")
            # A mount hidden under another one (not reachable by path) keeps its flags; the
            # unprivileged uid still cannot write where its permissions do not allow.
    work_dir = spec["work_dir"]
    options = f"size={spec['work_dir_mb']}m,mode=0700,uid={spec['uid']},gid={spec['gid']}"
    try:
        _mount(libc, "sandbox", work_dir, "tmpfs", 0, options)
    except OSError as err:
        _fail(f"cannot mount the work folder ({err})")
    for name, source in spec["files"].items():
        target = os.path.join(work_dir, name)
        shutil.copyfile(source, target)
        os.chown(target, spec["uid"], spec["gid"])


def _drop_privileges(spec):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail(f"cannot set no_new_privs ({os.strerror(ctypes.get_errno())})")
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    if os.geteuid() == 0:
        _fail("still root after setresuid")


def _set_limits(limits):
    cpu = int(limits["cpu_time_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_program(spec):
    """Fork the program, reap every child until it ends; its exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(spec["work_dir"])
            _set_limits(spec["limits"])
            # -E -s: no PYTHON* variables, no user site; -u: unbuffered (what it printed
            # survives a kill); -B: no bytecode files
            argv = [spec["python"], "-E", "-s", "-u", "-B", *spec["argv"]]
            os.execve(spec["python"], argv, spec["env"])
        except BaseException as err:  # noqa: BLE001 - reported, then the child ends
            _fail(f"cannot start the program ({type(err).__name__}: {err})")
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return SETUP_FAILED
        if done == pid:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


def main():
    spec = json.loads(sys.argv[1])
    if spec["isolate"]:
        _isolate_filesystem(spec)
        _drop_privileges(spec)
    os._exit(_run_program(spec))


if __name__ == "__main__":
    main()
