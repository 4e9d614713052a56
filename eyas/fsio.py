"""Durable writes: what a crash at any instant leaves is either the old file (or directory) or the new one.

A temporary is named `.{name}.tmp-{pid}` beside its destination (`TMP_MARKER` finds strays); a directory
is written into such a temporary and put in place whole by `replace_dir`.
"""

from __future__ import annotations

import json
import os
import shutil
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
    """The temporary name of `path` for this process."""
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


def replace_dir(temp: Path, final: Path) -> None:
    """Put the finished directory `temp` in place of `final` (which may exist): every file and `temp` fsynced,
    `final` renamed aside, `temp` renamed to `final`, the parent fsynced, the old one deleted. A crash leaves
    either the old directory or the new one at `final` (and strays with TMP_MARKER beside it)."""
    temp, final = Path(temp), Path(final)
    for path in temp.iterdir():
        fsync_path(path)
    fsync_path(temp)
    old = final.with_name(f".{final.name}.old{TMP_MARKER}{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    temp.rename(final)
    fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old)


def read_json_record(path: Path) -> dict | None:
    """A JSON record eyas wrote with atomic_write_text, or None when there is none. A record that does not parse
    was written by something else (writes here are atomic): the error names the file."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e}); eyas writes this file whole, so something else changed it: "
            "delete it to have the stage write it again"
        ) from e
