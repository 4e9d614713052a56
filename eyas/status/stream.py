"""Both sides of a streamed run (a train/job.json with `stream`: training while extraction goes on), read from
durable files alone: what `eyas status` shows under Progress, and what a flow's progress artifact can show.

    status = stream_status(run.paths.train_dir)    # None when the job is not streamed (or not written yet)
    status["extracted"], status["verified"], status["planned"]      # shards: manifest rows, verdicts, the plan
    for line in stream_lines(status): print(line)

Read from: the job (its stream's plan and verify mode, its shard store), the store's manifest rows and verdicts
(eyas.shards.verdicts), rank 0's metrics.jsonl (the step done, data_wait_s), and the ranks' wait notes
(eyas.shards.wait_record). The order the trainer needs the shards in, and the step that first reads each, come
from the plan (eyas.train.stream_order), so how far the trainer trails the producer is counted in shards and in
steps: the verified shards it has not needed yet, and the last step whose shards are all verified.

A wait note is `live` while its process lives (same host: pid, kernel start time and boot checked; another host:
its last word is younger than STALE_AFTER_S) and `stale` otherwise: a rank killed mid-wait leaves one behind.
"""

from __future__ import annotations

import bisect
import time
from pathlib import Path

from eyas.config import TrainJob
from eyas.shards.format import ShardPlan, shard_filename
from eyas.shards.manifest import read_manifest
from eyas.shards.shard_set import QUARANTINE_DIR
from eyas.shards.verdicts import COVERING_MODES, read_verdicts, verdict_name
from eyas.shards.wait_record import read_wait_records
from eyas.status.launches import ALIVE, ELSEWHERE, liveness
from eyas.status.probes import READ_ERRORS
from eyas.storage import open_storage
from eyas.train.data import TrainSplit, global_order, steps_per_epoch, total_steps
from eyas.train.launch import JOB_FILE
from eyas.train.metrics import METRICS_FILE, read_metrics
from eyas.train.stream_order import plan_windows, stream_order

STALE_AFTER_S = 90.0  # three missed heartbeats of a waiting reader (eyas.shards.streamed.SAY_EVERY_S)


def read_stream_job(train_dir: Path) -> TrainJob | None:
    """The train directory's job when it is a streamed one; None without a job file or without `stream`."""
    path = Path(train_dir) / JOB_FILE
    if not path.is_file():
        return None
    job = TrainJob.model_validate_json(path.read_text())
    return job if job.stream is not None else None


def store_state(job: TrainJob) -> tuple[set[int], set[int], set[str]]:
    """(shards committed, shards whose committed bytes a verdict of the job's mode names, the files ever
    quarantined) in the job's store."""
    store = open_storage(job.shards_dir, endpoint_url=job.shards_endpoint_url)
    rows = read_manifest(store)  # the compacted manifest and the row records not yet compacted
    names = read_verdicts(store)
    modes = COVERING_MODES[job.stream.verify_mode]
    verified = {r.shard_index for r in rows if any(verdict_name(r.shard_index, r.checksum, m) in names for m in modes)}
    quarantined = {n.removeprefix(QUARANTINE_DIR + "/").split(".")[0] for n in store.list(QUARANTINE_DIR + "/")}
    return {r.shard_index for r in rows}, verified, quarantined


def shard_seen(shard: int | None, committed: set[int], verified: set[int], quarantined: set[str]) -> str:
    """What the store holds of a shard a rank waits for (None: extract.json)."""
    if shard is None:
        return "extraction has not recorded extract.json"
    if shard in verified:
        return "verified now: the rank takes it at its next look"
    if shard in committed:
        return "committed, being verified"
    if shard_filename(shard).split(".")[0] in quarantined:
        return "quarantined, being extracted again"
    return "not committed yet"


def batch_shards(job: TrainJob, plan: list[ShardPlan], step: int) -> list[int]:
    """The shards step `step` (from 1) reads, in the order of their first sample in its global batch (as
    eyas.train.stream_order walks the steps); [] past the run's last step."""
    t, num_samples = job.train, job.max_samples or plan[-1].sample_end
    if step > total_steps(num_samples, t):
        return []
    split = TrainSplit.of(num_samples, t.eval_fraction)
    epoch, local = divmod(step - 1, steps_per_epoch(len(split.train_ids), t.global_batch_size))
    order = global_order(len(split.train_ids), t.seed, epoch, plan_windows(plan, t, num_samples=num_samples))
    starts = [p.sample_start for p in plan]
    out: list[int] = []
    for position in order[local * t.global_batch_size : (local + 1) * t.global_batch_size]:
        shard = bisect.bisect_right(starts, split.train_ids[position]) - 1
        if shard not in out:
            out.append(shard)
    return out


def wait_state(record: dict, now: float) -> str:
    """`live` or `stale (why)` for a wait note (see the module docstring)."""
    alive = liveness(record)
    if alive == ALIVE:
        return "live"
    if alive == ELSEWHERE:
        age = now - record["beat_at"]
        return "live" if age <= STALE_AFTER_S else f"stale (no word for {age:.0f} s from {record['host']})"
    return f"stale (process {record['pid']} on {record['host']} is gone)"


def stream_status(train_dir: Path, *, now: float | None = None) -> dict | None:
    """Both sides of the streamed run whose job is in `train_dir`; None when it is not streamed. Keys: planned,
    extracted, verified (shards); step (done, rank 0's metrics), last_step, reads_next (the shards step + 1 reads);
    verified_ahead (verified shards no step up to `step` read), next_unverified (the first shard in the trainer's
    order not verified yet), ready_through_step, steps_ahead; data_wait_s (summed over the metrics); waits (the
    notes, each with `state` live or stale, `waited_s` and `seen`: what the store holds of the shard now)."""
    job = read_stream_job(train_dir)
    if job is None:
        return None
    now = time.time() if now is None else now
    plan = [ShardPlan(k, p.sample_start, p.sample_end, p.num_tokens) for k, p in enumerate(job.stream.plan)]
    order = stream_order(plan, job.train, num_samples=job.max_samples)
    committed, verified, quarantined = store_state(job)
    metrics_path = Path(train_dir) / METRICS_FILE
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    step = records[-1]["step"] if records else 0
    needed = [k for k in order.shards if k in order.first_step]
    pending = [k for k in needed if k not in verified]  # what the producer still owes the trainer, first first
    last_step = total_steps(job.max_samples or plan[-1].sample_end, job.train)
    ready_through = order.first_step[pending[0]] - 1 if pending else last_step
    waits = []
    for record in read_wait_records(train_dir):
        seen = shard_seen(record["shard"], committed, verified, quarantined)
        waits.append({**record, "state": wait_state(record, now), "waited_s": now - record["since"], "seen": seen})
    return {
        "planned": len(plan),
        "extracted": len(committed),
        "verified": len(verified),
        "verify_mode": job.stream.verify_mode,
        "step": step,
        "last_step": last_step,
        "reads_next": batch_shards(job, plan, step + 1),
        "next_needed": next((k for k in needed if order.first_step[k] > step), None),
        "verified_ahead": sum(1 for k in verified if order.first_step.get(k, last_step + 1) > step),
        "next_unverified": pending[0] if pending else None,
        "ready_through_step": ready_through,
        "steps_ahead": ready_through - step,
        "data_wait_s": round(sum(r.get("data_wait_s", 0.0) for r in records), 3),
        "waits": waits,
    }


def stream_progress(train_dir: Path) -> dict | None:
    """stream_status for `eyas status`: a job, store or note that cannot be read now is {"error": why}, shown as
    such beside the other stages rather than ending the report."""
    try:
        return stream_status(train_dir)
    except READ_ERRORS as err:
        return {"error": f"{type(err).__name__}: {err}"}


def stream_lines(s: dict) -> list[str]:
    """The streamed run in a few lines: producer, trainer, how far apart, time waited, the waits now."""
    if "error" in s:
        return [f"streaming: not readable now ({s['error']})"]
    lines = [
        f"streaming: shards extracted {s['extracted']}/{s['planned']}, verified {s['verified']}/{s['planned']} "
        f"({s['verify_mode']} mode)",
        f"streaming trainer: step {s['step']:,} of {s['last_step']:,}; "
        + (
            f"step {s['step'] + 1:,} reads shard{'s' * (len(s['reads_next']) != 1)} "
            f"{', '.join(f'{k:05d}' for k in s['reads_next'])}"
            if s["reads_next"]
            else "no step left"
        ),
    ]
    owed = s["next_unverified"]
    lines.append(
        f"streaming lead: {s['verified_ahead']} verified shard(s) the trainer has not needed yet; its shards are "
        f"verified through step {s['ready_through_step']:,} ({s['steps_ahead']:,} step(s) ahead of the trainer)"
        + (f"; the producer owes shard {owed:05d} next" if owed is not None else "; every shard it needs is verified")
    )
    lines.append(
        f"streaming wait: the trainer (rank 0) waited {s['data_wait_s']:,.1f} s for data over {s['step']:,} steps"
    )
    for w in s["waits"]:
        what = f"shard {w['shard']:05d}" if w["shard"] is not None else "extract.json"
        via = " (its fetch into the rank's cache)" if w["what"].startswith("cache-") else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(w["since"]))
        lines.append(
            f"streaming wait now: rank {w['rank']} waits for {what}{via} since {since} ({w['waited_s']:,.0f} s; "
            f"{w['seen']}), {w['state']}"
            + ("" if w["state"] == "live" else f": a note left by a rank that died mid-wait, {w['path']}")
        )
    return lines


def stream_brief(s: dict) -> str:
    """Both sides in one clause for a progress line: the trainer's step, the shards verified, its lead, the time
    waited and the wait now (the first live one, else a stale note)."""
    if "error" in s:
        return f"streaming: not readable now ({s['error']})"
    parts = [
        f"trainer step {s['step']:,}/{s['last_step']:,}",
        f"shards extracted {s['extracted']}/{s['planned']}, verified {s['verified']}/{s['planned']}",
        f"verified through step {s['ready_through_step']:,} ({s['steps_ahead']:,} ahead of the trainer)",
        f"waited {s['data_wait_s']:,.1f} s",
    ]
    waits = sorted(s["waits"], key=lambda w: w["state"] != "live")
    if waits:
        w = waits[0]
        what = f"shard {w['shard']:05d}" if w["shard"] is not None else "extract.json"
        parts.append(f"rank {w['rank']} waits for {what} ({w['waited_s']:,.0f} s; {w['seen']}), {w['state']}")
    return "streaming: " + "; ".join(parts)
