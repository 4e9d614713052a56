"""The manifest of a shard set: one row per finished shard, the only record of what is done.

A row (shard index, file, sample range, token count, bytes, checksum) lives either in
`manifest.parquet` (compacted) or, just after its shard was written, in `rows/shard-NNNNN.json`.
Each worker writes only the row files of its own shards, each atomically after its shard is
durable, so concurrent workers never write the same object. `compact_manifest` (run by the one
coordinator of an extraction) folds the row files into `manifest.parquet`, written atomically,
then deletes them; a crash in between leaves the same row twice, which reads as one.
Every function takes a local directory or an `eyas.storage` object.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from eyas.fsio import atomic_write_bytes, fsync_path
from eyas.storage import Storage, as_storage

MANIFEST_NAME = "manifest.parquet"
ROWS_DIR = "rows"
QUARANTINE_DIR = "quarantine"
MANIFEST_SCHEMA = pa.schema(
    [
        ("shard_index", pa.int64()),
        ("file", pa.string()),
        ("sample_start", pa.int64()),
        ("sample_end", pa.int64()),
        ("num_tokens", pa.int64()),
        ("num_bytes", pa.int64()),
        ("checksum", pa.string()),
    ]
)


@dataclass(frozen=True)
class ManifestRow:
    shard_index: int
    file: str
    sample_start: int
    sample_end: int
    num_tokens: int
    num_bytes: int
    checksum: str  # eyas.checksum (xxh3-128:...)


def row_name(shard_index: int) -> str:
    return f"{ROWS_DIR}/shard-{shard_index:05d}.json"


def _read_compacted(store: Storage) -> list[ManifestRow]:
    if not store.exists(MANIFEST_NAME):
        return []
    table = pq.read_table(io.BytesIO(store.get_bytes(MANIFEST_NAME)))
    if table.schema.names != MANIFEST_SCHEMA.names:
        raise ValueError(
            f"{store.url}/{MANIFEST_NAME}: columns {table.schema.names}, expected {MANIFEST_SCHEMA.names}; "
            f"the manifest is not eyas's: move the shards directory aside and re-extract"
        )
    columns = table.to_pydict()
    rows = [ManifestRow(*values) for values in zip(*(columns[n] for n in MANIFEST_SCHEMA.names))]
    indices = [r.shard_index for r in rows]
    if len(set(indices)) != len(indices):
        dupes = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(
            f"{store.url}/{MANIFEST_NAME}: shard indices {dupes} appear more than once; expected one row per shard"
        )
    return rows


def _read_row_file(store: Storage, name: str) -> ManifestRow:
    try:
        return ManifestRow(**json.loads(store.get_bytes(name)))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(
            f"{store.url}/{name}: not a manifest row ({e}); it was not written by eyas.manifest: delete it, "
            f"and the shard it names is extracted again"
        ) from e


def read_manifest(where: "str | Path | Storage") -> list[ManifestRow]:
    """Every row (compacted and not yet compacted), sorted by shard index; empty when there is none."""
    store = as_storage(where)
    rows = {r.shard_index: r for r in _read_compacted(store)}
    for name in sorted(store.list(ROWS_DIR + "/")):
        row = _read_row_file(store, name)
        if row.shard_index in rows and rows[row.shard_index] != row:
            raise ValueError(
                f"{store.url}: shard {row.shard_index:05d} has two different manifest rows ({MANIFEST_NAME}: "
                f"{rows[row.shard_index]}; {name}: {row}); two extractions wrote it: verify the shard set, "
                f"which quarantines what does not match"
            )
        rows[row.shard_index] = row
    return [rows[i] for i in sorted(rows)]


def done_shard_indices(where: "str | Path | Storage") -> set[int]:
    """Indices that have a row, from the compacted manifest and the row files' names (no row file is read)."""
    store = as_storage(where)
    done = {r.shard_index for r in _read_compacted(store)}
    for name in store.list(ROWS_DIR + "/"):
        stem = name.rsplit("/", 1)[-1].removeprefix("shard-").removesuffix(".json")
        if stem.isdigit():
            done.add(int(stem))
    return done


def record_row(where: "str | Path | Storage", row: ManifestRow) -> None:
    """Write one finished shard's row file (atomically); call only after the shard itself is durable."""
    as_storage(where).put_bytes(row_name(row.shard_index), json.dumps(asdict(row), sort_keys=True).encode())


def write_manifest(where: "str | Path | Storage", rows: Sequence[ManifestRow]) -> None:
    """Make the manifest exactly `rows`: `manifest.parquet` replaced atomically, then the row files removed."""
    store = as_storage(where)
    table = pa.Table.from_pylist([asdict(r) for r in sorted(rows, key=lambda r: r.shard_index)], schema=MANIFEST_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.put_bytes(MANIFEST_NAME, sink.getvalue().to_pybytes())
    for name in store.list(ROWS_DIR + "/"):
        store.delete(name)


def compact_manifest(where: "str | Path | Storage") -> list[ManifestRow]:
    """Fold the row files into `manifest.parquet`; return every row."""
    store = as_storage(where)
    rows = read_manifest(store)
    if store.list(ROWS_DIR + "/"):
        write_manifest(store, rows)
    return rows


def append_manifest_row(where: "str | Path | Storage", row: ManifestRow) -> None:
    """Add one row to the compacted manifest (single writer); a shard that has a row is refused."""
    rows = read_manifest(where)
    if any(r.shard_index == row.shard_index for r in rows):
        raise ValueError(
            f"{as_storage(where).url}/{MANIFEST_NAME}: shard {row.shard_index:05d} already has a row; "
            f"quarantine it (eyas.manifest.quarantine_shards) before re-extracting"
        )
    write_manifest(where, [*rows, row])


def drop_manifest_rows(where: "str | Path | Storage", files: Sequence[str]) -> None:
    """Remove the rows of these shard files, so that the next extraction writes them again."""
    rows = read_manifest(where)
    kept = [r for r in rows if r.file not in set(files)]
    if len(kept) != len(rows) or as_storage(where).list(ROWS_DIR + "/"):
        write_manifest(where, kept)


def quarantine_shards(shards_dir: Path, reasons: Mapping[str, str]) -> list[Path]:
    """Move each named shard file (a key of `reasons`) of a local directory into `quarantine/` as
    `NAME.STAMP`, beside `NAME.STAMP.reason.txt` holding its reason, and drop its manifest row, so that
    the next extraction re-extracts it. A file already gone still gets its reason file. Returns the
    reason files."""
    shards_dir = Path(shards_dir)
    qdir = shards_dir / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    written = []
    for name, reason in sorted(reasons.items()):
        if not reason:
            raise ValueError(f"quarantine {shards_dir / name}: empty reason; say why the shard is set aside")
        dst, k = qdir / f"{name}.{stamp}", 1
        while dst.exists() or dst.with_name(dst.name + ".reason.txt").exists():
            dst, k = qdir / f"{name}.{stamp}-{k}", k + 1
        src = shards_dir / name
        found = src.exists()
        if found:
            os.replace(src, dst)
        note = dst.with_name(dst.name + ".reason.txt")
        atomic_write_bytes(note, (reason + "\n" + ("" if found else "(the file was already missing)\n")).encode())
        written.append(note)
    fsync_path(qdir)
    fsync_path(shards_dir)
    drop_manifest_rows(shards_dir, list(reasons))
    return written
