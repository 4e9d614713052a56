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

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from eyas.storage import as_storage
from eyas.storage.base import Storage

MANIFEST_NAME = "manifest.parquet"
ROWS_DIR = "rows"
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


def read_compacted_rows(store: Storage) -> list[ManifestRow]:
    """The rows of `manifest.parquet` alone (no row file); empty when there is none."""
    if not store.exists(MANIFEST_NAME):
        return []
    # An Arrow buffer, not a Python file object: pyarrow's scan may drop its last reference to the source on
    # one of its own threads after read_table returns; a Python object (io.BytesIO) then needs the GIL there,
    # and at interpreter exit that aborts the process ("terminate called without an active exception").
    table = pq.read_table(pa.BufferReader(store.get_bytes(MANIFEST_NAME)), use_threads=False)
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


def read_row_file(store: Storage, name: str) -> ManifestRow:
    """The row in one row file (`row_name`)."""
    try:
        return ManifestRow(**json.loads(store.get_bytes(name)))
    except (json.JSONDecodeError, TypeError) as e:
        raise ValueError(
            f"{store.url}/{name}: not a manifest row ({e}); it was not written by eyas.shards.manifest: delete it, "
            f"and the shard it names is extracted again"
        ) from e


def read_manifest(where: "str | Path | Storage") -> list[ManifestRow]:
    """Every row (compacted and not yet compacted), sorted by shard index; empty when there is none."""
    store = as_storage(where)
    rows = {r.shard_index: r for r in read_compacted_rows(store)}
    for name in sorted(store.list(ROWS_DIR + "/")):
        add_row(rows, read_row_file(store, name), name, store.url)
    return [rows[i] for i in sorted(rows)]


def add_row(rows: dict[int, ManifestRow], row: ManifestRow, name: str, url: str) -> None:
    """Add a row file's row to the rows read so far (by shard index); a different row for the same shard is an
    error naming both."""
    if row.shard_index in rows and rows[row.shard_index] != row:
        raise ValueError(
            f"{url}: shard {row.shard_index:05d} has two different manifest rows ({MANIFEST_NAME}: "
            f"{rows[row.shard_index]}; {name}: {row}); two extractions wrote it: verify the shard set, "
            f"which quarantines what does not match"
        )
    rows[row.shard_index] = row


def done_shard_indices(where: "str | Path | Storage") -> set[int]:
    """Indices that have a row, from the compacted manifest and the row files' names (no row file is read)."""
    store = as_storage(where)
    done = {r.shard_index for r in read_compacted_rows(store)}
    for name in store.list(ROWS_DIR + "/"):
        stem = name.rsplit("/", 1)[-1].removeprefix("shard-").removesuffix(".json")
        if stem.isdigit():
            done.add(int(stem))
    return done


def record_row(where: "str | Path | Storage", row: ManifestRow) -> None:
    """Write one finished shard's row file (atomically); call only after the shard itself is durable."""
    as_storage(where).put_bytes(row_name(row.shard_index), json.dumps(asdict(row), sort_keys=True).encode())


def _write_compacted(store: Storage, rows: Sequence[ManifestRow]) -> None:
    table = pa.Table.from_pylist([asdict(r) for r in sorted(rows, key=lambda r: r.shard_index)], schema=MANIFEST_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    store.put_bytes(MANIFEST_NAME, sink.getvalue().to_pybytes())


def write_manifest(where: "str | Path | Storage", rows: Sequence[ManifestRow]) -> None:
    """Make the manifest exactly `rows`: `manifest.parquet` replaced atomically, then the row files removed."""
    store = as_storage(where)
    _write_compacted(store, rows)
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
            f"quarantine it (eyas.shards.shard_set.quarantine_shards) before re-extracting"
        )
    write_manifest(where, [*rows, row])


def drop_manifest_rows(where: "str | Path | Storage", files: Sequence[str]) -> None:
    """Remove the rows of these shard files, so that the next extraction writes them again."""
    rows = read_manifest(where)
    kept = [r for r in rows if r.file not in set(files)]
    if len(kept) != len(rows) or as_storage(where).list(ROWS_DIR + "/"):
        write_manifest(where, kept)


def committed_row(where: "str | Path | Storage", shard_index: int) -> ManifestRow | None:
    """The manifest row of one shard (its row file, else `manifest.parquet`), or None when it has none yet."""
    store = as_storage(where)
    row = read_row_file_if_present(store, row_name(shard_index))
    return row or next((r for r in read_compacted_rows(store) if r.shard_index == shard_index), None)


def read_row_file_if_present(store: Storage, name: str) -> ManifestRow | None:
    """The row in a row file, or None when there is no such file, also when it goes away while it is read (a
    compaction folds it into manifest.parquet, or a quarantine drops it): reads that race them see no row."""
    if not store.exists(name):
        return None
    try:
        return read_row_file(store, name)
    except Exception:
        if store.exists(name):
            raise
        return None


def drop_row(where: "str | Path | Storage", row: ManifestRow) -> None:
    """Remove this one row while workers commit others: its row file is deleted (no other row file is touched,
    none is folded), and `manifest.parquet`, when it holds the row, is written again without it. A row that was
    written again since (other bytes) stays. The coordinator rewrites `manifest.parquet` only when it starts
    and when it ends; a drop of a compacted row at that very moment can be undone by it, and the row then
    names a file that is gone, which verification finds again."""
    store = as_storage(where)
    name = row_name(row.shard_index)
    if committed_row(store, row.shard_index) == row and store.exists(name):
        store.delete(name)
    compacted = read_compacted_rows(store)
    if row in compacted:
        _write_compacted(store, [r for r in compacted if r != row])


def coverage_problems(rows: Sequence[ManifestRow], num_samples: int, *, where: str) -> list[str]:
    """Samples in no shard, and shards overlapping the previous one (rows in shard order); [] when every
    sample 0..num_samples-1 is in exactly one shard."""
    problems, pos = [], 0
    for r in rows:
        if r.sample_start > pos:
            problems.append(
                f"{where}: samples {pos}..{r.sample_start - 1} are in no shard of the manifest; "
                f"re-run extraction to fill them"
            )
        elif r.sample_start < pos:
            problems.append(
                f"{where}: {r.file} starts at sample {r.sample_start}, overlapping the previous "
                f"shard (which ends at {pos - 1}); move the directory aside and extract again"
            )
        pos = max(pos, r.sample_end)
    if pos < num_samples:
        problems.append(
            f"{where}: samples {pos}..{num_samples - 1} (of {num_samples}) are in no shard of the "
            f"manifest; re-run extraction to fill them"
        )
    return problems
