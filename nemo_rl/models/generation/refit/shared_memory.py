"""Host shared-memory buffers for colocated refit on CPU: files in ``/dev/shm`` mapped as tensors.

The sender creates a buffer (a tmpfs file mapped with ``torch.from_file(shared=True)``) and
passes its :class:`SharedMemoryHandle` (path and size, picklable) through Ray; a receiver on the
same node maps the same file. Pages are shared, so a byte the sender writes is the byte the
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

SHM_DIR = Path("/dev/shm")
PREFIX = "nemo_rl_refit"


@dataclass(frozen=True)
class SharedMemoryHandle:
    """Where a receiver finds a :class:`SharedMemoryBuffer`: tmpfs ``path``, ``nbytes``."""

    path: str
    nbytes: int


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_namespace() -> str:
    """This process's pid-namespace id (pids are only comparable within one namespace)."""
    try:
        return "".join(c for c in os.readlink("/proc/self/ns/pid") if c.isdigit())
    except OSError:
        return "0"


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink refit buffers of this pid namespace whose creating process no longer exists;
    returns their names."""
    removed = []
    for path in sorted(directory.glob(f"{PREFIX}_{_pid_namespace()}_*")):
        pid = path.name.split("_")[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
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
    def create(cls, nbytes: int, directory: Path = SHM_DIR) -> SharedMemoryBuffer:
        """A new zero-filled buffer of ``nbytes`` owned (and unlinked at close) by this process.

        Raises:
            RuntimeError: ``directory`` is not there (no ``/dev/shm`` on this machine).
        """
        if nbytes <= 0:
            raise ValueError(f"a shared-memory buffer needs nbytes > 0, got {nbytes}")
        if not directory.is_dir():
            raise RuntimeError(
                f"{directory} does not exist: colocated CPU refit needs a tmpfs shared-memory "
                "directory; use the collective refit (colocated=False) instead"
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
