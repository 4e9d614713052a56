"""Tasks of the verification stage."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.verify.report import VerifyReport
from eyas.verify.shard_set import quarantine_run, verify_run
from tasks.caching import cached_by
from tasks.reporting import StageProgress, table_artifact
from tasks.retry import TRANSIENT_IO


# Cached by the manifest, the shard files themselves (size, times, first MiB: a file changed since cannot come
# back "ok" from the cache) and the tokenized table, while the report is the file it wrote; storage errors retried.
@task(
    name="verify-shards",
    **cached_by(("target", "extract", "verify"), ("tokenized", "manifest", "shard_files"), outputs=("verify_report",)),
    **TRANSIENT_IO,
)
def verify_shard_set(config: RunConfig, facts: RunFacts, heal_round: int = 0) -> VerifyReport:
    """Check every shard against the manifest, the dataset and the run config; write the Parquet report."""
    with StageProgress("verify-progress", "verifying shards", "shards_done", "shards_total") as progress:
        report = verify_run(config, facts, progress=progress)
    s = report.summary()
    table_artifact(
        "shard-verification",
        report.outcome_table(),
        f"shard verification ({s['mode']} mode, healing round {heal_round}): {s['ok']} ok, {s['bad']} bad, "
        f"{s['problems']} directory problems, {s['gib_per_s']} GiB/s; per shard: {config.paths.verify_report}",
    )
    return report


# Neither cached nor retried: it moves files; after a partial move a re-run verifies again instead.
@task(name="quarantine-shards", cache_policy=NO_CACHE)
def quarantine_bad(config: RunConfig, facts: RunFacts, report: VerifyReport) -> list[str]:
    """Move the bad shards aside (with their reasons) and drop their manifest rows for re-extraction."""
    notes = quarantine_run(config, facts, report)
    for reason, note in zip((report.bad_reasons[n] for n in sorted(report.bad_reasons)), notes):
        print(f"quarantined: {reason} -> {note}")
    return notes
