"""Flow `extract-stream`: the producer of a streamed run alone (extraction in the trainer's first-need order, each
shard verified as it commits), so that it can run on its own work pool while a training flow run reads the shards
as their verdicts appear."""

from prefect import flow

from eyas.config import RunConfig
from eyas.extract.coordinator import summary_sentence
from eyas.facts import RunFacts
from tasks.facts import check_run_inputs, resolve_run_facts
from tasks.status import stage_status_artifact
from tasks.stream import extract_stream


@flow(name="extract-stream", log_prints=True)
def extract_stream_flow(config: RunConfig, facts: RunFacts | None = None) -> dict:
    """Extract and verify every planned shard, those the trainer needs first first; resumes what a crash left.

    `facts`: the run's resolved facts, which the pipeline passes; left empty, the flow resolves them."""
    if facts is None:  # run alone: its inputs are checked first (the pipeline checks every stage's at its start)
        check_run_inputs(config, ["extract"])
        facts = resolve_run_facts(config)
    summary = extract_stream(config, facts)
    print(summary_sentence(summary))
    stage_status_artifact(config, "extract")
    return summary
