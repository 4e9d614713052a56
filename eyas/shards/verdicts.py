"""A shard's verdicts in the shard store, and a reader waiting for one: the records the arrival verifier
(eyas.verify.arrivals) writes after a shard passed its checks, read here by whoever may only read verified shards
(the trainer of a streamed run, eyas.shards.streamed).

    row = verified_row(store, 7, mode="full")       # its manifest row when a verdict names its bytes, else None
    shard = wait_verified(store, 7, mode="full", timeout_s=3600, log=print)   # block until 7 is verified

A verdict is one small object, `verified/shard-NNNNN.MODE.DIGEST.json` (DIGEST: the checksum of the manifest row it
was checked against); it counts only for the bytes it names, and a full verdict satisfies a reader that asks for
cheap. A waiting reader says what it waits for (not committed yet / committed, being verified / quarantined, being
extracted again) when it starts and at most every LOG_EVERY_S, and never skips a shard.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from eyas.shards.format import shard_filename
from eyas.shards.manifest import ManifestRow, committed_row
from eyas.shards.shard_set import QUARANTINE_DIR, QUARANTINE_REASON_SUFFIX
from eyas.storage import Storage, as_storage

VERDICTS_DIR = "verified"
VERDICT_NAME_RE = re.compile(rf"^{VERDICTS_DIR}/shard-(\d{{5,}})\.(cheap|full)\.([0-9a-f]+)\.json$")
COVERING_MODES = {"cheap": ("cheap", "full"), "full": ("full",)}  # the verdicts that satisfy a reader's mode
LOG_EVERY_S = 30.0


def verdict_name(shard_index: int, checksum: str, mode: str) -> str:
    """The name of the verdict that shard `shard_index`, with the bytes of `checksum`, passed `mode`'s checks."""
    return f"{VERDICTS_DIR}/shard-{shard_index:05d}.{mode}.{checksum.partition(':')[2]}.json"


def check_mode(mode: str) -> None:
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
    check_mode(mode)
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
    check_mode(mode)
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
