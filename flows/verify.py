"""Flow `verify-shards`: every shard checked against its manifest row, the dataset and the config."""

from __future__ import annotations

from prefect import flow

from eyas.config import RunConfig
from tasks.extract import verify_shard_set


@flow(name="verify-shards", log_prints=True)
def verify_flow(config: RunConfig) -> dict:
    summary = verify_shard_set(config)
    print(f"verification: {summary}")
    return summary
