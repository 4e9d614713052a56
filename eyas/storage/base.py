"""The storage interface (eyas.storage): what every backend guarantees, and the checksum check of a read."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from eyas.checksum import checksum_bytes, short


class ChecksumMismatchError(OSError):
    """Bytes read back do not have the checksum they were written with."""


class Storage(Protocol):
    """A flat namespace of objects ('/' in names allowed), each either absent or complete."""

    url: str

    def put_bytes(self, name: str, data: bytes) -> str:
        """Write `name` atomically; return its checksum (eyas.checksum)."""

    def get_bytes(self, name: str, *, checksum: str | None = None) -> bytes:
        """Read `name` whole, checked against `checksum` (or, on S3, the one recorded at write)."""

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes start..end (exclusive) of `name`, unchecked (verification checks what it reads)."""

    def download_to(self, name: str, path: str | Path, *, checksum: str | None = None) -> None:
        """Write `name` whole into the local file `path`, streamed (temporary -> fsync -> rename: nothing at `path`
        on failure); checked against `checksum` when one is given (retried, then refused), else unchecked."""

    def list(self, prefix: str = "") -> dict[str, int]:
        """{name: size} of the complete objects directly under `prefix` ("" or "dir/"; not recursive)."""

    def versions(self, prefix: str = "") -> dict[str, str]:
        """{name: version} of the objects `list` returns; a version changes whenever the object is written
        again (local: size, mtime and ctime; S3: size, ETag and LastModified)."""

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...

    def move(self, name: str, to: str) -> None:
        """Give object `name` the name `to` (local: one rename; S3: a server-side copy, then the delete)."""

    def remove_partial(self) -> list[str]:
        """Delete leftovers of interrupted writes; return their names."""

    def local_path(self) -> Path | None:
        """The directory, when the storage is a local one (readers may then mmap files in place)."""


def check_checksum(data: bytes, expected: str, *, source: str) -> None:
    """Raise ChecksumMismatchError naming `source` unless `data` has the checksum `expected` (eyas.checksum)."""
    found = checksum_bytes(data)
    if found != expected:
        raise ChecksumMismatchError(
            f"{source}: checksum {short(found)} of {len(data)} bytes read, expected {short(expected)}; the object "
            f"is corrupt or was replaced; verification quarantines it and extraction rewrites it"
        )
