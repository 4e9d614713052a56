"""Tasks of the export and benchmark stages."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task

from eyas.bench import run_benchmark, write_benchmark_json
from eyas.checkpoint import latest_complete
from eyas.config import RunConfig
from eyas.dataset import read_prompts
from eyas.export import export_sglang
from tasks.reporting import markdown_artifact, markdown_table, png_artifact


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


@task(name="reference-benchmark")
def reference_benchmark(config: RunConfig, export_dir: str) -> dict:
    """Speculative decoding with the exported draft on held-out prompts; lossless vs greedy or it fails."""
    rows = read_prompts(config.bench.prompts_path, config.bench.num_prompts)
    prompts = [r["conversations"] for r in rows]
    result = run_benchmark(
        config.target.model_path,
        export_dir,
        prompts,
        steps=config.bench.steps,
        max_new_tokens=config.bench.max_new_tokens,
    )
    path = write_benchmark_json(result, config.paths.bench_dir / "benchmark.json")
    report_benchmark(result, path)
    return {**result, "path": str(path)}


def report_benchmark(result: dict, path: Path) -> None:
    rows = [{"metric": k, "value": result[k]} for k in ("tau_mean", "tau_random", "steps", "num_prompts", "lossless")]
    per_pos = [
        {"position": i + 1, "accept_rate": round(r, 3)} for i, r in enumerate(result["accept_rate_per_position"])
    ]
    markdown_artifact(
        "benchmark",
        f"# Acceptance (reference engine)\n\n{markdown_table(rows)}\n\n"
        f"## Per position\n\n{markdown_table(per_pos)}\n\n`{path}`",
        "acceptance benchmark",
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.bar([p["position"] for p in per_pos], [p["accept_rate"] for p in per_pos])
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("acceptance rate")
    ax1.set_ylim(0, 1)
    ax2.hist([t for t in result["tau_per_prompt"] if t is not None], bins=10)
    ax2.axvline(result["tau_random"], color="r", ls="--", label="random draft")
    ax2.set_xlabel("tau per prompt")
    ax2.legend()
    png_artifact("acceptance-plots", fig, "acceptance per position and tau over prompts")
    plt.close(fig)
    print(json.dumps({k: result[k] for k in ("tau_mean", "tau_random", "num_prompts", "steps")}))
