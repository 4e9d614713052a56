"""Flows `extract-hidden-states` (plan, fan out, follow, finish) and `extract-worker` (one worker's shards)."""

from prefect import flow

from eyas.config import RunConfig
from eyas.extract import extraction_lock
from eyas.extract_worker import assign_shards
from eyas.shard_sync import shard_storage
from tasks.extract import (
    extract_worker_shards,
    finish_extraction_task,
    follow_workers,
    plan_extraction,
    start_workers,
)
from tasks.status import stage_status_artifact


@flow(name="extract-hidden-states", log_prints=True)
def extract_flow(config: RunConfig) -> dict:
    """Extract the shards the manifest lacks with extract.num_workers workers, each on disjoint shards."""
    with extraction_lock(shard_storage(config.extract, config.paths.shards_dir)):
        planned = plan_extraction(config)
        parts = [part for part in assign_shards(planned["todo"], config.extract.num_workers) if part]
        workers = start_workers(config, parts)
        results = follow_workers(config, workers)
        summary = {**finish_extraction_task(config, planned), "workers": results}
    print(f"extraction: {summary}")
    stage_status_artifact(config, "extract")
    return summary


@flow(name="extract-worker", log_prints=True)
def extract_worker_flow(config: RunConfig, worker_index: int, shard_indices: list[int]) -> dict:
    """One worker of a fanned-out extraction (extract.fanout = 'deployment'): these shards only."""
    return extract_worker_shards(config, worker_index, shard_indices)
