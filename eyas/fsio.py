"""Durable file writes: what a crash at any instant leaves is either the old file or the new one.

A temporary is named `.{name}.tmp-{pid}` beside its destination (`TMP_MARKER` finds strays).
"""

from __future__ import annotations

import os
from pathlib import Path

TMP_MARKER = ".tmp-"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARKER}{os.getpid()}")


def commit_temp(tmp: Path, path: Path) -> None:
    """fsync a finished temporary, rename it over `path`, fsync the directory."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
    commit_temp(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
