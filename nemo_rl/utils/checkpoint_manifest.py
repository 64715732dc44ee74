"""Durable checkpoint folders: fsync, a manifest of every file, and its verification.

A folder is *sealed* by :func:`seal_folder`: every file and folder under it is fsynced, then
``manifest.json`` (the last file written) records each file's size in bytes and its xxh3-64
checksum, and is fsynced with its folder. :func:`verify_folder` checks a folder against its
manifest: a missing manifest, a missing file, a size or a checksum that differs is a damaged
folder. Files not listed in the manifest are ignored (nothing reads them).

xxh3-64 is a non-cryptographic hash (it catches truncation, bit rot and torn writes, not
tampering) hashing several GB/s per core; ``benchmarks/bench_checkpoint_verify.py`` measures it
against a plain read of the same files (``docs/performance.md``).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import xxhash

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK_BYTES = 8 * 1024 * 1024
# Hashing releases the GIL, so files of a sharded checkpoint hash in parallel.
HASH_THREADS = min(8, os.cpu_count() or 1)

VerifyMode = Literal["checksums", "sizes"]


def fsync_path(path: str | Path) -> None:
    """Flush one file or folder (its entries: names created or renamed in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and folder under ``root``, ``root`` itself last (children first, so a
    folder's entries are durable after what they name)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def file_checksum(path: str | Path) -> str:
    """xxh3-64 of a file's bytes, as 16 hex digits."""
    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[str]:
    """Paths (relative to ``root``, POSIX separators) of every file under it but the manifest."""
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            rel = Path(folder, name).relative_to(root).as_posix()
            if rel != MANIFEST_FILE:
                found.append(rel)
    return sorted(found)


def _checksums(root: Path, rel_paths: list[str]) -> list[str]:
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return list(pool.map(lambda rel: file_checksum(root / rel), rel_paths))


def seal_folder(root: str | Path) -> Path:
    """fsync everything under ``root``, then write and fsync its manifest; returns the manifest.

    Call once the folder is complete and before renaming it to its final name.
    """
    root = Path(root)
    fsync_tree(root)
    rel_paths = _files(root)
    entries = {
        rel: {"size": (root / rel).stat().st_size, "xxh3_64": digest}
        for rel, digest in zip(rel_paths, _checksums(root, rel_paths))
    }
    manifest = root / MANIFEST_FILE
    tmp = manifest.with_name(MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": MANIFEST_VERSION, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, manifest)
    fsync_path(root)
    return manifest


def verify_folder(root: str | Path, mode: VerifyMode = "checksums") -> str | None:
    """Check ``root`` against its manifest.

    Args:
        root: a folder sealed by :func:`seal_folder`.
        mode: ``"sizes"`` compares file sizes only; ``"checksums"`` also re-hashes every file.

    Returns:
        None when intact, else one line naming the first problem found (the file and what is
        wrong with it).
    """
    root = Path(root)
    manifest = root / MANIFEST_FILE
    if not manifest.is_file():
        return f"no {MANIFEST_FILE} (the save did not finish)"
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({type(exc).__name__}: {exc})"
    for rel, entry in sorted(entries.items()):
        path = root / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, the manifest says {entry['size']}"
    if mode == "checksums":
        rel_paths = sorted(entries)
        for rel, digest in zip(rel_paths, _checksums(root, rel_paths)):
            if digest != entries[rel]["xxh3_64"]:
                return f"{rel} has checksum {digest}, the manifest says {entries[rel]['xxh3_64']}"
    return None
