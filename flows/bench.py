"""Flow `benchmark-acceptance`: the exported draft on held-out prompts; a tau below the floor fails
the flow with a diagnosis of every known cause (eyas.bench.diagnose), never a green run."""

from prefect import flow

from eyas.config import RunConfig
from eyas.export.convert import SGLANG_EXPORT
from tasks.bench import acceptance_benchmark, diagnose_low_tau
from tasks.facts import check_run_inputs
from tasks.status import stage_status_artifact


class AcceptanceTooLow(RuntimeError):
    """tau_mean fell below the configured floor; the message carries the diagnosis."""


@flow(name="benchmark-acceptance", log_prints=True)
def bench_flow(config: RunConfig, export_dir: str | None = None) -> dict:
    """Measure acceptance of the exported draft (bench.engine: reference or SGLang); below bench.min_tau the run
    fails with the diagnosis. `export_dir`: default RUN/export/sglang."""
    check_run_inputs(config, ["bench"])  # the held-out prompts, before the target loads
    export_dir = export_dir or str(config.paths.export_dir / SGLANG_EXPORT)
    result = acceptance_benchmark(config, export_dir)
    stage_status_artifact(config, "bench")
    if result["tau_mean"] < config.bench.min_tau:
        diagnosis = diagnose_low_tau(config, export_dir, result)
        raise AcceptanceTooLow(
            f"tau_mean {result['tau_mean']:.3f} < bench.min_tau {config.bench.min_tau} "
            f"({result['engine']} engine; n-gram {result.get('tau_ngram')}, random {result.get('tau_random')}); "
            f"{diagnosis['conclusion']}\n{diagnosis['markdown']}\nsee {result['path']} and {diagnosis['path']}"
        )
    return result
