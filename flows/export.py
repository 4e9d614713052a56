"""Flow `export-drafter`: newest complete checkpoint -> SGLang format, strictly key-checked."""

from prefect import flow

from eyas.config import RunConfig
from tasks.export import export_checkpoint
from tasks.facts import check_run_inputs
from tasks.status import stage_status_artifact


@flow(name="export-drafter", log_prints=True)
def export_flow(config: RunConfig) -> str:
    """Export the newest complete checkpoint to SGLang's format, checked against its exact key set."""
    check_run_inputs(config, ["export"])
    export_dir = export_checkpoint(config)
    stage_status_artifact(config, "export")
    return export_dir
