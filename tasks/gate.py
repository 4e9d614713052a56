"""The approval gate: the run waits with a typed form until a person approves or rejects training.

Answer it from the Prefect UI (run page -> Resume), from the CLI (`eyas approve RUN_ID [--reject]
[--note ...]`) or through the API (`resume_flow_run(id, run_input={...})`). The server checks the
answer against the form's JSON schema and refuses a bad one; the run keeps waiting.

- A run of a deployment SUSPENDS: its process exits and holds no GPU while it waits; once answered,
  the worker runs the flow again from the top, the stages before the gate come back from cache
  (tasks/caching.py) and the gate returns the stored answer. A run started in-process (`eyas run`,
  tests) PAUSES: its process waits.
- Reject: the run fails with the reviewer and the note in its state message; nothing is trained.
  Timeout (approval.timeout_s): a paused run fails with the reason in its state message; a
  suspended one is failed by the Prefect server ("The flow was paused and never resumed.").
- Every decision is a markdown artifact `approval-decision` (who, when, note, overrides, config
  fingerprint). An approval is recorded in the workdir (eyas.gate.approval): re-running the same
  configuration does not ask again; a changed one does.
- Overrides (`num_epochs`, `lr` of the training run) are offered only to callers that apply them;
  one that would not change the training run (eyas.gate.approval.ignored_overrides) is refused and the
  gate asks again, showing why.
"""

import time
from datetime import datetime, timedelta, timezone
from typing import Annotated

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.events import emit_event
from prefect.events.filters import EventFilter, EventIDFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run, suspend_flow_run
from prefect.input import RunInput
from prefect.settings import get_current_settings
from prefect.states import Failed
from pydantic import ConfigDict, Field, WithJsonSchema

from eyas.config import RunConfig
from eyas.dataset.table import tokenized_num_samples
from eyas.facts import RunFacts
from eyas.fsio import atomic_write_text
from eyas.gate import GATE_SUSPENDING_EVENT
from eyas.gate.approval import (
    OVERRIDABLE,
    gate_fingerprint,
    ignored_overrides,
    read_approval,
    write_approval,
    write_rejection,
)
from eyas.gate.summary import SUMMARY_FILE, GateSummary
from eyas.gate.summary import gate_summary as summaries
from eyas.markdown import table
from eyas.train.node_agents import with_rendezvous_at
from tasks.nodes import this_node_address

MAX_ASKS = 3  # answers with refused overrides before the gate gives up


class TrainingApproval(RunInput):
    # extra="forbid": the server refuses unknown fields (JSON schema additionalProperties: false)
    model_config = ConfigDict(extra="forbid")

    approve: bool = Field(default=False, description="tick to start the training run; leave unticked to reject")
    reviewer: str = Field(min_length=1, description="who decides")
    note: str = Field(default="", description="why (shown in the decision artifact)")

    def overrides(self) -> dict:
        """The training overrides given (none on this form)."""
        return {name: getattr(self, name) for name in OVERRIDABLE if getattr(self, name, None) is not None}


def _plain_optional(schema: dict) -> None:
    schema.pop("default", None)  # no `null` default: the UI shows an empty number box, and leaving it empty omits it


# The overrides' schema is a plain number (not `integer | null`, which the UI renders as a type switch reading
# 'Property is type "None"'); left empty, the field is absent and the model's None applies.
OptionalEpochs = Annotated[int | None, WithJsonSchema({"type": "integer", "minimum": 1})]
OptionalLr = Annotated[float | None, WithJsonSchema({"type": "number", "exclusiveMinimum": 0})]


class TrainingApprovalWithOverrides(TrainingApproval):
    num_epochs: OptionalEpochs = Field(
        default=None,
        ge=1,
        description="train.num_epochs for this run; empty = as configured",
        json_schema_extra=_plain_optional,
    )
    lr: OptionalLr = Field(
        default=None,
        gt=0,
        description="train.lr (AdamW peak) for this run; empty = as configured",
        json_schema_extra=_plain_optional,
    )


class TrainingRejected(RuntimeError):
    """A person rejected the training run at the approval gate, or nobody answered in time."""


# Formatting of its inputs: cheap, not cached, nothing to retry.
@task(name="gate-summary", cache_policy=NO_CACHE)
def gate_summary(
    config: RunConfig,
    facts: RunFacts,
    dataset: dict,
    verified: dict,
    smoke: dict,
    devices: dict,
    extracted: dict | None = None,
) -> GateSummary:
    """What a reviewer sees: above the approval form, in the terminal, and in full as an artifact (`extracted`: a
    streamed run's extraction of the smoke run's shards)."""
    if config.train.num_nodes != 1 and config.train.node_deployment and not config.train.rdzv_endpoint:
        config = with_rendezvous_at(config, this_node_address())  # the command the launch will run here
    return summaries(
        config, facts, dataset=dataset, verified=verified, smoke=smoke, devices=devices, extracted=extracted
    )


def publish_summary(config: RunConfig, summary: GateSummary) -> str:
    """The terminal's copy in the workdir and the complete summary as an artifact; returns the dialog's
    Markdown, which links to that artifact."""
    config.paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config.paths.root / SUMMARY_FILE, summary.terminal + "\n")
    artifact_id = create_markdown_artifact(
        key="gate-summary", markdown=summary.full, description="approval gate: the complete summary"
    )
    return f"{summary.dialog}\n\n[The complete summary]({'/artifacts/artifact/' + str(artifact_id)}) (every table)."


def approval_gate(
    config: RunConfig, summary: GateSummary | str, *, num_samples: int | None = None, accept_overrides: bool = False
) -> TrainingApproval:
    """Wait until answered; returns the approval or raises TrainingRejected (training never starts). Called in a
    flow run (not a task): the pause or suspension is the flow run's.

    num_samples: the training samples, against which an override of num_epochs is checked (None: counted from the
    tokenized table when one is given). accept_overrides: the
    caller applies `answer.overrides()` to the training run (eyas.gate.approval.apply_overrides)."""
    form = TrainingApprovalWithOverrides if accept_overrides else TrainingApproval
    record = read_approval(config)
    if record is not None and (accept_overrides or not record.get("overrides")):
        print(f"approval already given by {record['reviewer']} at {record['decided_at']} for this configuration")
        decision_artifact(record, reused=True)
        return form(**{k: record[k] for k in ("approve", "reviewer", "note")}, **record.get("overrides", {}))
    if isinstance(summary, str):
        summary = GateSummary.plain(summary)
    form_md = publish_summary(config, summary) + (overrides_help(config) if accept_overrides else "")
    description = form_md
    for ask in range(1, MAX_ASKS + 1):
        answer = wait_for_answer(config, form.with_initial_data(description=description), key=f"approval-gate-{ask}")
        problems = refused_overrides(config, answer, num_samples)
        if not problems:
            break
        decision_artifact(decision_record(config, answer, refused=problems))
        refusal = "\n".join(f"- {p}" for p in problems)
        print(f"overrides refused, asking again:\n{refusal}")
        description = f"# Overrides refused\n\n{refusal}\n\nAnswer again.\n\n{form_md}"
    else:
        raise TrainingRejected(
            f"approval gate: overrides refused {MAX_ASKS} times ({problems[0]}); nothing was trained"
        )
    record = decision_record(config, answer)
    decision_artifact(record)
    if not answer.approve:
        write_rejection(config, record)
        raise TrainingRejected(
            f"training rejected by {answer.reviewer}: {answer.note or 'no note'}; nothing was trained"
        )
    write_approval(config, record)
    return answer


def wait_for_answer(config: RunConfig, form: type[TrainingApproval], key: str) -> TrainingApproval:
    """Suspend a deployment's top-level run (no process held), pause any other run; returns the answer."""
    run = FlowRunContext.get().flow_run
    timeout_s = config.approval.timeout_s
    print("waiting for approval: answer in the UI (Resume), or `eyas approve <flow-run-id> [--reject]`")
    if run.deployment_id is not None and run.parent_task_run_id is None:
        just_after_a_heartbeat(run.id)
        announce_suspension(run.id)
        return suspend_flow_run(wait_for_input=form, timeout=timeout_s, key=key)
    try:
        return pause_flow_run(wait_for_input=form, timeout=timeout_s, poll_interval=2, key=key)
    except FlowPauseTimeout:
        reason = f"approval gate: nobody answered within approval.timeout_s={timeout_s} s; nothing was trained"
        record = {
            "decision": "timed out",
            "approve": False,
            "reviewer": "nobody",
            "note": reason,
            "config_fingerprint": gate_fingerprint(config),
            "decided_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "flow_run_id": str(run.id),
        }
        decision_artifact(record)
        write_rejection(config, record)
        # Once the pause has expired the server turns any state the flow proposes into its own
        # "The flow was paused and never resumed.": set the reason first (forced), then fail with it.
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run.id, Failed(message=reason), force=True)
        raise TrainingRejected(reason) from None


def refused_overrides(config: RunConfig, answer: TrainingApproval, num_samples: int | None) -> list[str]:
    overrides = answer.overrides()
    if not answer.approve or not overrides:
        return []
    if num_samples is None:
        num_samples = tokenized_num_samples(config.paths.tokenized) if "num_epochs" in overrides else 0
    return ignored_overrides(config, overrides, num_samples=num_samples)


def overrides_help(config: RunConfig) -> str:
    current = ", ".join(f"`train.{name}` = {getattr(config.train, name)}" for name in OVERRIDABLE)
    return f"\n\n## Overrides\n\nOptional, for this training run only (leave empty to keep): {current}."


def decision_record(config: RunConfig, answer: TrainingApproval, refused: list[str] | None = None) -> dict:
    decision = "overrides refused" if refused else ("approved" if answer.approve else "rejected")
    return {
        **answer.model_dump(include={"approve", "reviewer", "note"}),
        "decision": decision,
        "overrides": answer.overrides(),
        "refused": refused or [],
        "config_fingerprint": gate_fingerprint(config),
        "decided_at": answered_at(answer),
        "flow_run_id": str(FlowRunContext.get().flow_run.id),
    }


def answered_at(answer: TrainingApproval) -> str:
    """When the server received the answer (a run resumed from a suspension processes it later)."""
    run_id, key = FlowRunContext.get().flow_run.id, answer.metadata.key
    with get_client(sync_client=True) as client:
        stored = [i for i in client.filter_flow_run_input(run_id, key, limit=1, exclude_keys=set()) if i.key == key]
    when = stored[0].created if stored and stored[0].created else datetime.now(timezone.utc)
    return when.astimezone(timezone.utc).isoformat(timespec="seconds")


def decision_artifact(record: dict, reused: bool = False) -> None:
    decision = record.get("decision", "approved")
    title = f"Training {decision}" + (" (an earlier approval of this configuration)" if reused else "")
    overrides = ", ".join(f"train.{k} = {v}" for k, v in record.get("overrides", {}).items()) or "-"
    rows = [
        ("decision", decision),
        ("reviewer", record.get("reviewer", "-")),
        ("decided at", record.get("decided_at", datetime.now(timezone.utc).isoformat(timespec="seconds"))),
        ("note", record.get("note") or "-"),
        ("overrides", overrides),
        ("config fingerprint", f"`{record['config_fingerprint']}`"),
    ]
    rows += [("refused", problem) for problem in record.get("refused", [])]
    create_markdown_artifact(
        key="approval-decision",
        markdown=f"## {title}\n\n{table(['', ''], [list(r) for r in rows])}\n",
        description="approval gate decision",
    )


HEARTBEAT_EVENT = "prefect.flow-run.heartbeat"
MIN_HEARTBEAT_S = 30  # prefect.flow_engine.MINIMUM_HEARTBEAT_INTERVAL: a shorter frequency beats every 30 s
BEAT_MARGIN_S = 10  # suspend only while the next heartbeat is at least this far off


def newest_heartbeat(flow_run_id, within_s: float) -> datetime | None:
    """When the flow run's newest heartbeat the server has stored occurred (the emitting process's clock, which
    is this one's), looking back `within_s`; None when none is stored."""
    now = datetime.now(timezone.utc)
    only = EventFilter(
        event=EventNameFilter(name=[HEARTBEAT_EVENT]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
        occurred=EventOccurredFilter(since=now - timedelta(seconds=within_s), until=now + timedelta(seconds=60)),
    )
    events = read_events(only)  # newest first (EventFilter.order)
    return events[0].occurred if events else None


def read_events(only: EventFilter, limit: int = 1) -> list:
    with get_client(sync_client=True) as client:
        return client.read_events(filter=only, limit=limit).events


def just_after_a_heartbeat(flow_run_id, *, margin_s: float = BEAT_MARGIN_S) -> float:
    """Return when the flow run's newest heartbeat is recent enough that the next one is at least margin_s away;
    returns the seconds waited (at most about one interval; none when heartbeats are off).

    Why: Prefect's heartbeat thread (prefect.flow_engine._send_heartbeats) checks only for a final state and
    stops when the engine leaves the run, after suspend_flow_run has set Suspended. A beat sent in between
    follows the Suspended event and the gate's own (announce_suspension): it opens a new window of the crash automation (eyas_cli.automation) that
    nothing closes, and the run waiting at the gate is marked Crashed one window later. Suspending just after
    a beat gives the process most of an interval to exit. If no beat shows up (the server stores events every
    few seconds), the run suspends anyway after one interval and says so."""
    frequency = get_current_settings().flows.heartbeat_frequency
    if not frequency:
        return 0.0
    interval = max(frequency, MIN_HEARTBEAT_S)
    start = time.monotonic()
    while True:
        newest = newest_heartbeat(flow_run_id, 2 * interval)
        waited = time.monotonic() - start
        if newest is not None:
            age = (datetime.now(timezone.utc) - newest).total_seconds()
            if age <= interval - margin_s:
                return waited
            pause = max(1.0, interval - age + 1.0)  # the next beat is due: look just after it
        else:
            pause = 1.0
        if waited + pause > 2 * interval:
            print(
                f"no heartbeat of flow run {flow_run_id} stored in {waited:.0f} s (every {interval} s expected): "
                "suspending anyway; if one lands just after, the crash automation may mark this waiting run "
                "Crashed: retry it"
            )
            return waited
        time.sleep(pause)


def announce_suspension(flow_run_id, *, timeout_s: float = 30.0) -> bool:
    """Send GATE_SUSPENDING_EVENT for the flow run (the crash automation expects it after a heartbeat) and wait
    until the server has stored it, so that it left this process before the process exits; False (said in a
    line) when it was not stored within timeout_s."""
    sent = emit_event(GATE_SUSPENDING_EVENT, {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"})
    if sent is None:  # emit_event sends nothing where Prefect emits no events (no API): no automation either
        print(f"{GATE_SUSPENDING_EVENT} not sent for flow run {flow_run_id}: this process emits no events")
        return False
    only = EventFilter(
        id=EventIDFilter(id=[sent.id]),
        occurred=EventOccurredFilter(
            since=sent.occurred - timedelta(seconds=1), until=sent.occurred + timedelta(seconds=1)
        ),
    )
    deadline = time.monotonic() + timeout_s
    while not read_events(only):
        if time.monotonic() > deadline:
            print(
                f"the server had not stored {GATE_SUSPENDING_EVENT} of flow run {flow_run_id} after {timeout_s:.0f} "
                "s: suspending anyway; if the crash automation marks this waiting run Crashed, retry it"
            )
            return False
        time.sleep(0.5)
    return True
