"""The producer side of a streamed run: extraction in the trainer's first-need order, each shard verified as it
commits, a quarantined shard extracted again at once, until every planned shard has a verdict.

    order = stream_order(plan, config.train, num_samples=job.max_samples).shards   # eyas.train.stream_order
    summary = run_streamed_extraction(config, facts, shard_order=order, target_dtype=config.target.dtype)

`config.extract.num_workers` workers (threads of this process, each with its own backend) take the next shard
from one queue ordered by the shard's position in `shard_order`; the calling thread runs the arrival verifier
(eyas.verify.arrivals) between them, woken by each commit. A shard the verifier quarantines (its file set aside,
its row dropped) goes back into the queue at its own position, so the next free worker writes it again before
any shard needed later; a shard quarantined more than `verify.num_heal_rounds` times in one run stops the run
with the reasons. The run ends when every planned shard's committed bytes have a verdict of `verify.mode`, with
the manifest compacted and checked (eyas.extract.plan.finish_extraction) and the same summary as
eyas.extract.coordinator.run_extraction.

Crash safety: what a SIGKILL leaves is what a killed run_extraction leaves plus verdicts. The next run resumes
through resume_plan (temporaries removed, rows folded, a row whose file is gone set aside), drops the verdicts of
the shards it is about to write (a rewrite must earn its own), verifies the committed shards without a verdict
and extracts only the shards without a row: a committed, verified shard is neither extracted nor checked again.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from eyas.config import RunConfig
from eyas.dataset.table import TokenizedDataset
from eyas.extract.backends import open_backend
from eyas.extract.coordinator import ExtractionProgress, ExtractSummary, finish_and_summarize
from eyas.extract.plan import ResumePlan, check_shard_order, describe_extraction, resume_plan
from eyas.extract.worker import WorkerSummary, extract_shard_tensors, worker_device
from eyas.facts import RunFacts
from eyas.shards.format import write_shard
from eyas.shards.manifest import record_row
from eyas.shards.retention import RetentionWindow
from eyas.shards.shard_set import ExtractRunMeta, extraction_lock
from eyas.shards.verdicts import drop_verdicts
from eyas.storage import Storage
from eyas.verify.arrivals import ArrivalVerifier, arrival_verifier


class ShardQueue:
    """The shards still to write, the one needed first on top; workers block in `take` until one is there or the
    run is over (then None)."""

    def __init__(self, shards: Sequence[int], position: dict[int, int]):
        self.position = position
        self.heap = [(position[k], k) for k in shards]
        heapq.heapify(self.heap)
        self.cond = threading.Condition()
        self.closed = False

    def put(self, shard: int) -> None:
        with self.cond:
            heapq.heappush(self.heap, (self.position[shard], shard))
            self.cond.notify()

    def take(self) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: self.heap or self.closed)
            return None if self.closed else heapq.heappop(self.heap)[1]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _work(
    k: int, queue: ShardQueue, committed: threading.Event, *, config: RunConfig, facts: RunFacts,
    run: ExtractRunMeta, plan: list, store: Storage, dataset: TokenizedDataset,
    on_commit: Callable[[int], None], retention: RetentionWindow | None,
) -> dict:  # fmt: skip
    """Worker k: write and commit each shard the queue gives until it is closed (each once `retention` has room
    for it); its backend opens with the first (a resumed run with nothing left to write loads no target)."""
    t0, cfg = time.perf_counter(), config.extract
    summary, backend = WorkerSummary(k, [], 0, 0.0), None
    try:
        while (index := queue.take()) is not None:
            if retention is not None:
                retention.wait_for_room(index)
            if backend is None:
                backend = open_backend(
                    cfg,
                    target_path=str(facts.target.model_path),
                    target_dtype=run.target_dtype,
                    aux_layer_ids=run.aux_layer_ids,
                    hidden_size=run.hidden_size,
                    device=worker_device(cfg.device, k),
                    trust_remote_code=facts.trust_remote_code,
                    sglang_env=facts.sglang,
                )
            p = plan[index]
            tensors = extract_shard_tensors(backend, dataset, p, aux_layer_ids=run.aux_layer_ids,
                                            hidden_size=run.hidden_size, extract_cfg=cfg)  # fmt: skip
            record_row(store, write_shard(store, tensors, run.shard_meta(p)))
            summary.shard_indices.append(index)
            summary.tokens_written += p.num_tokens
            on_commit(index)
            committed.set()
    finally:
        committed.set()  # the follower looks at the workers at once when one ends, by failure too
        if backend is not None:
            backend.close()
    summary.seconds = time.perf_counter() - t0
    return summary.to_dict()


class _Healing:
    """Counts each shard's quarantines in this run and refuses one more than `verify.num_heal_rounds`."""

    def __init__(self, num_heal_rounds: int, url: str):
        self.limit, self.url = num_heal_rounds, url
        self.reasons: dict[int, list[str]] = {}

    def quarantined(self, shard: int, reason: str) -> None:
        seen = self.reasons.setdefault(shard, [])
        seen.append(reason)
        if len(seen) > self.limit:
            raise RuntimeError(
                f"{self.url}: shard {shard:05d} was quarantined on arrival {len(seen)} times in this run, expected at "
                f"most {self.limit} (verify.num_heal_rounds); each write came out bad: {'; '.join(seen)}; check the "
                f"backend and the storage (eyas verify, then run the extraction again), or raise verify.num_heal_rounds"
            )

    @property
    def count(self) -> int:
        return sum(len(r) for r in self.reasons.values())


def _follow(
    verifier: ArrivalVerifier, queue: ShardQueue, committed: threading.Event, futures: list[Future], *,
    needed: set[int], healing: _Healing, poll_s: float, progress: Callable[[int], None],
) -> None:  # fmt: skip
    """Verify what commits, requeue what is quarantined, until every `needed` shard is verified; a worker's failure
    ends the run (raised)."""
    while True:
        committed.clear()
        for result in verifier.poll():
            if result.status != "ok":
                healing.quarantined(result.shard, result.reason)
                queue.put(result.shard)
        progress(len(verifier.verified))
        if needed <= verifier.verified:
            return
        for f in futures:
            if f.done():
                f.result()  # a failed worker raises here; a worker ends otherwise only when the queue closes
        committed.wait(poll_s)


class _Progress:
    """ExtractionProgress snapshots with `shards_verified`, after each commit and each verifier poll."""

    def __init__(self, tracker: ExtractionProgress, report: Callable[[dict], None] | None):
        self.tracker, self.report, self.verified = tracker, report, 0

    def committed(self, index: int) -> None:
        if self.report:
            self.report({**self.tracker.shard_done(self.tracker.plan[index]), "shards_verified": self.verified})

    def polled(self, num_verified: int) -> None:
        self.verified = num_verified
        if self.report:
            self.report({**self.tracker.snapshot(), "shards_verified": num_verified})


def _resume(
    store: Storage, run: ExtractRunMeta, plan: list, order: list[int], log: Callable[[str], None]
) -> ResumePlan:
    """resume_plan, then the verdicts of the shards it will write dropped; said through `log`."""
    check_shard_order(order, len(plan))  # before resume_plan changes anything
    rp = resume_plan(store, run, plan)
    stale = drop_verdicts(store, rp.todo)
    log(f"streamed extraction plan: {len(plan)} shards, {len(rp.done)} done, {len(rp.todo)} to extract "
        f"({rp.strays_removed} interrupted writes removed, {rp.unlisted} unrecorded shards to rewrite, "
        f"{len(stale)} verdicts of shards to rewrite dropped)")  # fmt: skip
    for reason in rp.quarantined:
        log(f"quarantined (extracted again): {reason}")
    return rp


def run_streamed_extraction(
    config: RunConfig,
    facts: RunFacts,
    *,
    shard_order: Sequence[int] | None = None,
    target_dtype: str = "float32",
    store: Storage | None = None,
    log: Callable[[str], None] = print,
    progress: Callable[[dict], None] | None = None,
    poll_s: float = 1.0,
    only: Collection[int] | None = None,
    retention: RetentionWindow | None = None,
) -> ExtractSummary:
    """Extract the planned shards without a row in `shard_order` (every planned shard once; default the plan's
    order) with `config.extract.num_workers` workers while verifying each as it commits; a quarantined shard is
    written again ahead of the shards needed after it. Returns when every planned shard is verified. `store`
    overrides the run's storage (facts); `progress` gets ExtractionProgress snapshots with `shards_verified`;
    `retention` (extract.retention = N) holds each shard back until the window has room for it.

    `only`: extract and verify these shards alone (those a smoke run reads) and return once each is verified,
    without the end of a whole extraction (no manifest compaction, no local copy); the summary counts these
    shards only (shards_total, samples_total and tokens_total are theirs)."""
    t0, cfg = time.perf_counter(), config.extract
    store = facts.storage() if store is None else store
    with extraction_lock(store), ThreadPoolExecutor(max_workers=cfg.num_workers) as pool:
        run, plan = describe_extraction(cfg, facts, target_dtype=target_dtype)
        order = list(range(len(plan))) if shard_order is None else list(shard_order)
        rp = _resume(store, run, plan, order, log)
        verifier = arrival_verifier(config, facts, order=order, log=log, store=store)
        needed = set(range(len(plan)) if only is None else _planned(only, len(plan)))
        todo = [k for k in rp.todo if k in needed]
        queue = ShardQueue(todo, {shard: k for k, shard in enumerate(order)})
        committed, healing = threading.Event(), _Healing(config.verify.num_heal_rounds, store.url)
        report = _Progress(ExtractionProgress(store, plan, rp.done), progress)
        kw = dict(config=config, facts=facts, run=run, plan=plan, store=store,
                  dataset=TokenizedDataset(facts.tokenized_path), on_commit=report.committed,
                  retention=retention)  # fmt: skip
        num_workers = max(1, min(cfg.num_workers, len(plan)))
        futures = [pool.submit(_work, k, queue, committed, **kw) for k in range(num_workers)]
        try:
            _follow(verifier, queue, committed, futures, needed=needed, healing=healing, poll_s=poll_s,
                    progress=report.polled)  # fmt: skip
        finally:
            queue.close()
        results = [f.result() for f in futures]
        if healing.count:
            log(f"streamed extraction: {healing.count} quarantined shards written again in this run "
                f"({', '.join(f'{k:05d}' for k in sorted(healing.reasons))})")  # fmt: skip
        if only is not None:
            return _summary_of(needed, todo, store, run, plan, t0=t0, num_workers=num_workers, workers=results)
        return finish_and_summarize(store, facts, run, plan, rp, t0=t0, num_workers=num_workers, workers=results,
                                    local_copy=retention is None)  # fmt: skip


def _planned(only: Collection[int], num_shards: int) -> set[int]:
    """`only` as a set, each a planned shard index (a ValueError names the others)."""
    outside = sorted(k for k in only if not 0 <= k < num_shards)
    if outside or not only:
        raise ValueError(
            f"streamed extraction: only={sorted(only)}, expected a non-empty set of planned shard indices 0.."
            f"{num_shards - 1}; found {outside or 'none'}; pass the shards the reader needs from this plan"
        )
    return set(only)


def _summary_of(
    needed: set[int], todo: list[int], store: Storage, run: ExtractRunMeta, plan: list, *, t0: float,
    num_workers: int, workers: list[dict],
) -> ExtractSummary:  # fmt: skip
    """The summary of an extraction of the `needed` shards alone, `todo` of them written in this call."""
    return ExtractSummary(
        shards_total=len(needed),
        shards_written=len(todo),
        shards_skipped=len(needed) - len(todo),
        unlisted_rewritten=0,
        strays_removed=0,
        samples_total=sum(plan[k].sample_end - plan[k].sample_start for k in needed),
        tokens_written=sum(plan[k].num_tokens for k in todo),
        tokens_total=sum(plan[k].num_tokens for k in needed),
        seconds=time.perf_counter() - t0,
        aux_layer_ids=list(run.aux_layer_ids),
        hidden_size=run.hidden_size,
        num_workers=num_workers,
        storage=store.url,
        local_copy={"fetched": 0, "kept": 0},
        workers=workers,
    )
