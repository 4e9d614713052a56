"""Flow `benchmark-acceptance`: the reference engine on held-out prompts with the exported draft."""

from __future__ import annotations

from prefect import flow

from eyas.config import RunConfig
from tasks.export import reference_benchmark


class AcceptanceTooLow(RuntimeError):
    """tau_mean fell below the configured floor."""


@flow(name="benchmark-acceptance", log_prints=True)
def bench_flow(config: RunConfig, export_dir: str | None = None) -> dict:
    export_dir = export_dir or str(config.paths.export_dir / "sglang")
    result = reference_benchmark(config, export_dir)
    if result["tau_mean"] < config.bench.min_tau:
        raise AcceptanceTooLow(
            f"tau_mean {result['tau_mean']:.3f} < bench.min_tau {config.bench.min_tau} (random draft: "
            f"{result['tau_random']:.3f}); see {result['path']}"
        )
    return result
