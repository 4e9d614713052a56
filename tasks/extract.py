"""Tasks of the extraction and verification stages."""

from __future__ import annotations

from dataclasses import asdict

from prefect import task

from eyas.config import RunConfig
from eyas.extract import extract_hidden_states
from eyas.jobs import aux_layer_ids
from eyas.verify import expected_shard_meta, raise_if_bad, verify_shards, write_verify_report
from tasks.reporting import StageProgress, table_artifact


@task(name="extract-shards")
def extract_shards(config: RunConfig) -> dict:
    """Extract the missing shards of the plan (finished ones, in the manifest, are skipped)."""
    with StageProgress("extract-progress", "extracting hidden states", "samples_done", "samples_total") as progress:
        summary = extract_hidden_states(
            tokenized_path=config.paths.tokenized,
            shards_dir=config.paths.shards_dir,
            target_path=config.target.model_path,
            aux_layer_ids=aux_layer_ids(config),
            extract_cfg=config.extract,
            target_dtype=config.target.dtype,
            progress=progress,
        )
    return summary.to_dict()


@task(name="verify-shards")
def verify_shard_set(config: RunConfig) -> dict:
    """Check every shard against the manifest, the dataset and the run config; fail on any bad shard."""
    expected = expected_shard_meta(
        target_path=config.target.model_path,
        aux_layer_ids=config.target.aux_layer_ids,
        dtype=config.extract.dtype,
        tokenized_path=config.paths.tokenized,
    )
    report = verify_shards(
        shards_dir=config.paths.shards_dir,
        tokenized_path=config.paths.tokenized,
        expected=expected,
        mode=config.verify.mode,
    )
    write_verify_report(report, config.paths.verify_report)
    summary = report.summary()
    rows = [{**asdict(r), "checks_passed": ", ".join(r.checks_passed)} for r in report.rows]
    table_artifact(
        "shard-verification",
        rows,
        f"shard verification ({config.verify.mode} mode): {summary['ok']} ok, {summary['bad']} bad",
    )
    raise_if_bad(report)
    return summary
