"""A shard set read while extraction goes on: what a trainer knows before a shard exists, and the wait for it.

    rows = planned_rows(job.stream)                    # one row per planned shard: sample range, tokens (no bytes yet)
    meta = stream_meta(store, log=log)                 # extract.json's run-wide fields, as a ShardMeta
    row = wait_for_shard(store, rows[7], mode="full", log=log)   # blocks until shard 7 is verified; its real row
    row = wait_for_shard(store, rows[7], mode="full", log=log, record=WaitRecord(out, rank))   # and notes the wait

The sample index and shard boundaries come from the shard plan (job.stream.plan), which extraction fixes before
it writes a shard. The run-wide metadata (encoding, widths, target, layers) comes from `extract.json`, which
extraction records before its first shard: the trainer checks the target, plans its memory and sizes its batches
before step 1 without reading a shard, and the first shard the order needs need not be shard 0. Every shard
is still checked against it when first opened (eyas.shards.reader). A shard is opened only once an arrival
verdict (eyas.verify.arrivals) names the bytes of its committed row; until then the reader waits, with no
timeout, and says what it waits for when it starts and at most every 30 s; given a WaitRecord (the trainer's
output directory and rank), it also keeps a durable note of the wait while it lasts (eyas.shards.wait_record),
which `eyas status` reads.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Callable

from eyas.config import StreamSource
from eyas.shards.format import ShardMeta, ShardPlan, shard_filename
from eyas.shards.manifest import ManifestRow
from eyas.shards.shard_set import RUN_META_NAME, read_run_meta
from eyas.shards.verdicts import LOG_EVERY_S, verified_row, wait_verified
from eyas.shards.wait_record import WaitRecord
from eyas.storage import Storage

POLL_S = 1.0  # how often a waiting reader looks at the store
SAY_EVERY_S = LOG_EVERY_S  # how often a wait says it still waits


class StreamPlanError(ValueError):
    """What extraction committed contradicts the shard plan the trainer was given."""


def planned_rows(stream: StreamSource) -> list[ManifestRow]:
    """A row per planned shard, its bytes and checksum unknown (0, "") until it is committed and verified."""
    return [
        ManifestRow(k, shard_filename(k), p.sample_start, p.sample_end, p.num_tokens, 0, "")
        for k, p in enumerate(stream.plan)
    ]


def _noted(record: WaitRecord | None, what: str, shard: int | None, log: Callable[[str], None]):
    """The wait's log function: `log` itself, or with a record, `log` that also keeps the wait's note."""
    return nullcontext(log) if record is None else record.waiting(what, shard=shard, log=log)


def stream_meta(
    store: Storage, stream: StreamSource, *, log: Callable[[str], None], record: WaitRecord | None = None
) -> ShardMeta:
    """The run-wide metadata `extract.json` records, waited for (no timeout, said every 30 s) while extraction has
    not started; its number of shards must be the plan's."""
    t0, said = time.monotonic(), None
    with _noted(record, "extract-json", None, log) as say:
        while (recorded := read_run_meta(store)) is None:
            waited = time.monotonic() - t0
            if said is None or waited - said >= SAY_EVERY_S:
                say(f"waiting for {store.url}/{RUN_META_NAME} ({waited:.0f} s so far): extraction has not started; "
                    f"is it running?")  # fmt: skip
                said = waited
            time.sleep(POLL_S)
    if recorded.num_shards != len(stream.plan):
        raise StreamPlanError(
            f"{store.url}/{RUN_META_NAME}: extraction plans {recorded.num_shards} shards, the job's stream.plan "
            f"{len(stream.plan)}; the job was written for another extraction: write it again from this run's plan"
        )
    first = stream.plan[0]
    meta = recorded.shard_meta(ShardPlan(0, first.sample_start, first.sample_end, first.num_tokens))
    return replace(meta, format_version=recorded.format_version)


def wait_for_shard(
    store: Storage,
    planned: ManifestRow,
    *,
    mode: str,
    log: Callable[[str], None],
    record: WaitRecord | None = None,
) -> ManifestRow:
    """The committed row of a planned shard once a verdict of `mode` names its bytes (eyas.verify.arrivals
    wait_verified, no timeout); its samples must be the plan's. With `record`, a note of the wait is kept while
    it lasts."""
    k = planned.shard_index
    with _noted(record, f"shard-{k:05d}", k, log) as say:
        row = wait_verified(
            store, k, mode=mode, timeout_s=math.inf, poll_s=POLL_S, log=say, log_every_s=SAY_EVERY_S
        ).row
    return _as_planned(store, planned, row)


def verified_now(store: Storage, planned: ManifestRow, *, mode: str) -> ManifestRow | None:
    """The committed row of a planned shard when a verdict of `mode` names its bytes now; else None (no wait)."""
    row = verified_row(store, planned.shard_index, mode=mode)
    return None if row is None else _as_planned(store, planned, row)


def _as_planned(store: Storage, planned: ManifestRow, row: ManifestRow) -> ManifestRow:
    """The committed row, refused when its samples are not the plan's."""
    if (row.sample_start, row.sample_end) != (planned.sample_start, planned.sample_end):
        raise StreamPlanError(
            f"shard {row.file} of {store.url}: committed over samples {row.sample_start}..{row.sample_end}, the "
            f"job's stream.plan says {planned.sample_start}..{planned.sample_end}; the job was written for another "
            f"extraction: write it again from this run's plan"
        )
    return row
