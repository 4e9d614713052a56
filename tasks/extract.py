"""Tasks of the extraction stage: the coordinator, and the workers it starts (tasks here, or flow runs).

The coordinator is eyas.extract.coordinator.run_extraction; the Prefect side only says how a worker
is started: as a concurrent task of this flow run (extract.fanout = "local") or as a flow run of the
`extract-worker` deployment on a work pool (fanout = "deployment"), each on a disjoint shard list.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.extract.coordinator import Launch, Worker, run_extraction
from eyas.extract.worker import run_worker
from eyas.facts import RunFacts
from tasks.reporting import StageProgress
from tasks.retry import TRANSIENT_IO


# Not cached: it IS the resume logic (reads the manifest each time). Idempotent: storage errors retried, and a
# retry extracts only the shards still without a row.
@task(name="coordinate-extraction", cache_policy=NO_CACHE, **TRANSIENT_IO)
def extract_shards(config: RunConfig, facts: RunFacts) -> dict:
    """Plan, start one worker per disjoint shard list, follow their progress, check every shard has its row."""
    with StageProgress("extract-progress", "extracting hidden states", "samples_done", "samples_total") as progress:
        summary = run_extraction(
            config.extract,
            facts,
            target_dtype=config.target.dtype,
            launch=prefect_launch(config, facts),
            progress=progress,
        )
    return summary.to_dict()


# Not cached: the manifest rows are its durable record. Storage errors retried; every attempt skips the
# worker's shards that already have a row (written by an earlier attempt), so a retry does only what is left.
@task(name="extract-worker-shards", cache_policy=NO_CACHE, **TRANSIENT_IO)
def extract_worker_shards(config: RunConfig, facts: RunFacts, worker_index: int, shard_indices: list[int]) -> dict:
    """Extract this worker's shards (disjoint from every other worker's) and record each one."""
    summary = run_worker(
        config.extract, facts, worker_index=worker_index, shard_indices=shard_indices, target_dtype=config.target.dtype
    )
    if summary.shards_already_recorded:
        print(f"worker {worker_index}: {summary.shards_already_recorded} of its shards already recorded, skipped")
    return summary.to_dict()


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


def prefect_launch(config: RunConfig, facts: RunFacts) -> Launch:
    """Start workers as concurrent tasks here, or as flow runs of `extract.worker_deployment`."""

    def launch(parts: list[list[int]], on_shard) -> list[Worker]:
        if config.extract.fanout == "local":
            return [LocalWorker(extract_worker_shards.submit(config, facts, k, part)) for k, part in enumerate(parts)]
        from prefect.context import get_run_context
        from prefect.deployments import run_deployment

        parent = get_run_context().task_run.flow_run_id
        workers = []
        for k, part in enumerate(parts):
            run = run_deployment(
                config.extract.worker_deployment,
                parameters={
                    "config": config.model_dump(mode="json"),
                    "facts": facts.model_dump(mode="json"),
                    "worker_index": k,
                    "shard_indices": part,
                },
                timeout=0,
                idempotency_key=f"{parent}-extract-worker-{k}",
            )
            workers.append(DeploymentWorker(run.id))
        return workers

    return launch
