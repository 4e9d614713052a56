"""What the Prefect server recorded about runs, for the orchestration tests (import prefect lazily: the
server fixture sets PREFECT_API_URL first)."""

from __future__ import annotations

import threading
import time


def drain_run_logs() -> None:
    """Send the runs' logs and events while the server is up (else the session ends waiting on retries)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)
    EventsWorker.drain_all(timeout=30)


def client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def read_run(run_id):
    with client() as c:
        return c.read_flow_run(run_id)


def top_run_tagged(tag: str):
    """The top-level flow run carrying `tag`, or None."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId, FlowRunFilterTags

    flt = FlowRunFilter(
        tags=FlowRunFilterTags(all_=[tag]), parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=True)
    )
    with client() as c:
        runs = c.read_flow_runs(flow_run_filter=flt, limit=1)
    return runs[0] if runs else None


def task_runs(flow_run_id, name: str | None = None) -> list:
    """Task runs of one flow run (not of its subflows), optionally those of the task `name`, oldest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client() as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    runs = [r for r in runs if name is None or r.name.rsplit("-", 1)[0] == name]
    return sorted(runs, key=lambda r: r.expected_start_time or r.created)


def task_run_state_names(task_run_id) -> list[str]:
    with client() as c:
        return [s.name for s in sorted(c.read_task_run_states(task_run_id), key=lambda s: s.timestamp)]


def artifacts(flow_run_id, key: str) -> list:
    """Artifacts `key` of one flow run, oldest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    flt = ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with client() as c:
        found = c.read_artifacts(artifact_filter=flt)
    return sorted(found, key=lambda a: a.created)


def run_tree(run_id) -> list:
    """The id of a flow run and of every flow run started under it (its subflows, recursively)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    found, todo = [run_id], [run_id]
    with client() as c:
        while todo:
            flt = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[todo.pop()]))
            children = [r.id for r in c.read_flow_runs(flow_run_filter=flt)]
            found += children
            todo += children
    return found


def artifacts_in_tree(run_id, key: str) -> list:
    """Artifacts `key` of a flow run and of the runs under it, oldest first."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    flt = ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=run_tree(run_id)))
    with client() as c:
        found = c.read_artifacts(artifact_filter=flt)
    return sorted(found, key=lambda a: a.created)


def logs(flow_run_id) -> list[str]:
    """The run's log messages on the server (this process's are sent first)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    drain_run_logs()
    with client() as c:
        found = c.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC
        )
    return [entry.message for entry in found]


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    """Poll until predicate() returns something truthy; return it, or fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def answer_when_waiting(find_run, answers: list[dict], timeout_s: float = 300) -> tuple[threading.Thread, list]:
    """In a thread: answer the gate of the run `find_run()` returns, each answer in turn. An answer the server
    refuses is recorded ("refused", reason, still waiting?) and the next one goes to the same wait; an accepted
    one is recorded ("accepted", answer) and the next one waits for the run's next Paused/Suspended state."""
    from prefect.flow_runs import resume_flow_run

    outcomes: list = []

    def answer_all() -> None:
        answered = None
        for answer in answers:
            run = wait_for(
                lambda: (r := find_run()) is not None and r.state.is_paused() and r.state.id != answered and r,
                timeout_s,
                "the run to wait at the gate",
            )
            try:
                resume_flow_run(run.id, run_input=answer)
            except RuntimeError as err:
                outcomes.append(("refused", str(err), read_run(run.id).state.is_paused()))
                continue
            answered = run.state.id
            outcomes.append(("accepted", answer))

    thread = threading.Thread(target=answer_all, daemon=True)
    thread.start()
    return thread, outcomes
