"""Flow `export-drafter`: newest complete checkpoint -> SGLang format, strictly key-checked."""

from prefect import flow

from eyas.config import RunConfig
from tasks.export import export_checkpoint


@flow(name="export-drafter", log_prints=True)
def export_flow(config: RunConfig) -> str:
    return export_checkpoint(config)
