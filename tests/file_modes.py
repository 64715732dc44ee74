"""The permission bits of what a writer created, against those the umask gives a plain
``mkdir`` / ``open`` (shared clusters read each other's checkpoints and exports)."""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """This process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def modes_against_umask(root: Path, umask: int) -> list[str]:
    """``root`` and every folder and file under it whose permission bits differ from the
    umask's (folders ``0o777 & ~umask``; files ``0o666 & ~umask``, or ``0o777 & ~umask``
    when executable), one line each; empty when all follow it."""
    wrong = []
    for path in [root, *sorted(root.rglob("*"))]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode & 0o777
        full = 0o777 if path.is_dir() or mode & 0o111 else 0o666
        if mode != full & ~umask:
            wrong.append(f"{path.relative_to(root.parent)}: {oct(mode)}, not {oct(full & ~umask)}")
    return wrong
