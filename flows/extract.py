"""Flows `extract-hidden-states` (the coordinator and its workers) and `extract-worker` (one worker's shards)."""

from prefect import flow

from eyas.config import RunConfig
from eyas.extract.coordinator import summary_sentence
from eyas.facts import RunFacts
from tasks.extract import extract_shards, extract_worker_shards
from tasks.facts import check_run_inputs, resolve_run_facts
from tasks.status import stage_status_artifact


@flow(name="extract-hidden-states", log_prints=True)
def extract_flow(config: RunConfig, facts: RunFacts | None = None) -> dict:
    """Extract the shards the manifest lacks with extract.num_workers workers, each on disjoint shards.

    `facts`: the run's resolved facts, which the pipeline passes; left empty, the flow resolves them."""
    if facts is None:  # run alone: its inputs are checked first (the pipeline checks every stage's at its start)
        check_run_inputs(config, ["extract"])
        facts = resolve_run_facts(config)
    summary = extract_shards(config, facts)
    print(summary_sentence(summary))
    stage_status_artifact(config, "extract")
    return summary


@flow(name="extract-worker", log_prints=True)
def extract_worker_flow(config: RunConfig, facts: RunFacts, worker_index: int, shard_indices: list[int]) -> dict:
    """One worker of a fanned-out extraction (extract.fanout = 'deployment'): these shards only."""
    return extract_worker_shards(config, facts, worker_index, shard_indices)
