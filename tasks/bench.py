"""Tasks of the benchmark stage: reference or SGLang run, report artifacts, diagnosis of a low tau."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.bench import encode_prompts, run_benchmark, write_benchmark_json
from eyas.config import RunConfig
from eyas.dataset import read_prompts
from eyas.diagnose import diagnose
from tasks.reporting import markdown_artifact, markdown_table, png_artifact, table_artifact
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
    "lossless",
)


def _prompts(config: RunConfig) -> list:
    return [r["conversations"] for r in read_prompts(config.bench.prompts_path, config.bench.num_prompts)]


# A measurement: never cached. Not retried: compute on local files; its failures (e.g. speculative output
# differing from greedy) are deterministic.
@task(name="reference-benchmark", cache_policy=NO_CACHE)
def reference_benchmark(config: RunConfig, export_dir: str) -> dict:
    """Speculative decoding with the exported draft, the n-gram drafter and greedy decoding on held-out prompts."""
    b = config.bench
    result = run_benchmark(
        config.target.model_path,
        export_dir,
        _prompts(config),
        steps=b.steps,
        max_new_tokens=b.max_new_tokens,
        topk=b.topk,
        num_draft_tokens=b.draft_tokens,
        ngram_max_n=b.ngram_max_n,
    )
    return _publish(result, config.paths.bench_dir)


# A measurement: never cached. Calls a server: dropped connections and timeouts retried (a retry
# launches the server again); a server that does not start is not transient.
@task(name="sglang-benchmark", cache_policy=NO_CACHE, **TRANSIENT_IO)
def sglang_benchmark(config: RunConfig, export_dir: str) -> dict:
    """Launch SGLang with the draft and without it, run the held-out prompts on both, stop it."""
    from eyas.bench_sglang import SglangLaunch, run_sglang_benchmark
    from eyas.data import ShardSamples

    b = config.bench
    launch = SglangLaunch(
        target_path=config.target.model_path,
        draft_path=export_dir,
        steps=b.steps,
        topk=b.topk,
        num_draft_tokens=b.draft_tokens,
        port=b.sglang_port,
        extra_args=tuple(b.sglang_extra_args),
    )
    result = run_sglang_benchmark(
        launch,
        encode_prompts(_prompts(config), config.target.model_path),
        max_new_tokens=b.max_new_tokens,
        concurrency=b.sglang_concurrency,
        startup_timeout_s=b.sglang_startup_timeout_s,
        shard_aux_layer_ids=ShardSamples(config.paths.shards_dir).metadata["aux_layer_ids"],
        log_dir=config.paths.bench_dir,
    )
    return _publish(result, config.paths.bench_dir)


def _publish(result: dict, bench_dir: Path) -> dict:
    path = write_benchmark_json(result, bench_dir / "benchmark.json")
    report_benchmark(result, path)
    return {**result, "path": str(path)}


def report_benchmark(result: dict, path: Path) -> None:
    """Markdown + table artifacts, acceptance.png beside benchmark.json and as an image artifact."""
    from eyas.bench_plots import acceptance_figure

    rows = [{"metric": k, "value": _fmt(result.get(k))} for k in SUMMARY_KEYS if k in result]
    per_pos = [
        {"position": i + 1, "eyas": _fmt(r), "n-gram": _fmt(_at(result, "accept_rate_per_position_ngram", i))}
        for i, r in enumerate(result.get("accept_rate_per_position") or [])
    ]
    markdown_artifact(
        "benchmark",
        f"# Acceptance ({result['engine']} engine)\n\n{markdown_table(rows)}\n\n"
        f"## Acceptance per position\n\n{markdown_table(per_pos)}\n\n`{path}`",
        "acceptance benchmark",
    )
    table_artifact("benchmark-table", rows, "acceptance benchmark: summary")
    fig = acceptance_figure(result)
    fig.savefig(path.parent / "acceptance.png", dpi=100, bbox_inches="tight")
    png_artifact("acceptance-plots", fig, "acceptance per position and tau over prompts")
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(json.dumps({k: result[k] for k in SUMMARY_KEYS if k in result}))


def _at(result: dict, key: str, i: int):
    values = result.get(key) or []
    return values[i] if i < len(values) else None


def _fmt(value):
    return round(value, 3) if isinstance(value, float) else value


# Not cached, not retried: checks on local files, run once when the benchmark fails.
@task(name="diagnose-low-tau", cache_policy=NO_CACHE)
def diagnose_low_tau(config: RunConfig, export_dir: str, result: dict) -> dict:
    """Every known cause of a low tau, checked; written to diagnosis.json and shown as an artifact."""
    report = diagnose(
        export_dir=export_dir,
        shards_dir=config.paths.shards_dir,
        target_path=config.target.model_path,
        tau=result["tau_mean"],
        launch_argv=result.get("launch_command"),
        num_samples=config.bench.diagnose_num_samples,
        steps=config.bench.steps,
        min_accuracy=config.bench.min_teacher_forced_accuracy,
    )
    path = config.paths.bench_dir / "diagnosis.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    markdown_artifact("benchmark-diagnosis", f"# Why tau is low\n\n{report.to_markdown()}", "low-tau diagnosis")
    return {**report.to_dict(), "path": str(path), "markdown": report.to_markdown()}
