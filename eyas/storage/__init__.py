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

from pathlib import Path

from eyas.storage.base import ChecksumMismatchError, Storage, check_checksum
from eyas.storage.local import LocalStorage

__all__ = ["ChecksumMismatchError", "LocalStorage", "Storage", "as_storage", "check_checksum", "open_storage"]


def open_storage(url: str | Path, *, endpoint_url: str = "", **s3_options) -> Storage:
    """A LocalStorage for a path, an S3Storage for s3://bucket/prefix (eyas.storage.s3, which imports boto3)."""
    text = str(url)
    if text.startswith("s3://"):
        from eyas.storage.s3 import S3Storage

        return S3Storage(text, endpoint_url=endpoint_url, **s3_options)
    if "://" in text:
        raise ValueError(f"storage {text!r}: expected a local directory or s3://bucket/prefix")
    return LocalStorage(text)


def as_storage(where: "str | Path | Storage") -> Storage:
    """A storage as it is, or a LocalStorage for a directory path."""
    return where if hasattr(where, "put_bytes") else LocalStorage(where)
