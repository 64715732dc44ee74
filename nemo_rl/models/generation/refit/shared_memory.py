"""Host shared-memory buffers for colocated refit on CPU: files in ``/dev/shm`` mapped as tensors.

The writer creates a buffer (a tmpfs file mapped with ``torch.from_file(shared=True)``) in the
node's shared-memory directory (:func:`shm_dir`: ``$NEMO_RL_SHM_DIR``, default ``/dev/shm``)
and passes its :class:`SharedMemoryHandle` (path and size, picklable) through Ray; a reader on
the same node maps the same file. Pages are shared, so a byte the sender writes is the byte the
receiver reads, with no copy in between. The mapping lives as long as the tensor: dropping the
last reference unmaps it.

Cleanup: the creator unlinks the file in :meth:`SharedMemoryBuffer.close` (receivers keep
reading through their mapping until they drop it). File names carry the creator's pid and pid
namespace, so a buffer left by a process that died before closing (killed) is removed by the
next :func:`remove_stale_segments` of that namespace (called whenever a buffer is created).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "nemo_rl_refit"
# Names the node's shared-memory directory; a test cluster of several Ray nodes on one host
# gives each node its own, so that, as on a real cluster, no node sees another's buffers.
SHM_DIR_ENV = "NEMO_RL_SHM_DIR"


def shm_dir() -> Path:
    """This node's shared-memory directory: ``$NEMO_RL_SHM_DIR``, else ``/dev/shm``."""
    return Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm")


@dataclass(frozen=True)
class SharedMemoryHandle:
    """Where a receiver finds a :class:`SharedMemoryBuffer`: tmpfs ``path``, ``nbytes``."""

    path: str
    nbytes: int


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) is running; a zombie counts as dead."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill()


def _pid_namespace() -> str:
    """This process's pid-namespace id (pids are only comparable within one namespace)."""
    try:
        return "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit())
    except OSError:
        return "0"


def remove_stale_segments(directory: Path | None = None) -> list[str]:
    """Unlink refit buffers of this pid namespace whose creating process no longer exists, in
    ``directory`` (default: :func:`shm_dir`); returns their names."""
    directory = shm_dir() if directory is None else directory
    removed = []
    for path in sorted(directory.glob(f"{PREFIX}_{_pid_namespace()}_*")):
        pid = path.name.split("_")[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


class SharedMemoryBuffer:
    """A uint8 tensor ``[nbytes]`` backed by a ``/dev/shm`` file.

    Use :meth:`create` (owner) or :meth:`attach` (receiver), not the constructor.
    """

    def __init__(self, path: Path, nbytes: int, owner: bool) -> None:
        self.path = path
        self.nbytes = nbytes
        self.owner = owner
        self.tensor: torch.Tensor | None = torch.from_file(
            str(path), shared=True, size=nbytes, dtype=torch.uint8
        )

    @classmethod
    def create(cls, nbytes: int, directory: Path | None = None) -> SharedMemoryBuffer:
        """A new zero-filled buffer of ``nbytes`` in ``directory`` (default: :func:`shm_dir`),
        owned (and unlinked at close) by this process.

        Raises:
            RuntimeError: ``directory`` is not there (no ``/dev/shm`` on this machine).
        """
        directory = shm_dir() if directory is None else directory
        if nbytes <= 0:
            raise ValueError(f"a shared-memory buffer needs nbytes > 0, got {nbytes}")
        if not directory.is_dir():
            raise RuntimeError(
                f"{directory} does not exist: a CPU refit stages its buckets in a tmpfs "
                f"shared-memory directory (${SHM_DIR_ENV}, default /dev/shm); create it or "
                f"point {SHM_DIR_ENV} at one"
            )
        remove_stale_segments(directory)
        path = directory / f"{PREFIX}_{_pid_namespace()}_{os.getpid()}_{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            return cls(path, nbytes, owner=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, handle: SharedMemoryHandle) -> SharedMemoryBuffer:
        """Map the buffer another process created.

        Raises:
            RuntimeError: the file is gone (its creator closed it or died) or has another size.
        """
        path = Path(handle.path)
        try:
            size = path.stat().st_size
        except FileNotFoundError as err:
            raise RuntimeError(
                f"shared-memory buffer {path} is gone: the sender closed it or died"
            ) from err
        if size != handle.nbytes:
            raise RuntimeError(f"{path} holds {size} bytes, the handle says {handle.nbytes}")
        return cls(path, handle.nbytes, owner=False)

    @property
    def handle(self) -> SharedMemoryHandle:
        return SharedMemoryHandle(str(self.path), self.nbytes)

    def close(self) -> None:
        """Drop this process's mapping; the owner also unlinks the file. Idempotent."""
        self.tensor = None
        if self.owner:
            self.path.unlink(missing_ok=True)
