"""Verification on arrival: each shard is checked as soon as its manifest row is committed, while extraction goes
on, and its verdict is recorded in the shard store, where a reader in any process (the trainer) asks for it.

    verifier = arrival_verifier(config, facts, order=stream_order(plan, config.train).shards)
    verifier.poll()                                  # check every committed shard without a verdict; -> report rows
    verifier.follow(until=stop.is_set, poll_s=1.0)   # poll until `until()` is true
    shard = wait_verified(store, 7, mode="full", timeout_s=3600, log=print)   # a reader: block until 7 is verified

A shard gets the checks `eyas verify` runs in the configured mode (eyas.verify.checks through
eyas.verify.shard_set.verify_shard). A verdict is one small object, `verified/shard-NNNNN.MODE.DIGEST.json`
(DIGEST: the checksum of the manifest row it was checked against), written atomically through the storage
(a local directory or S3) only after every check passed: a verifier killed between a check and its verdict
checks that shard again when it restarts, and a restarted verifier lists `verified/` once and checks nothing
that has a verdict. A verdict counts only for the bytes it names: a shard written again with other bytes has
none. A full verdict satisfies a reader that asks for cheap.

A bad shard is quarantined as verification quarantines (moved into `quarantine/` beside its reason), and its
manifest row alone is removed (eyas.shards.manifest.drop_row: the rows other workers commit meanwhile are
untouched), so that the extraction coordinator finds it missing and extracts it again; a reader waits for
that, and says so.

Cost per poll: one listing of `rows/`, one read of `manifest.parquet` (the coordinator compacts only when it
starts and ends), a read of each row file new since the last poll and, on S3 when there is a shard to check,
one listing of the shards (their sizes); a shard is checked once, one at a time, in the order given (the
trainer's, eyas.train.stream_order), else by index. A reader's poll reads one row and looks up one or two
verdict names.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.shards.encoding import extract_encoding
from eyas.shards.manifest import (
    ROWS_DIR,
    ManifestRow,
    add_row,
    drop_row,
    read_compacted_rows,
    read_row_file_if_present,
)
from eyas.shards.shard_set import set_aside_shards
from eyas.shards.verdicts import COVERING_MODES, check_mode, read_verdicts, verdict_name
from eyas.storage import Storage, as_storage
from eyas.verify.checks import ExpectedShardMeta, FileBytes
from eyas.verify.report import ShardReportRow
from eyas.verify.shard_set import (
    DEFAULT_CHUNK_BYTES,
    dataset_hash_problem,
    expected_shard_meta,
    remote_opener,
    verify_context,
    verify_shard,
)


class _CommittedRows:
    """The manifest's rows as they are committed, read again and again: a row file is read once per version."""

    def __init__(self, store: Storage):
        self.store = store
        self.seen: dict[str, tuple[str, ManifestRow | None]] = {}  # row file -> (version, its row)

    def read(self) -> dict[int, ManifestRow]:
        # the listing before the compacted rows: a compaction writes manifest.parquet before it deletes the row
        # files, so a row folded in between is in the parquet read after
        listed = self.store.versions(ROWS_DIR + "/")
        rows = {r.shard_index: r for r in read_compacted_rows(self.store)}
        self.seen = {
            name: self.seen[name] if self.seen.get(name, ("",))[0] == version
            else (version, read_row_file_if_present(self.store, name))
            for name, version in listed.items()
        }  # fmt: skip
        for name, (_, row) in sorted(self.seen.items()):
            if row is not None:
                add_row(rows, row, name, self.store.url)
        return rows


class ArrivalVerifier:
    """Checks each newly committed shard of a store in `mode` and records its verdict, or quarantines it."""

    def __init__(
        self,
        where: "str | Path | Storage",
        *,
        tokenized_path: str | Path,
        expected: ExpectedShardMeta,
        mode: str,
        order: Sequence[int] = (),
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        log: Callable[[str], None] = print,
    ):
        check_mode(mode)
        self.store, self.mode, self.log = as_storage(where), mode, log
        tokenized_path = Path(tokenized_path)
        if not tokenized_path.is_file():
            raise FileNotFoundError(
                f"arrival verification of {self.store.url}: tokenized dataset {tokenized_path}: no such file; run the "
                f"dataset stage first"
            )
        problem = dataset_hash_problem(tokenized_path, expected)
        if problem:
            raise ValueError(f"arrival verification of {self.store.url}: {problem}")
        self.ctx = verify_context(tokenized_path, expected, mode, chunk_bytes)
        self.rank = {shard: k for k, shard in enumerate(order)}
        self.verdicts = read_verdicts(self.store)
        self.rows = _CommittedRows(self.store)
        self.verified: set[int] = set()  # the shards whose current row had a verdict at the end of the last poll

    def _covered(self, row: ManifestRow) -> bool:
        return any(verdict_name(row.shard_index, row.checksum, m) in self.verdicts for m in COVERING_MODES[self.mode])

    def poll(self) -> list[ShardReportRow]:
        """Check every committed shard that has no verdict yet (in `order`, then by index); one row per shard."""
        rows = self.rows.read()
        todo = sorted(
            (r for r in rows.values() if not self._covered(r)),
            key=lambda r: (self.rank.get(r.shard_index, len(self.rank)), r.shard_index),
        )
        results = []
        if todo:
            with tempfile.TemporaryDirectory(prefix="eyas-arrivals-") as spool:
                root = self.store.local_path()
                listing = {} if root is not None else self.store.list()
                for row in todo:
                    opener = (
                        partial(FileBytes, str(root / row.file))
                        if root is not None
                        else remote_opener(self.store, row.file, listing, self.mode, spool)
                    )
                    results.append(self._check(row, opener))
        self.verified = {k for k, r in rows.items() if self._covered(r)}
        return results

    def _check(self, row: ManifestRow, opener) -> ShardReportRow:
        result = verify_shard(row=row, ctx=self.ctx, mode=self.mode, name=row.file, opener=opener)
        k = row.shard_index
        if result.status == "ok":
            name = verdict_name(k, row.checksum, self.mode)
            record = {**asdict(row), "mode": self.mode, "checks_passed": result.checks_passed,
                      "seconds": round(result.seconds, 6), "verified_at": time.time()}  # fmt: skip
            self.store.put_bytes(name, json.dumps(record, sort_keys=True).encode())
            self.verdicts.add(name)
            self.log(f"shard {k:05d} verified on arrival ({self.mode}, {result.seconds:.2f} s)")
        else:
            set_aside_shards(self.store, {row.file: result.reason})
            drop_row(self.store, row)
            self.log(f"shard {k:05d} quarantined on arrival: {result.reason}; its row is removed, so the extraction "
                     f"writes it again")  # fmt: skip
        return result

    def follow(self, *, until: Callable[[], bool], poll_s: float = 1.0) -> None:
        """Poll every `poll_s` seconds until `until()` is true after a poll."""
        while True:
            self.poll()
            if until():
                return
            time.sleep(poll_s)


def arrival_verifier(
    config: RunConfig,
    facts: RunFacts,
    *,
    order: Sequence[int] = (),
    log: Callable[[str], None] = print,
    store: Storage | None = None,
) -> ArrivalVerifier:
    """The verifier of a run's shard store (where extraction commits them; `store` overrides the run's storage),
    in the run's verify mode."""
    return ArrivalVerifier(
        facts.storage() if store is None else store,
        tokenized_path=facts.tokenized_path,
        expected=expected_shard_meta(facts, extract_encoding(config.extract)),
        mode=config.verify.mode,
        order=order,
        chunk_bytes=config.verify.chunk_bytes,
        log=log,
    )
