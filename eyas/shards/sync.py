"""The verified local copy of a shard set written elsewhere (S3), which verification and training read.

With `extract.storage_url` empty the shards are written straight into the run's shards dir. With
`s3://bucket/prefix` they are written to S3 (which outlives the machine) and `sync_to_local`
downloads into the run's shards dir every shard whose local copy is missing or of another size,
each checked against its manifest checksum as it arrives (eyas.storage retries a damaged read, then
refuses it), then writes the local manifest. With `train.cache_bytes` > 0 no copy is made
(eyas.facts.shard_source): verification reads S3 and training reads it through the shard cache.
"""

from __future__ import annotations

from pathlib import Path

from eyas.shards.manifest import read_manifest, write_manifest
from eyas.shards.shard_set import RUN_META_NAME
from eyas.storage import LocalStorage, Storage


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
            local.put_bytes(row.file, source.get_bytes(row.file, checksum=row.checksum))
            fetched += 1
    write_manifest(local, rows)
    return {"fetched": fetched, "kept": len(rows) - fetched}
