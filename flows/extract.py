"""Flow `extract-hidden-states`: the target's aux and last hidden states into verified-able shards."""

from __future__ import annotations

from prefect import flow

from eyas.config import RunConfig
from tasks.extract import extract_shards


@flow(name="extract-hidden-states", log_prints=True)
def extract_flow(config: RunConfig) -> dict:
    summary = extract_shards(config)
    print(f"extraction: {summary}")
    return summary
