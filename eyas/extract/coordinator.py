"""The extraction coordinator: plan, start workers on disjoint shard lists, follow them, finish.

    summary = run_extraction(config.extract, facts, target_dtype=config.target.dtype)   # threads here
    summary = run_extraction(..., launch=my_launch, progress=callback)     # workers started elsewhere
    summary = run_extraction(..., shard_order=stream_order(plan, train).shards)   # the trainer's first needs first

    python -m eyas.extract --tokenized T.parquet --shards DIR --target MODEL [--num-workers 2]

Per token it stores the aux hidden states of `n_aux` layers concatenated (width n_aux * H) and the
last hidden state (width H). `run_extraction` is the only coordinator: it takes the directory's lock
(one coordinator per local shards directory at a time), resumes from the manifest
(eyas.extract.plan), hands the missing shards to `launch` (by default threads of this process; the
Prefect tasks start concurrent tasks or flow runs on a work pool), follows them through the
manifest in storage (so remote workers count) until every one has ended, then checks that every
planned shard has exactly one row and brings the run's local copy up to date (eyas.shards.sync) when
the run keeps one (facts.shards_dir; none with train.cache_bytes > 0).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

from eyas.config import ExtractConfig
from eyas.dataset.table import TokenizedDataset
from eyas.extract.plan import (
    ResumePlan,
    assign_shards,
    check_shard_order,
    describe_extraction,
    finish_extraction,
    resume_plan,
)
from eyas.extract.worker import run_worker
from eyas.facts import RunFacts
from eyas.shards.format import ShardPlan
from eyas.shards.manifest import done_shard_indices
from eyas.shards.shard_set import ExtractRunMeta, extraction_lock
from eyas.shards.sync import sync_to_local
from eyas.storage import Storage

OnShard = Callable[[ShardPlan], None]


class Worker(Protocol):
    """A started worker: `done()` without blocking, then `result()` (raises the worker's failure)."""

    def done(self) -> bool: ...

    def result(self) -> dict: ...


# launch(parts, on_shard) -> one started worker per part; on_shard may be called by workers of this process
Launch = Callable[[list[list[int]], OnShard | None], list[Worker]]


@dataclass
class ExtractSummary:
    shards_total: int
    shards_written: int
    shards_skipped: int
    unlisted_rewritten: int  # shard files found without a manifest row, extracted again
    strays_removed: int
    samples_total: int
    tokens_written: int
    tokens_total: int
    seconds: float
    aux_layer_ids: list[int]
    hidden_size: int
    num_workers: int
    storage: str
    local_copy: dict  # {"fetched", "kept"} of eyas.shards.sync.sync_to_local
    workers: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def summary_sentence(summary: dict) -> str:
    """One sentence of an extraction's summary (ExtractSummary.to_dict), for logs."""
    s = summary
    extra = [f"{s['unlisted_rewritten']} unrecorded shards rewritten"] if s["unlisted_rewritten"] else []
    extra += [f"{s['strays_removed']} stray files removed"] if s["strays_removed"] else []
    return (
        f"extraction: {s['shards_written']:,} shards written and {s['shards_skipped']:,} already done, of "
        f"{s['shards_total']:,} ({s['tokens_written']:,} of {s['tokens_total']:,} tokens, {s['samples_total']:,} "
        f"samples) in {s['seconds']:.1f} s by {s['num_workers']} worker{'s' * (s['num_workers'] != 1)} into "
        f"{s['storage']}; aux layers {s['aux_layer_ids']}, hidden size {s['hidden_size']:,}"
        + (f"; {', '.join(extra)}" if extra else "")
    )


class ExtractionProgress:
    """Samples and tokens done / total and an ETA, from the shard indices known to be done.

    `poll()` re-reads the manifest's row names from storage (what a monitor of remote workers does);
    `shard_done(p)` counts a shard written by a worker of this process."""

    def __init__(self, store: Storage, plan: list[ShardPlan], done: set[int]):
        self.store, self.plan = store, plan
        self.done = set(done)
        self.lock = threading.Lock()
        self.t0, self.tokens_at_start = time.monotonic(), self._tokens()
        self.samples_total = plan[-1].sample_end if plan else 0
        self.tokens_total = sum(p.num_tokens for p in plan)

    def _tokens(self) -> int:
        return sum(self.plan[i].num_tokens for i in self.done)

    def shard_done(self, p: ShardPlan) -> dict:
        with self.lock:
            self.done.add(p.index)
            return self.snapshot()

    def poll(self) -> dict:
        found = done_shard_indices(self.store)
        with self.lock:
            self.done |= found
            return self.snapshot()

    def snapshot(self) -> dict:
        tokens = self._tokens()
        rate = (tokens - self.tokens_at_start) / max(time.monotonic() - self.t0, 1e-9)
        return {
            "shards_done": len(self.done),
            "shards_total": len(self.plan),
            "samples_done": sum(self.plan[i].sample_end - self.plan[i].sample_start for i in self.done),
            "samples_total": self.samples_total,
            "tokens_done": tokens,
            "tokens_total": self.tokens_total,
            "eta_s": round((self.tokens_total - tokens) / rate, 1) if rate > 0 else None,
        }


class _Done:
    """A worker that ran to its end in the calling thread."""

    def __init__(self, result: dict):
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> dict:
        return self._result


class _Thread:
    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> dict:
        return self.future.result()


def thread_launch(
    cfg: ExtractConfig, facts: RunFacts, *, target_dtype: str, store: Storage, pool: ThreadPoolExecutor
) -> Launch:
    """Workers as threads of this process, sharing one storage client and one dataset; a single worker runs
    in the calling thread (torch is a few % slower in a pool thread)."""

    def launch(parts: list[list[int]], on_shard: OnShard | None) -> list[Worker]:
        dataset = TokenizedDataset(facts.tokenized_path) if parts else None
        kwargs = dict(target_dtype=target_dtype, store=store, dataset=dataset, on_shard=on_shard)

        def work(k: int, part: list[int]) -> dict:
            return run_worker(cfg, facts, worker_index=k, shard_indices=part, **kwargs).to_dict()

        if len(parts) == 1:
            return [_Done(work(0, parts[0]))]
        return [_Thread(pool.submit(work, k, part)) for k, part in enumerate(parts)]

    return launch


def follow_workers(
    workers: list[Worker], tracker: ExtractionProgress, progress: Callable[[dict], None] | None, poll_s: float
) -> list[dict]:
    """Report progress (read from the manifest in storage, so remote workers count) while any worker runs,
    and once more when the last has ended; then their results, or the first failure."""
    waited = False
    while not all(w.done() for w in workers):
        waited = True
        time.sleep(poll_s)
        if progress:
            progress(tracker.poll())
    if waited and progress:
        progress(tracker.poll())
    return [w.result() for w in workers]


def run_extraction(
    cfg: ExtractConfig,
    facts: RunFacts,
    *,
    target_dtype: str = "float32",
    launch: Launch | None = None,
    store: Storage | None = None,
    progress: Callable[[dict], None] | None = None,
    poll_s: float = 2.0,
    shard_order: Sequence[int] | None = None,
) -> ExtractSummary:
    """Extract every shard of the plan that the manifest does not list yet with `cfg.num_workers` workers on
    disjoint shard lists; return what was done. The target is loaded (once per worker) only when some
    shard is missing. `store` overrides the run's storage (facts) for the coordinator and thread workers.
    `shard_order` (every planned shard once; default the plan's order) is the order the shards are dealt to
    the workers in, round robin, and each worker extracts its list in that order (eyas.train.stream_order:
    the order a trainer first needs them)."""
    t0 = time.perf_counter()
    store = facts.storage() if store is None else store
    with extraction_lock(store), ThreadPoolExecutor(max_workers=cfg.num_workers) as pool:
        run, plan = describe_extraction(cfg, facts, target_dtype=target_dtype)
        if shard_order is not None:
            check_shard_order(shard_order, len(plan))  # before resume_plan changes anything
        rp = resume_plan(store, run, plan)
        print(
            f"extraction plan: {len(plan)} shards, {len(rp.done)} done, {len(rp.todo)} to extract "
            f"({rp.strays_removed} interrupted writes removed, {rp.unlisted} unrecorded shards to rewrite)"
            + (", in the given shard order" if shard_order is not None else "")
        )
        for reason in rp.quarantined:
            print(f"quarantined (extracted again): {reason}")
        tracker = ExtractionProgress(store, plan, rp.done)
        on_shard = (lambda p: progress(tracker.shard_done(p))) if progress else None
        if progress:
            progress(tracker.snapshot())
        parts = [part for part in assign_shards(rp.todo, cfg.num_workers, order=shard_order) if part]
        start = launch or thread_launch(cfg, facts, target_dtype=target_dtype, store=store, pool=pool)
        results = follow_workers(start(parts, on_shard), tracker, progress, poll_s)
        return finish_and_summarize(store, facts, run, plan, rp, t0=t0, num_workers=len(parts), workers=results)


def finish_and_summarize(
    store: Storage,
    facts: RunFacts,
    run: ExtractRunMeta,
    plan: list[ShardPlan],
    rp: ResumePlan,
    *,
    t0: float,
    num_workers: int,
    workers: list[dict],
    local_copy: bool = True,
) -> ExtractSummary:
    """The end of an extraction (offline or streamed): every planned shard has its row (finish_extraction), the
    local copy is brought in line (unless `local_copy` is False: a retention window deleted released shards, so
    no copy could be whole), and what was done is summed up."""
    tokens_total = finish_extraction(store, plan)
    copied = {"fetched": 0, "kept": 0}
    if facts.shards_dir and local_copy:
        copied = sync_to_local(store, facts.shards_dir)
    return ExtractSummary(
        shards_total=len(plan),
        shards_written=len(rp.todo),
        shards_skipped=len(rp.done),
        unlisted_rewritten=rp.unlisted,
        strays_removed=rp.strays_removed,
        samples_total=facts.num_samples,
        tokens_written=sum(plan[i].num_tokens for i in rp.todo),
        tokens_total=tokens_total,
        seconds=time.perf_counter() - t0,
        aux_layer_ids=list(run.aux_layer_ids),
        hidden_size=run.hidden_size,
        num_workers=num_workers,
        storage=store.url,
        local_copy=copied,
        workers=workers,
    )
