"""The run-status snapshot (eyas.status) as a markdown artifact after each stage, and the flow runs of a
workdir as the Prefect server knows them (also used by `eyas status`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import RunConfig
from eyas.status.report import STAGES, VERBS, record_run_config, run_status
from tasks.reporting import markdown_artifact

# The flows of eyas, by their Prefect names (flows/*.py): those eyas.status.report knows a verb for.
FLOW_NAMES = tuple(VERBS)
PAGE, SCANNED_RUNS = 200, 1000  # the server answers at most 200 runs per request


def _same_workdir(parameters: dict, workdir: Path) -> bool:
    config = parameters.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("workdir"), str):
        return False
    return config["workdir"] == str(workdir) or Path(config["workdir"]).resolve() == Path(workdir).resolve()


def recent_flow_runs(workdir: str | Path, *, limit: int = 30) -> list[dict]:
    """The newest flow runs of eyas's flows whose config has this workdir, newest first (the last
    SCANNED_RUNS runs of those flows are searched; a relative workdir is compared from this directory). The
    limit leaves room for a retried pipeline's subflows: its top-level run started before all of them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    only_eyas = FlowFilter(name=FlowFilterName(any_=list(FLOW_NAMES)))
    found: list[dict] = []
    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows(flow_filter=only_eyas)}
        for offset in range(0, SCANNED_RUNS, PAGE):
            page = client.read_flow_runs(
                flow_filter=only_eyas, sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=PAGE, offset=offset
            )
            found += [_describe(run, flows) for run in page if _same_workdir(run.parameters or {}, Path(workdir))]
            if len(found) >= limit or len(page) < PAGE:
                break
    return found[:limit]


def _describe(run, flows: dict) -> dict:
    started = run.start_time or run.expected_start_time
    return {
        "flow": flows.get(run.flow_id, "?"),
        "run": run.name,
        "state": run.state.name if run.state else "?",
        "started": started.isoformat(timespec="seconds") if started else "",
        "duration_s": round(run.total_run_time.total_seconds()),
        "id": str(run.id),
        "message": (run.state.message or "")[:200] if run.state else "",
        "tags": sorted(run.tags or []),
        "subflow": run.parent_task_run_id is not None,
        "deployment": run.deployment_id is not None,
    }


def flow_run_config(run_id: str) -> tuple[dict, dict]:
    """(the config parameter, the description) of one of eyas's flow runs by id; ValueError naming what is
    wrong when the server has no such run or the run has no eyas config."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(UUID(str(run_id)))
        except ObjectNotFound:
            raise ValueError(
                f"flow run {run_id}: the Prefect server at {client.api_url} has no such run; expected the id "
                "`eyas status` or the run's first lines print"
            ) from None
        flow = client.read_flow(run.flow_id)
    config = (run.parameters or {}).get("config")
    if flow.name not in FLOW_NAMES or not isinstance(config, dict):
        raise ValueError(
            f"flow run {run_id} ({flow.name}/{run.name}) is not a run of eyas's flows with a config parameter; "
            f"expected one of {', '.join(FLOW_NAMES)}"
        )
    return config, _describe(run, {run.flow_id: flow.name})


@task(name="run-status", cache_policy=NO_CACHE)
def stage_status_artifact(config: RunConfig, stage: str) -> dict:
    """Snapshot of the whole run after `stage` (the `eyas status` view) as the artifact `status-NAME`."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {', '.join(STAGES)}")
    record_run_config(config)
    status = run_status(config)
    status.attach_flow_runs(recent_flow_runs(config.paths.root))
    markdown_artifact(
        f"status-{config.name}", status.to_markdown(title=f"after {stage}"), f"run status after the {stage} stage"
    )
    return status.to_dict()
