"""What an earlier attempt of this flow run left unfinished, settled at the start of the next attempt.

A run whose process died (a machine crash, a kill) is marked Crashed by the crash automation, but its task
runs, and the task runs of its subflows, stay in the state they had: a `launch-torchrun` task Running forever on
a run that is long over. When the run is retried, nothing of the new attempt has started at the top of its flow,
so every task run of the run and of its subflows still Pending or Running there, and every subflow run not
final, belongs to an attempt that is over: each is marked Crashed, with a message naming the attempt that
replaced it.
"""

from __future__ import annotations

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterParentFlowRunId,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.states import Crashed

UNFINISHED = [StateType.PENDING, StateType.RUNNING]


def settle_earlier_attempts() -> dict[str, list[str]]:
    """Mark Crashed what earlier attempts of the current flow run left unfinished; returns the names of the task
    runs and subflow runs settled. Call it first thing in a flow; a first attempt has nothing to settle."""
    context = FlowRunContext.get()
    if context is None:
        return {"task_runs": [], "flow_runs": []}
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(context.flow_run.id)  # run_count as the server counts it, this attempt included
        if run.run_count <= 1:
            return {"task_runs": [], "flow_runs": []}
        message = f"an earlier attempt of flow run {run.name} ended without finishing this; attempt {run.run_count} replaced it"
        subflows, todo = [], [run.id]
        while todo:
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[todo.pop()]))
            )
            subflows += children
            todo += [child.id for child in children]
        stuck_tasks = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id, *(s.id for s in subflows)])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=UNFINISHED))),
        )
        for task_run in stuck_tasks:
            client.set_task_run_state(task_run.id, Crashed(message=message), force=True)
        stuck_flows = [s for s in subflows if s.state is not None and not s.state.is_final()]
        for subflow in stuck_flows:
            client.set_flow_run_state(subflow.id, Crashed(message=message), force=True)
    settled = {"task_runs": [t.name for t in stuck_tasks], "flow_runs": [s.name for s in stuck_flows]}
    if stuck_tasks or stuck_flows:
        print(
            f"attempt {run.run_count}: marked Crashed what an earlier attempt left unfinished: "
            f"{len(stuck_tasks)} task run(s) {settled['task_runs']}, {len(stuck_flows)} subflow run(s) "
            f"{settled['flow_runs']}"
        )
    return settled
