"""Folders the converter (and the tiny-model cache) write, with the modes the user's umask
gives: on a shared cluster others read the checkpoints and exports a user writes.

A converted checkpoint is written into a fresh folder next to its destination and renamed into
place when complete; :func:`tempfile.mkdtemp` would make that folder 0700 whatever the umask,
so :func:`make_unique_dir` makes it with a plain ``mkdir``.
"""

from __future__ import annotations

import secrets
from pathlib import Path


def make_unique_dir(parent: Path, prefix: str) -> Path:
    """A new, empty folder ``parent/<prefix><8 hex digits>`` (``parent`` created if missing),
    its mode ``0o777`` minus the umask."""
    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
