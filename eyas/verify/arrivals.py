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
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.shards.encoding import extract_encoding
from eyas.shards.format import shard_filename
from eyas.shards.manifest import (
    ROWS_DIR,
    ManifestRow,
    add_row,
    committed_row,
    drop_row,
    read_compacted_rows,
    read_row_file_if_present,
)
from eyas.shards.shard_set import QUARANTINE_DIR, QUARANTINE_REASON_SUFFIX, set_aside_shards
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

VERDICTS_DIR = "verified"
VERDICT_NAME_RE = re.compile(rf"^{VERDICTS_DIR}/shard-(\d{{5,}})\.(cheap|full)\.([0-9a-f]+)\.json$")
COVERING_MODES = {"cheap": ("cheap", "full"), "full": ("full",)}  # the verdicts that satisfy a reader's mode
LOG_EVERY_S = 30.0


def verdict_name(shard_index: int, checksum: str, mode: str) -> str:
    """The name of the verdict that shard `shard_index`, with the bytes of `checksum`, passed `mode`'s checks."""
    return f"{VERDICTS_DIR}/shard-{shard_index:05d}.{mode}.{checksum.partition(':')[2]}.json"


def _check_mode(mode: str) -> None:
    if mode not in COVERING_MODES:
        raise ValueError(f"verify mode {mode!r}: expected 'cheap' or 'full' (verify.mode)")


def read_verdicts(where: "str | Path | Storage") -> set[str]:
    """The names of every verdict in the store (one listing); a foreign object under `verified/` is refused."""
    store = as_storage(where)
    names = set(store.list(VERDICTS_DIR + "/"))
    foreign = sorted(n for n in names if not VERDICT_NAME_RE.match(n))
    if foreign:
        raise ValueError(
            f"{store.url}: {foreign[:5]} under {VERDICTS_DIR}/ are not verdicts (expected names like "
            f"{verdict_name(0, 'xxh3-128:0123abcd', 'full')}); only eyas.verify.arrivals writes there: remove them"
        )
    return names


def verified_row(where: "str | Path | Storage", shard_index: int, *, mode: str) -> ManifestRow | None:
    """The manifest row of shard `shard_index` when a verdict of `mode` (or stronger) names its bytes; else None."""
    _check_mode(mode)
    store = as_storage(where)
    row = committed_row(store, shard_index)
    return row if row is not None and _has_verdict(store, row, mode) else None


def drop_verdicts(where: "str | Path | Storage", shard_indices: Sequence[int]) -> list[str]:
    """Delete every verdict of the given shards (one listing); return their names. An extraction that writes a
    shard again calls it first: a verdict names the checksum of a row, and a rewrite recorded with that same
    checksum must not inherit a verdict its own bytes never earned."""
    store, wanted = as_storage(where), set(shard_indices)
    names = sorted(n for n in read_verdicts(store) if int(VERDICT_NAME_RE.match(n).group(1)) in wanted)
    for name in names:
        store.delete(name)
    return names


def _has_verdict(store: Storage, row: ManifestRow, mode: str) -> bool:
    return any(store.exists(verdict_name(row.shard_index, row.checksum, m)) for m in COVERING_MODES[mode])


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
        _check_mode(mode)
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


class ShardWaitTimeout(TimeoutError):
    """A shard was not verified within the reader's timeout."""


@dataclass(frozen=True)
class VerifiedShard:
    row: ManifestRow  # the row whose bytes the verdict names
    waited_s: float


def _latest_reason(store: Storage, shard_index: int) -> str:
    """The reason of the shard's latest quarantine, or "" when it was never quarantined."""
    pattern = re.compile(
        rf"^{QUARANTINE_DIR}/{re.escape(shard_filename(shard_index))}\.(\d{{8}}T\d{{6}})(?:-(\d+))?"
        rf"{re.escape(QUARANTINE_REASON_SUFFIX)}$"
    )
    notes = [(m.group(1), int(m.group(2) or 0), n) for n in store.list(QUARANTINE_DIR + "/") if (m := pattern.match(n))]
    return store.get_bytes(max(notes)[2]).decode().splitlines()[0] if notes else ""


def _wait_state(store: Storage, shard_index: int, row: ManifestRow | None) -> tuple[str, str]:
    """(what the reader sees, what to do if it lasts) for a shard that is not verified."""
    if row is not None:
        return (
            "committed, being verified",
            "is the arrival verifier running (eyas.verify.arrivals.ArrivalVerifier follows the manifest)?",
        )
    reason = _latest_reason(store, shard_index)
    if reason:
        return (
            f"quarantined ({reason}), being extracted again",
            "is the extraction running? it writes quarantined shards again (run it again if it stopped)",
        )
    return (
        "not committed yet",
        "is the extraction running (eyas status shows its progress)? run it again to extract what is missing",
    )


def wait_verified(
    where: "str | Path | Storage",
    shard_index: int,
    *,
    mode: str,
    timeout_s: float,
    poll_s: float = 1.0,
    log: Callable[[str], None] = print,
    log_every_s: float = LOG_EVERY_S,
) -> VerifiedShard:
    """Block until shard `shard_index` has a verdict of `mode` (or stronger) for its committed bytes, polling every
    `poll_s` seconds; say what it waits for (not committed yet / being verified / quarantined, being extracted
    again) through `log` when it starts waiting and then at most every `log_every_s`. Never skips: after
    `timeout_s` it raises ShardWaitTimeout naming the shard and what it saw last."""
    _check_mode(mode)
    store = as_storage(where)
    t0, logged_at = time.monotonic(), None
    while True:
        row = committed_row(store, shard_index)
        if row is not None and _has_verdict(store, row, mode):
            return VerifiedShard(row, time.monotonic() - t0)
        waited = time.monotonic() - t0
        if waited >= timeout_s:
            seen, fix = _wait_state(store, shard_index, row)
            raise ShardWaitTimeout(
                f"shard {shard_index:05d} of {store.url}: not verified ({mode}) after {waited:.0f} s of waiting "
                f"(timeout {timeout_s:g} s); last seen: {seen}; {fix}"
            )
        if logged_at is None or waited - logged_at >= log_every_s:
            log(f"waiting for shard {shard_index:05d} ({mode} verification, {waited:.0f} s so far): "
                f"{_wait_state(store, shard_index, row)[0]}")  # fmt: skip
            logged_at = waited
        time.sleep(min(poll_s, timeout_s - waited))
