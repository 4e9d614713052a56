"""Tasks of the export stage."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.export.convert import export_run
from tasks.retry import TRANSIENT_IO


# Not cached: cheap, and must follow the checkpoints (the BEST marker moves). Local file I/O errors retried.
@task(name="export-sglang", cache_policy=NO_CACHE, **TRANSIENT_IO)
def export_checkpoint(config: RunConfig) -> str:
    """Remap the checkpoint export.checkpoint chooses (best or last) to SGLang's format, checked against its exact
    key set."""
    return str(export_run(config))
