"""A bounded local cache of the shards one trainer rank reads, fetched from storage ahead of its order.

    cache = ShardCache(store, rows, "out/shard-cache/rank-0", cache_bytes=2 << 30)
    cache.plan(shard_of_each_sample_in_read_order)       # the rank's schedule (eyas.train.data.rank_schedule)
    with cache.opened(shard) as path:                    # blocks until the shard is on disk; pinned meanwhile
        ...read it...

A background thread keeps on disk the shards the rank will read soonest: the longest run of distinct
shards, in order of next use from the rank's position in its schedule (the shards a reader is waiting
for first), whose sizes fit in `cache_bytes`. It fetches the first of them that is missing, evicting
first what lies outside that run and is not being read (the shard needed latest goes first: Belady's
rule, right for any order; a shard-local order, train.shuffle_window_shards, is what makes it cheap).
A fetch streams the shard to disk (`Storage.download_to`; from S3 by ranged GETs, `num_fetch_streams` at
once, each tied to the object's ETag, so one rank's fetch rate is bounded by the link rather than by one
stream: eyas.storage.s3_fetch), checked against the manifest checksum as it lands (the storage retries a
damaged read, then refuses it); a shard that cannot be fetched fails the reader's next wait, named, and leaves
no file behind. Files on disk plus the one being fetched never exceed `cache_bytes` (room is made before a
fetch starts). A shard read off the schedule (the reader's metadata check) is fetched on demand, first.

Streaming (`resolve` given): a row without a checksum is a planned shard not verified yet; the thread fetches
ahead only up to the first of them in the schedule, asks `resolve` (no wait: the committed row once a verdict
names its bytes, else None) every POLL_S seconds meanwhile, and `resolved` hands it the row a reader waited for.
With a WaitRecord, a reader's wait for a fetch leaves a note while it lasts (eyas.shards.wait_record).

Crash safety: shards land by temporary -> fsync -> rename (eyas.fsio, inside download_to). A new cache over an
existing directory keeps each file whose size and checksum are its manifest row's and deletes anything else
(temporaries of an interrupted fetch, stale shards), so a run killed with SIGKILL resumes with what it
had, or with nothing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from eyas.checksum import checksum_file
from eyas.shards.manifest import ManifestRow
from eyas.shards.wait_record import WaitRecord
from eyas.storage import Storage

POLL_S = 1.0  # streaming: how often the thread asks whether the next shard it wants is verified
WAIT_LOG_S = 30.0  # a reader waiting longer than this for a shard says so, at most this often


class ShardFetchError(OSError):
    """A shard could not be fetched into the cache (storage refused it, or the checksum never matched)."""


@dataclass
class CacheStats:
    fetched: int = 0  # shards fetched since the cache opened
    fetched_bytes: int = 0
    evicted: int = 0
    kept_at_start: int = 0  # shards found on disk, whole, when the cache opened
    removed_at_start: int = 0  # files found on disk and deleted (temporaries, stale or damaged shards)
    wait_s: float = 0.0  # time readers spent waiting for a shard
    max_bytes_on_disk: int = 0


class ShardCache:
    def __init__(
        self,
        source: Storage,
        rows: Sequence[ManifestRow],
        cache_dir: str | Path,
        cache_bytes: int,
        *,
        log=print,
        resolve: Callable[[int], ManifestRow | None] | None = None,
        wait_record: WaitRecord | None = None,
    ):
        self.source, self.rows, self.cache_bytes = source, list(rows), cache_bytes
        self.dir, self.log, self.resolve, self.wait_record = Path(cache_dir), log, resolve, wait_record
        self._check_fits(self.rows)
        self._pending: int | None = None  # streaming: the first wanted shard not verified yet
        self.stats = CacheStats()
        self._cond = threading.Condition()
        self._schedule: list[int] = []
        self._pos = 0
        self._resident: dict[int, int] = {}  # shard -> bytes on disk
        self._reserved = 0  # bytes of the fetch in flight
        self._pins: Counter = Counter()
        self._waiting: list[int] = []  # shards readers wait for, oldest first
        self._error: dict[int, BaseException] = {}
        self._closed = False
        self._by_file = {r.file: i for i, r in enumerate(self.rows)}
        self.dir.mkdir(parents=True, exist_ok=True)
        self._recover()
        self._thread = threading.Thread(target=self._run, name=f"shard-cache {self.dir}", daemon=True)
        self._thread.start()

    def _check_fits(self, rows: Sequence[ManifestRow]) -> None:
        largest = max(rows, key=lambda r: r.num_bytes)
        if self.cache_bytes < largest.num_bytes:
            raise ValueError(
                f"train.cache_bytes={self.cache_bytes}: smaller than the largest shard ({largest.file}, "
                f"{largest.num_bytes} bytes) of {self.source.url}; expected at least one shard, and two or more so "
                f"fetching overlaps training: raise it (0 = train from a full local copy)"
            )

    def resolved(self, shard: int, row: ManifestRow) -> None:
        """Streaming: shard's committed, verified row (a reader waited for it); fetchable from now on."""
        self._check_fits([row])
        with self._cond:
            self.rows[shard] = row
            self._cond.notify_all()

    # -- what is on disk ------------------------------------------------------------------------------------

    def _path(self, shard: int) -> Path:
        return self.dir / self.rows[shard].file

    def _used(self) -> int:
        return sum(self._resident.values()) + self._reserved

    def _recover(self) -> None:
        """Keep the whole, matching shards a previous run left; delete everything else."""
        for path in sorted(p for p in self.dir.iterdir()):
            shard = self._by_file.get(path.name)
            row = self.rows[shard] if shard is not None else None
            if row is not None and row.checksum and path.is_file() and path.stat().st_size == row.num_bytes:
                if checksum_file(path) == row.checksum:
                    self._resident[shard] = row.num_bytes
                    continue
            path.unlink()
            self.stats.removed_at_start += 1
        for shard in sorted(self._resident, reverse=True):  # a smaller cache_bytes than last time
            if self._used() <= self.cache_bytes:
                break
            self._evict(shard)
        self.stats.kept_at_start = len(self._resident)
        self.stats.max_bytes_on_disk = self._used()
        if self.stats.kept_at_start or self.stats.removed_at_start:
            self.log(
                f"shard cache {self.dir}: kept {self.stats.kept_at_start} whole shards from before, removed "
                f"{self.stats.removed_at_start} other files"
            )

    def _evict(self, shard: int) -> None:
        self._path(shard).unlink(missing_ok=True)
        del self._resident[shard]
        self.stats.evicted += 1

    def bytes_on_disk(self) -> int:
        with self._cond:
            return sum(self._resident.values())

    # -- the reader's side ----------------------------------------------------------------------------------

    def plan(self, schedule: Sequence[int]) -> None:
        """The shards the reader will open, in order (one entry per sample read); replaces any earlier plan."""
        with self._cond:
            self._schedule, self._pos = list(schedule), 0
            self._cond.notify_all()

    @contextmanager
    def opened(self, shard: int):
        """The shard's local path once it is on disk, pinned (not evicted) until the block ends. Opening the
        schedule's next shard advances the reader's position; any other shard is fetched on demand."""
        with self._cond:
            if self._pos < len(self._schedule) and self._schedule[self._pos] == shard:
                self._pos += 1
            waited, t0, said = shard not in self._resident, time.monotonic(), time.monotonic()
            if waited:
                self._waiting.append(shard)
            self._cond.notify_all()
            with self._noted(shard, waited) as note:
                note(f"shard cache {self.dir}: waiting for {self.rows[shard].file}, being fetched")
                while shard not in self._resident:
                    self._raise_if_failed(shard)
                    self._cond.wait(timeout=1.0)
                    if time.monotonic() - said > WAIT_LOG_S:
                        said = time.monotonic()
                        self.log(f"shard cache {self.dir}: waiting {said - t0:.0f} s for {self.rows[shard].file}")
                        note(f"shard cache {self.dir}: waiting {said - t0:.0f} s for {self.rows[shard].file}")
            if waited:
                self._waiting.remove(shard)
                self.stats.wait_s += time.monotonic() - t0
            self._pins[shard] += 1
        try:
            yield self._path(shard)
        finally:
            with self._cond:
                self._pins[shard] -= 1
                self._cond.notify_all()

    def _noted(self, shard: int, waited: bool):
        """A function noting the wait for `shard` (its log goes through self.log, at most every WAIT_LOG_S): a
        no-op when the shard is here or there is no WaitRecord."""
        if not waited or self.wait_record is None:
            return nullcontext(lambda message: None)
        return self.wait_record.waiting(f"cache-shard-{shard:05d}", shard=shard, log=lambda message: None)

    def _raise_if_failed(self, shard: int) -> None:
        if self._error:
            failed, error = next(iter(self._error.items()))
            raise ShardFetchError(
                f"shard {self.rows[failed].file}: fetching it from {self.source.url} into the cache {self.dir} "
                f"failed: {error}" + ("" if failed == shard else f" (while {self.rows[shard].file} was wanted)")
            ) from error
        if self._closed:
            raise ShardFetchError(f"shard cache {self.dir}: closed while {self.rows[shard].file} was wanted")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    # -- the fetching thread --------------------------------------------------------------------------------

    def _wanted(self) -> list[int]:
        """Shards in order of next use (waited for first), as many as fit in cache_bytes."""
        out, seen, total = [], set(), 0
        n = len(self.rows)
        self._pending = None
        candidates = itertools.chain(self._waiting, _from(self._schedule, self._pos))
        for shard in candidates:
            if shard in seen:
                continue
            if not self.rows[shard].checksum:  # streaming: not verified yet; nothing past it is fetched
                self._pending = shard
                break
            size = self.rows[shard].num_bytes
            if total + size > self.cache_bytes:
                break
            seen.add(shard)
            out.append(shard)
            total += size
            if len(seen) == n:
                break
        return out

    def _next_fetch(self) -> int | None:
        """The next shard to fetch, room made for it; None when everything wanted is here or room is pinned."""
        wanted = self._wanted()
        keep = set(wanted)
        for shard in wanted:
            if shard in self._resident:
                continue
            need = self.rows[shard].num_bytes
            # outside the wanted run, needed latest first: the farther along the schedule, the later
            victims = [s for s in self._resident if s not in keep and not self._pins[s]]
            victims.sort(key=self._next_use, reverse=True)
            for victim in victims:
                if self._used() + need <= self.cache_bytes:
                    break
                self._evict(victim)
            if self._used() + need > self.cache_bytes:
                return None  # what is in the way is being read: wait for its release
            self._reserved = need
            self.stats.max_bytes_on_disk = max(self.stats.max_bytes_on_disk, self._used())
            return shard
        return None

    def _next_use(self, shard: int) -> int:
        try:
            return self._schedule.index(shard, self._pos)
        except ValueError:
            return len(self._schedule)

    def _run(self) -> None:
        while True:
            with self._cond:
                shard = None
                while not self._closed and (shard := self._next_fetch()) is None:
                    if self._pending is not None and self.resolve is not None:
                        break
                    self._cond.wait()
                if self._closed:
                    return
                pending = self._pending
            if shard is None:
                if not self._ask(pending):
                    return
                continue
            row = self.rows[shard]
            try:
                # streamed to a temporary (on S3 by ranged, parallel GETs), checked, fsynced, renamed
                self.source.download_to(row.file, self._path(shard), checksum=row.checksum)
            except Exception as e:  # handed to the reader that waits for it, named (_raise_if_failed)
                with self._cond:
                    self._reserved = 0
                    self._error[shard] = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._reserved = 0
                self._resident[shard] = row.num_bytes
                self.stats.fetched += 1
                self.stats.fetched_bytes += row.num_bytes
                self.stats.max_bytes_on_disk = max(self.stats.max_bytes_on_disk, self._used())
                self._cond.notify_all()

    def _ask(self, shard: int) -> bool:
        """Streaming: take the shard's row if it is verified now, else look again in POLL_S seconds (or sooner, when
        a reader hands it over or the schedule moves); False when asking failed (the error is the reader's)."""
        try:
            row = self.resolve(shard)
            if row is not None:
                self._check_fits([row])
        except Exception as e:  # handed to the reader that waits for it, named (_raise_if_failed)
            with self._cond:
                self._error[shard] = e
                self._cond.notify_all()
            return False
        with self._cond:
            if row is not None:
                self.rows[shard] = row
            else:
                self._cond.wait(timeout=POLL_S)
        return True


def _from(seq: list[int], start: int):
    for i in range(start, len(seq)):
        yield seq[i]
