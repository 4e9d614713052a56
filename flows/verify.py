"""Flow `verify-shards`: every shard checked against its manifest row, the dataset and the config;
bad shards are quarantined with their reasons, re-extracted and verified again."""

from prefect import flow

from eyas.config import RunConfig
from eyas.facts import RunFacts
from eyas.verify.report import VerifyReport
from eyas.verify.shard_set import raise_if_bad
from flows.extract import extract_flow
from tasks.facts import check_run_inputs, resolve_run_facts
from tasks.status import stage_status_artifact
from tasks.verify import quarantine_bad, verify_shard_set


@flow(name="verify-shards", log_prints=True)
def verify_flow(config: RunConfig, facts: RunFacts | None = None) -> dict:
    """Verify every shard; quarantine, re-extract and re-verify bad ones up to num_heal_rounds times.

    `facts`: the run's resolved facts, which the pipeline passes; left empty, the flow resolves them."""
    if facts is None:  # run alone: its inputs are checked first (the pipeline checks every stage's at its start)
        check_run_inputs(config, ["verify"])
        facts = resolve_run_facts(config)
    report = verify_shard_set(config, facts)
    quarantined, rounds = [], 0
    while not report.ok and rounds < config.verify.num_heal_rounds:
        rounds += 1
        print(f"healing round {rounds}: {len(report.bad_files)} bad shards, {len(report.problems)} directory problems")
        quarantined += quarantine_bad(config, facts, report)
        extract_flow(config, facts)
        report = verify_shard_set(config, facts, heal_round=rounds)
    stage_status_artifact(config, "verify")
    raise_if_bad(report, heal_rounds=rounds)
    summary = {
        **report.summary(),
        "heal_rounds": rounds,
        "quarantined": len(quarantined),
        "report": str(config.paths.verify_report),
    }
    print(VerifyReport.describe(summary))
    return summary
