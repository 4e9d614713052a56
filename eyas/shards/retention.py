"""A bounded window of shards in durable storage (extract.retention = N shards) for a single-epoch streamed run:
which shards may leave storage, their release, and the producer's back-pressure.

    use = shard_use(plan, train, num_samples=job.max_samples)      # eyas.train.shard_use: when each shard is read
    released = release_shards(store, use, trained_through=trained_through(train_dir), mode="full")
    window = RetentionWindow(store, use, size=4, mode="full", trained_through=lambda: trained_through(train_dir))
    window.wait_for_room(7)     # the producer, before it writes shard 7: releases what it may, then waits for room

A shard may leave storage only when it is committed, verified, and the newest complete checkpoint is at or past
its last use: every rank finished with it and a resume (which starts from that checkpoint) never reads it again.
The last use comes from the order the trainer follows (eyas.train.shard_use); a shard holding a held-out sample
is read by every evaluation, so it stays until the run has ended (final.json). A release writes `released/shard-NNNNN.json` (its manifest row, the step it was last read at
and the checkpoint step that allowed it) before it deletes the file: the manifest row stays, as the record of
what was extracted, and the record tells the producer not to extract the shard again (eyas.extract.plan) and a
reader that the bytes are gone on purpose. A crash between the two leaves a record and the file; the next
release deletes the file.

Back-pressure: shard k may be written when fewer than N shards before k in the producer's order are not
released. It bounds the shards present at N whatever the number of workers, and never deadlocks when N is at
least `required_window` (checked when the window is made): the shards that must be present together between two
consecutive checkpoints.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

from eyas.shards.manifest import read_manifest
from eyas.shards.verdicts import LOG_EVERY_S, read_verdicts, verdict_name
from eyas.storage import Storage

RELEASED_DIR = "released"
RUN_OVER = 1 << 62  # trained_through once final.json is written: no step will read a shard again


def released_name(shard_index: int) -> str:
    return f"{RELEASED_DIR}/shard-{shard_index:05d}.json"


@dataclass(frozen=True)
class ShardUse:
    """`order`: every planned shard once, first needed first (the producer's order); `first_step` / `last_step`:
    shard -> the first and the last step reading it (absent: no step does); `save_every_steps`, `num_steps`:
    the run's checkpoints."""

    order: tuple[int, ...]
    first_step: dict[int, int]
    last_step: dict[int, int]
    save_every_steps: int
    num_steps: int


def required_window(use: ShardUse) -> int:
    """The fewest shards a window must hold for the run never to stall: for each stretch between consecutive
    checkpoints (C, C'], the shards first read by C' and still read after C (released only past C)."""
    stops = sorted({*range(use.save_every_steps, use.num_steps + 1, use.save_every_steps), use.num_steps})
    need, before = 1, 0
    for stop in stops:
        live = sum(1 for k, s in use.first_step.items() if s <= stop and use.last_step.get(k, 0) > before)
        need, before = max(need, live), stop
    return need


def released_shards(store: Storage) -> set[int]:
    """The shards whose release record is in the store (one listing)."""
    return {int(name.rsplit("-", 1)[1].split(".")[0]) for name in store.list(RELEASED_DIR + "/")}


def release_shards(
    store: Storage, use: ShardUse, *, trained_through: int, mode: str, log: Callable[[str], None] = print
) -> list[int]:
    """Release every committed shard with a verdict of `mode` whose last use is at or before `trained_through`:
    its record written, then its file deleted. Returns the shards released now (ascending)."""
    verdicts, released = read_verdicts(store), released_shards(store)
    listing = store.list()
    for k in sorted(released):  # a release interrupted between its record and the deletion
        record = json.loads(store.get_bytes(released_name(k)))
        if record["row"]["file"] in listing:
            store.delete(record["row"]["file"])
    now = []
    for row in read_manifest(store):
        k = row.shard_index
        if k in released or use.last_step.get(k, 0) > trained_through:
            continue
        if not any(verdict_name(k, row.checksum, m) in verdicts for m in ("full", mode)):
            continue  # not verified yet: its verdict and then a later release decide
        record = {"row": asdict(row), "last_step": use.last_step.get(k, 0), "trained_through": trained_through}
        store.put_bytes(released_name(k), json.dumps(record, sort_keys=True).encode())
        if row.file in listing:
            store.delete(row.file)
        now.append(k)
    if now:
        shown = "through the run's end" if trained_through == RUN_OVER else f"through step {trained_through}"
        log(f"{store.url}: released {len(now)} shards trained {shown} ({', '.join(f'{k:05d}' for k in now)})")
    return now


class RetentionWindow:
    """The producer's side of extract.retention = `size` shards: `wait_for_room(k)` returns once shard k may be
    written, releasing what the trainer's newest checkpoint allows while it waits (thread-safe: every worker
    calls it before each shard)."""

    def __init__(
        self, store: Storage, use: ShardUse, *, size: int, mode: str, trained_through: Callable[[], int],
        poll_s: float = 1.0, log: Callable[[str], None] = print,
    ):  # fmt: skip
        need = required_window(use)
        if size < need:
            raise ValueError(
                f"extract.retention={size} shards: between two checkpoints the trainer reads {need} shards that "
                f"must be in storage together (train.save_every_steps={use.save_every_steps}); the producer would "
                f"wait for a release the trainer cannot reach; set extract.retention to at least {need}, lower "
                f"train.save_every_steps, or keep every shard (extract.retention='keep')"
            )
        self.store, self.use, self.size, self.mode = store, use, size, mode
        self.trained_through, self.poll_s, self.log = trained_through, poll_s, log
        self.position = {k: i for i, k in enumerate(use.order)}
        self.lock = threading.Lock()

    def has_room(self, shard: int, released: set[int] | None = None) -> bool:
        """Whether fewer than `size` shards before `shard` in the order are not released."""
        released = released_shards(self.store) if released is None else released
        before = self.use.order[: self.position[shard]]
        return sum(1 for k in before if k not in released) < self.size

    def wait_for_room(self, shard: int) -> float:
        """Block until `shard` may be written; return the seconds waited. Says what it waits for when it starts
        waiting and at most every LOG_EVERY_S."""
        t0, said = time.monotonic(), None
        while True:
            with self.lock:
                release_shards(self.store, self.use, trained_through=self.trained_through(), mode=self.mode,
                               log=self.log)  # fmt: skip
                if self.has_room(shard):
                    return time.monotonic() - t0
            waited = time.monotonic() - t0
            if said is None or waited - said >= LOG_EVERY_S:
                self.log(f"shard {shard:05d} waits for room in the retention window ({self.size} shards, "
                         f"{waited:.0f} s so far): the trainer's next checkpoint releases the shards it is past")  # fmt: skip
                said = waited
            time.sleep(self.poll_s)
