"""Tasks of the extraction and verification stages."""

from __future__ import annotations

from prefect import task

from eyas.config import RunConfig
from eyas.extract import extract_hidden_states
from eyas.jobs import aux_layer_ids
from eyas.verify import (
    VerifyReport,
    expected_shard_meta,
    quarantine_bad_shards,
    verify_shards,
    write_verify_report,
)
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
def verify_shard_set(config: RunConfig, heal_round: int = 0) -> VerifyReport:
    """Check every shard against the manifest, the dataset and the run config; write the Parquet report."""
    expected = expected_shard_meta(
        target_path=config.target.model_path,
        aux_layer_ids=config.target.aux_layer_ids,
        dtype=config.extract.dtype,
        tokenized_path=config.paths.tokenized,
    )
    with StageProgress("verify-progress", "verifying shards", "shards_done", "shards_total") as progress:
        report = verify_shards(
            shards_dir=config.paths.shards_dir,
            tokenized_path=config.paths.tokenized,
            expected=expected,
            mode=config.verify.mode,
            num_workers=config.verify.num_workers,
            chunk_bytes=config.verify.chunk_bytes,
            progress=progress,
        )
    write_verify_report(report, config.paths.verify_report)
    s = report.summary()
    table_artifact(
        "shard-verification",
        report.outcome_table(),
        f"shard verification ({s['mode']} mode, healing round {heal_round}): {s['ok']} ok, {s['bad']} bad, "
        f"{s['problems']} directory problems, {s['gib_per_s']} GiB/s; per shard: {config.paths.verify_report}",
    )
    return report


@task(name="quarantine-shards")
def quarantine_bad(config: RunConfig, report: VerifyReport) -> list[str]:
    """Move the bad shards aside (with their reasons) and drop their manifest rows for re-extraction."""
    notes = quarantine_bad_shards(config.paths.shards_dir, report)
    for note in notes:
        print(f"quarantined: {note.read_text().strip()} -> {note.parent}")
    return [str(n) for n in notes]
