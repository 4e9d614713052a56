"""Tasks of the export stage (the benchmark's are in tasks/bench.py)."""

from __future__ import annotations

from prefect import task

from eyas.checkpoint import latest_complete
from eyas.config import RunConfig
from eyas.export import export_sglang


@task(name="export-sglang")
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
