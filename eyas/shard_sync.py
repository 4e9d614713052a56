"""Where a run's shards are written, and the verified local copy that verification and training read.

With `extract.storage_url` empty the shards are written straight into the run's shards dir. With
`s3://bucket/prefix` they are written to S3 (which outlives the machine) and `sync_to_local`
downloads into the run's shards dir every shard whose local copy is missing or of another size,
each checked against its manifest checksum as it arrives, then writes the local manifest.
"""

from __future__ import annotations

from pathlib import Path

from eyas.checksum import checksum_bytes, short
from eyas.config import ExtractConfig
from eyas.extract import RUN_META_NAME
from eyas.manifest import read_manifest, write_manifest
from eyas.storage import ChecksumMismatchError, LocalStorage, Storage, open_storage


def shard_storage(extract_cfg: ExtractConfig, shards_dir: str | Path) -> Storage:
    """The storage extraction writes to: S3 when `storage_url` is set, else the local shards dir."""
    if extract_cfg.storage_url:
        return open_storage(extract_cfg.storage_url, endpoint_url=extract_cfg.s3_endpoint_url)
    return LocalStorage(shards_dir)


def sync_to_local(source: Storage, shards_dir: str | Path) -> dict:
    """Bring the local copy up to the source's manifest; return counts of fetched and kept shards."""
    local = LocalStorage(shards_dir)
    if source.local_path() is not None and Path(source.local_path()).resolve() == Path(shards_dir).resolve():
        return {"fetched": 0, "kept": len(read_manifest(local))}
    rows = read_manifest(source)
    local.put_bytes(RUN_META_NAME, source.get_bytes(RUN_META_NAME))
    listing = local.list()
    fetched = 0
    for row in rows:
        if listing.get(row.file) != row.num_bytes:
            local.put_bytes(row.file, _fetch(source, row))
            fetched += 1
    write_manifest(local, rows)
    return {"fetched": fetched, "kept": len(rows) - fetched}


def _fetch(source: Storage, row) -> bytes:
    data = source.get_bytes(row.file)
    found = checksum_bytes(data)
    if found != row.checksum:
        raise ChecksumMismatchError(
            f"{source.url}/{row.file}: checksum {short(found)} of the bytes read, the manifest says "
            f"{short(row.checksum)}; the stored shard is corrupt: quarantine it (drop its manifest row with "
            f"eyas.manifest.drop_manifest_rows) and extract again"
        )
    return data
