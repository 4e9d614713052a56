"""Tasks of the export stage (the benchmark's are in tasks/bench.py)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.checkpoint import latest_complete
from eyas.config import RunConfig
from eyas.export import export_sglang
from tasks.retry import TRANSIENT_IO


# Not cached: cheap, and must follow the newest checkpoint. Local file I/O errors retried.
@task(name="export-sglang", cache_policy=NO_CACHE, **TRANSIENT_IO)
def export_checkpoint(config: RunConfig) -> str:
    """Remap the newest complete checkpoint to SGLang's format, checked against its exact key set."""
    checkpoint = latest_complete(config.paths.train_dir)
    if checkpoint is None:
        raise FileNotFoundError(
            f"export: no complete checkpoint under {config.paths.train_dir}/checkpoints; run the train stage first"
        )
    out = export_sglang(checkpoint, config.paths.export_dir / "sglang", dtype=config.export.dtype)
    print(f"exported {checkpoint.name} -> {out}")
    return str(out)
