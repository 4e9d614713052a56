"""The approval gate: the flow pauses with a typed input until a person approves or rejects training.

Answer it from the Prefect UI (run page -> Resume), from the CLI (`eyas approve RUN_ID
[--reject] [--note ...]`) or through the API (`resume_flow_run(id, run_input={...})`).
An approval is recorded in the run's workdir with the config's fingerprint: re-running the same
configuration does not ask again; a changed one does.
"""

import json
from datetime import datetime, timezone

from prefect.artifacts import create_markdown_artifact
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from pydantic import Field

from eyas.config import RunConfig
from eyas.fsio import atomic_write_text

GATE_SECTIONS = ("target", "dataset", "extract", "draft", "train")


class TrainingApproval(RunInput):
    approve: bool = Field(default=False, description="tick to start the training run; leave unticked to reject")
    reviewer: str = Field(min_length=1, description="who decides")
    note: str = Field(default="", description="why (shown in the decision artifact)")


class TrainingRejected(RuntimeError):
    """A person rejected the training run at the approval gate, or nobody answered in time."""


def approval_gate(config: RunConfig, summary_md: str) -> TrainingApproval:
    """Pause until answered; returns the approval or raises TrainingRejected (training never starts)."""
    record_path = config.paths.root / "approval.json"
    fingerprint = config.fingerprint(*GATE_SECTIONS)
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record["approve"] and record["config_fingerprint"] == fingerprint:
            print(f"approval already given by {record['reviewer']} at {record['decided_at']} for this configuration")
            return TrainingApproval(approve=True, reviewer=record["reviewer"], note=record["note"])
    print("waiting for approval: answer in the UI (Resume), or `eyas approve <flow-run-id> [--reject]`")
    answer = pause_flow_run(
        # only the description is passed: initial values given here would drop the fields' constraints
        wait_for_input=TrainingApproval.with_initial_data(description=summary_md),
        timeout=config.approval.timeout_s,
        poll_interval=2,
    )
    record = {
        **answer.model_dump(include={"approve", "reviewer", "note"}),
        "config_fingerprint": fingerprint,
        "decided_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    create_markdown_artifact(
        key="approval-decision",
        markdown=f"## Training {'approved' if answer.approve else 'REJECTED'}\n\n"
        f"| reviewer | decided at | note | config fingerprint |\n|---|---|---|---|\n"
        f"| {answer.reviewer} | {record['decided_at']} | {answer.note or '-'} | `{fingerprint}` |\n",
        description="approval gate decision",
    )
    if not answer.approve:
        raise TrainingRejected(
            f"training rejected by {answer.reviewer}: {answer.note or 'no note'}; nothing was trained"
        )
    config.paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(record_path, json.dumps(record, indent=2))
    return answer
