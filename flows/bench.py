"""Flow `benchmark-acceptance`: the exported draft on held-out prompts; a tau below the floor fails
the flow with a diagnosis of every known cause (eyas/diagnose.py), never a green run."""

from prefect import flow

from eyas.config import RunConfig
from tasks.bench import diagnose_low_tau, reference_benchmark, sglang_benchmark
from tasks.status import stage_status_artifact


class AcceptanceTooLow(RuntimeError):
    """tau_mean fell below the configured floor; the message carries the diagnosis."""


@flow(name="benchmark-acceptance", log_prints=True)
def bench_flow(config: RunConfig, export_dir: str | None = None) -> dict:
    export_dir = export_dir or str(config.paths.export_dir / "sglang")
    engine = sglang_benchmark if config.bench.engine == "sglang" else reference_benchmark
    result = engine(config, export_dir)
    stage_status_artifact(config, "bench")
    if result["tau_mean"] < config.bench.min_tau:
        diagnosis = diagnose_low_tau(config, export_dir, result)
        raise AcceptanceTooLow(
            f"tau_mean {result['tau_mean']:.3f} < bench.min_tau {config.bench.min_tau} "
            f"({result['engine']} engine; n-gram {result.get('tau_ngram')}, random {result.get('tau_random')}); "
            f"{diagnosis['conclusion']}\n{diagnosis['markdown']}\nsee {result['path']} and {diagnosis['path']}"
        )
    return result
