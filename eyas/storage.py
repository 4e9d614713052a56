"""Where shards live: a local directory or S3 (any S3 API: AWS, MinIO, a local server), one interface.

    store = open_storage("runs/demo/shards")                  # or "s3://bucket/prefix", endpoint_url=...
    store.put_bytes("shard-00000.safetensors", data)          # atomic, checksum verified by the receiver
    data = store.get_bytes("shard-00000.safetensors", checksum=row.checksum)   # verified on read
    store.list()                                              # {name: size}

Guarantees of both: an object is either absent or complete (local: temporary -> fsync -> rename;
S3: one PUT, or a multipart upload that becomes visible only when completed); a write records the
object's checksum (eyas.checksum, XXH3-128; on S3 in the object's metadata) and a read that does
not match it is retried, then refused.
`remove_partial()` deletes what interrupted writes left (local temporaries, S3 unfinished uploads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from eyas.checksum import checksum_bytes, short
from eyas.fsio import TMP_MARKER, atomic_write_bytes


class ChecksumMismatchError(OSError):
    """Bytes read back do not have the checksum they were written with."""


class Storage(Protocol):
    url: str

    def put_bytes(self, name: str, data: bytes) -> str:
        """Write `name` atomically; return its checksum (eyas.checksum)."""

    def get_bytes(self, name: str, *, checksum: str | None = None) -> bytes:
        """Read `name` whole, checked against `checksum` (or, on S3, the one recorded at write)."""

    def list(self, prefix: str = "") -> dict[str, int]:
        """{name: size} of the complete objects directly under `prefix` ("" or "dir/"; not recursive)."""

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...

    def remove_partial(self) -> list[str]:
        """Delete leftovers of interrupted writes; return their names."""

    def local_path(self) -> Path | None:
        """The directory, when the storage is a local one (readers may then mmap files in place)."""


def check_checksum(data: bytes, expected: str, *, source: str) -> None:
    found = checksum_bytes(data)
    if found != expected:
        raise ChecksumMismatchError(
            f"{source}: checksum {short(found)} of {len(data)} bytes read, expected {short(expected)}; the object "
            f"is corrupt or was replaced; verification quarantines it and extraction rewrites it"
        )


class LocalStorage:
    """A directory; names may contain '/' (subdirectories are created on write)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in Path(name).parts:
            raise ValueError(f"storage {self.url}: object name {name!r} must be relative and stay inside the root")
        return self.root / name

    def put_bytes(self, name: str, data: bytes) -> str:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        return checksum_bytes(data)

    def get_bytes(self, name: str, *, checksum: str | None = None) -> bytes:
        data = self._path(name).read_bytes()
        if checksum is not None:
            check_checksum(data, checksum, source=str(self._path(name)))
        return data

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return {}
        out = {}
        with os.scandir(base) as entries:
            for e in entries:
                if e.is_file() and TMP_MARKER not in e.name:
                    out[f"{prefix.rstrip('/')}/{e.name}" if prefix else e.name] = e.stat().st_size
        return out

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def remove_partial(self) -> list[str]:
        strays = []
        for p in sorted(self.root.rglob(f".*{TMP_MARKER}*")):
            if p.is_file():
                p.unlink()
                strays.append(str(p.relative_to(self.root)))
        return strays

    def local_path(self) -> Path | None:
        return self.root


def open_storage(url: str | Path, *, endpoint_url: str = "", **s3_options) -> Storage:
    """A LocalStorage for a path, an S3Storage for s3://bucket/prefix."""
    text = str(url)
    if text.startswith("s3://"):
        from eyas.storage_s3 import S3Storage

        return S3Storage(text, endpoint_url=endpoint_url, **s3_options)
    if "://" in text:
        raise ValueError(f"storage {text!r}: expected a local directory or s3://bucket/prefix")
    return LocalStorage(text)


def as_storage(where: "str | Path | Storage") -> Storage:
    return where if hasattr(where, "put_bytes") else LocalStorage(where)
