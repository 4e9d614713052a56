"""Tasks of the benchmark stage: the acceptance run (reference or SGLang), its artifacts, the diagnosis of a low tau."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.bench.acceptance import PLOTS_FILE, bench_run, describe_benchmark
from eyas.bench.diagnose import DIAGNOSIS_FILE, diagnose_run
from eyas.bench.plots import acceptance_figure
from eyas.config import RunConfig
from eyas.markdown import dict_table
from tasks.reporting import StageProgress, markdown_artifact, png_artifact, table_artifact
from tasks.retry import TRANSIENT_IO

SUMMARY_KEYS = (
    "engine",
    "tau_mean",
    "tau_ngram",
    "tau_random",
    "tau_ratio_vs_ngram",
    "speedup_vs_greedy",
    "wall_s_speculative",
    "wall_s_greedy",
    "steps",
    "topk",
    "num_draft_tokens",
    "num_prompts",
    "num_threads",
    "lossless",
)


# A measurement: never cached. Retried only on transient errors (a dropped connection to a server: a retry launches
# it again); compute on local files (the reference engine) fails deterministically, e.g. output differing from greedy.
@task(name="acceptance-benchmark", cache_policy=NO_CACHE, **TRANSIENT_IO)
def acceptance_benchmark(config: RunConfig, export_dir: str) -> dict:
    """The exported draft on held-out prompts on the configured engine (reference or SGLang), next to baselines."""
    with StageProgress(
        "bench-progress", "acceptance benchmark", done_key="prompts_done", total_key="prompts_total"
    ) as progress:
        result = bench_run(config, export_dir, progress=progress)
    report_benchmark(result, Path(result["path"]))
    return result


def report_benchmark(result: dict, path: Path) -> None:
    """Markdown + table artifacts, acceptance.png beside benchmark.json and as an image artifact."""
    rows = [{"metric": k, "value": _fmt(result.get(k))} for k in SUMMARY_KEYS if k in result]
    per_pos = [
        {"position": i + 1, "eyas": _fmt(r), "n-gram": _fmt(_at(result, "accept_rate_per_position_ngram", i))}
        for i, r in enumerate(result.get("accept_rate_per_position") or [])
    ]
    markdown_artifact(
        "benchmark",
        f"# Acceptance ({result['engine']} engine)\n\n{dict_table(rows)}\n\n"
        f"## Acceptance per position\n\n{dict_table(per_pos)}\n\n`{path}`",
        "acceptance benchmark",
    )
    table_artifact("benchmark-table", rows, "acceptance benchmark: summary")
    fig = acceptance_figure(result)
    fig.savefig(path.parent / PLOTS_FILE, dpi=100, bbox_inches="tight")
    png_artifact("acceptance-plots", fig, "acceptance per position and tau over prompts")
    import matplotlib.pyplot as plt

    plt.close(fig)
    print("\n".join(describe_benchmark(result)))


def _at(result: dict, key: str, i: int):
    values = result.get(key) or []
    return values[i] if i < len(values) else None


def _fmt(value):
    return round(value, 3) if isinstance(value, float) else value


# Not cached, not retried: checks on local files, run once when the benchmark fails.
@task(name="diagnose-low-tau", cache_policy=NO_CACHE)
def diagnose_low_tau(config: RunConfig, export_dir: str, result: dict) -> dict:
    """Every known cause of a low tau, checked; written to diagnosis.json and shown as an artifact."""
    report = diagnose_run(config, export_dir, result)
    markdown_artifact("benchmark-diagnosis", f"# Why tau is low\n\n{report.to_markdown()}", "low-tau diagnosis")
    path = config.paths.bench_dir / DIAGNOSIS_FILE
    return {**report.to_dict(), "path": str(path), "markdown": report.to_markdown()}
