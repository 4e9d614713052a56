"""Tasks of the extraction and verification stages."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.extract import (
    ExtractionProgress,
    check_run_meta,
    describe_extraction,
    finish_extraction,
    resume_plan,
)
from eyas.extract_worker import extract_worker
from eyas.jobs import aux_layer_ids
from eyas.manifest import done_shard_indices, drop_manifest_rows
from eyas.shard_sync import shard_storage, sync_to_local
from eyas.shards import TokenizedDataset
from eyas.verify import (
    VerifyReport,
    expected_shard_meta,
    quarantine_bad_shards,
    verify_shards,
    write_verify_report,
)
from tasks.caching import cached_by
from tasks.reporting import StageProgress, table_artifact
from tasks.retry import TRANSIENT_IO


def _describe(config: RunConfig):
    """(storage, dataset, run parameters, shard plan) of the run's extraction; reads no shard."""
    store = shard_storage(config.extract, config.paths.shards_dir)
    dataset = TokenizedDataset(config.paths.tokenized)
    run, plan = describe_extraction(
        dataset=dataset,
        target_path=config.target.model_path,
        aux_layer_ids=aux_layer_ids(config),
        extract_cfg=config.extract,
        target_dtype=config.target.dtype,
    )
    return store, dataset, run, plan


# Not cached: it IS the resume logic (reads the manifest each time). Idempotent: storage errors retried.
@task(name="plan-extraction", cache_policy=NO_CACHE, **TRANSIENT_IO)
def plan_extraction(config: RunConfig) -> dict:
    """Read the manifest, delete leftovers of interrupted writes, list the shards still to extract."""
    store, _, run, plan = _describe(config)
    rp = resume_plan(store, run, plan)
    print(
        f"extraction plan: {len(plan)} shards, {len(rp.done)} done, {len(rp.todo)} to extract "
        f"({rp.strays_removed} interrupted writes removed, {rp.unlisted} unrecorded shards to rewrite)"
    )
    return {
        "todo": rp.todo,
        "shards_total": len(plan),
        "shards_skipped": len(rp.done),
        "strays_removed": rp.strays_removed,
        "unlisted_rewritten": rp.unlisted,
    }


# Not cached: the manifest rows are its durable record. Storage errors retried; every attempt skips the
# worker's shards that already have a row (written by an earlier attempt), so a retry does only what is left.
@task(name="extract-worker-shards", cache_policy=NO_CACHE, **TRANSIENT_IO)
def extract_worker_shards(config: RunConfig, worker_index: int, shard_indices: list[int]) -> dict:
    """Extract this worker's shards (disjoint from every other worker's) and record each one."""
    store, dataset, run, plan = _describe(config)
    check_run_meta(store, run)  # a worker elsewhere must see the coordinator's parameters
    done = done_shard_indices(store)
    todo = [i for i in shard_indices if i not in done]
    if len(todo) < len(shard_indices):
        print(f"worker {worker_index}: {len(shard_indices) - len(todo)} of its shards already recorded, skipped")
    summary = extract_worker(
        store=store,
        dataset=dataset,
        run_meta=run,
        plan=plan,
        shard_indices=todo,
        extract_cfg=config.extract,
        target_path=config.target.model_path,
        worker_index=worker_index,
    )
    return {
        "worker_index": worker_index,
        "shard_indices": list(shard_indices),
        "shards_already_recorded": len(shard_indices) - len(todo),
        "tokens_written": summary.tokens_written,
        "seconds": round(summary.seconds, 2),
    }


# Not cached: folds row files and fills the local copy from storage each time. Idempotent: retried.
@task(name="finish-extraction", cache_policy=NO_CACHE, **TRANSIENT_IO)
def finish_extraction_task(config: RunConfig, planned: dict) -> dict:
    """Fold the row files into the manifest, check every planned shard is there, fill the local copy."""
    store, _, _, plan = _describe(config)
    tokens = finish_extraction(store, plan)
    synced = sync_to_local(store, config.paths.shards_dir)
    return {
        **{k: v for k, v in planned.items() if k != "todo"},
        "shards_written": len(planned["todo"]),
        "tokens_total": tokens,
        "storage": store.url,
        "local_copy": synced,
    }


class LocalWorker:
    """A worker running as a concurrent task of this flow run."""

    def __init__(self, future):
        self.future = future

    def done(self) -> bool:
        return self.future.wrapped_future.done()

    def result(self) -> dict:
        return self.future.result()


class DeploymentWorker:
    """A worker running as its own flow run of the `extract-worker` deployment (e.g. on another GPU node)."""

    def __init__(self, flow_run_id):
        self.flow_run_id = flow_run_id

    def _state(self):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(self.flow_run_id).state

    def done(self) -> bool:
        state = self._state()
        return state is not None and state.is_final()

    def result(self) -> dict:
        state = self._state()
        if not state.is_completed():
            raise RuntimeError(
                f"extract-worker flow run {self.flow_run_id} ended {state.name}: {state.message}; its shards have "
                f"no manifest rows; run extraction again, it extracts only what is missing"
            )
        return {"flow_run_id": str(self.flow_run_id), "state": state.name}


def start_workers(config: RunConfig, parts: list[list[int]]) -> list:
    """One worker per shard list: concurrent tasks here, or flow runs of `extract.worker_deployment`."""
    if config.extract.fanout == "local":
        return [LocalWorker(extract_worker_shards.submit(config, k, part)) for k, part in enumerate(parts)]
    from prefect.context import get_run_context
    from prefect.deployments import run_deployment

    parent = get_run_context().flow_run.id
    workers = []
    for k, part in enumerate(parts):
        run = run_deployment(
            config.extract.worker_deployment,
            parameters={"config": config.model_dump(mode="json"), "worker_index": k, "shard_indices": part},
            timeout=0,
            idempotency_key=f"{parent}-extract-worker-{k}",
        )
        workers.append(DeploymentWorker(run.id))
    return workers


def follow_workers(config: RunConfig, workers: list, poll_s: float = 2.0) -> list[dict]:
    """Show progress (read from the manifest in storage, so remote workers count too) until every
    worker has ended; then return their results, or raise the first failure. A worker has `done()`
    and `result()`."""
    store, _, _, plan = _describe(config)
    tracker = ExtractionProgress(store, plan, done_shard_indices(store))
    with StageProgress("extract-progress", "extracting hidden states", "samples_done", "samples_total") as progress:
        progress(tracker.snapshot())
        while not all(w.done() for w in workers):
            time.sleep(poll_s)
            progress(tracker.poll())
        progress(tracker.poll())
    return [w.result() for w in workers]


# Cached by the manifest (every shard with its checksum) and the tokenized table; storage errors retried.
@task(name="verify-shards", **cached_by(("target", "extract", "verify"), ("tokenized", "manifest")), **TRANSIENT_IO)
def verify_shard_set(config: RunConfig, heal_round: int = 0) -> VerifyReport:
    """Check every shard against the manifest, the dataset and the run config; write the Parquet report."""
    expected = expected_shard_meta(
        target_path=config.target.model_path,
        aux_layer_ids=config.target.aux_layer_ids,
        dtype=config.extract.dtype,
        tokenized_path=config.paths.tokenized,
    )
    with StageProgress("verify-progress", "verifying shards", "shards_done", "shards_total") as progress:
        report = verify_shards(
            shards_dir=config.paths.shards_dir,
            tokenized_path=config.paths.tokenized,
            expected=expected,
            mode=config.verify.mode,
            num_workers=config.verify.num_workers,
            chunk_bytes=config.verify.chunk_bytes,
            progress=progress,
        )
    write_verify_report(report, config.paths.verify_report)
    s = report.summary()
    table_artifact(
        "shard-verification",
        report.outcome_table(),
        f"shard verification ({s['mode']} mode, healing round {heal_round}): {s['ok']} ok, {s['bad']} bad, "
        f"{s['problems']} directory problems, {s['gib_per_s']} GiB/s; per shard: {config.paths.verify_report}",
    )
    return report


# Neither cached nor retried: it moves files; after a partial move a re-run verifies again instead.
@task(name="quarantine-shards", cache_policy=NO_CACHE)
def quarantine_bad(config: RunConfig, report: VerifyReport) -> list[str]:
    """Move the bad shards aside (with their reasons) and drop their manifest rows for re-extraction."""
    notes = quarantine_bad_shards(config.paths.shards_dir, report)
    if config.extract.storage_url:  # the local copy is set aside; the source must re-extract them too
        drop_manifest_rows(shard_storage(config.extract, config.paths.shards_dir), sorted(report.bad_reasons))
    for note in notes:
        print(f"quarantined: {note.read_text().strip()} -> {note.parent}")
    return [str(n) for n in notes]
