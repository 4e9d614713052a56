"""Crash detection for runs whose machine died: flow-run heartbeats and an automation on the server.

Usage:
  python -m eyas_cli.automation [--within-s 300]     install it, or update it (idempotent)

A flow run's process emits `prefect.flow-run.heartbeat` every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
seconds (Prefect's default 180, at least 30; `python -m eyas_cli.worker` sets 30 for the runs it
starts). A process killed under a live worker is reported Crashed by the worker; when the whole VM
dies nobody reports anything and its runs stay Running. This automation (Prefect's documented
"detect zombie flows" one) marks a run Crashed when a heartbeat is followed within `within_s` by
neither another heartbeat nor a final state, so that it can be retried and resume.

Unlike the documented one it also expects `Paused` and `Suspended`: a run waiting at the approval
gate sends no heartbeats (a suspended run has no process at all) and must not be marked Crashed.
`within_s` (default 300 s) exceeds Prefect's default heartbeat interval with room to spare, so a run
started without eyas's worker set-up (180 s heartbeats) is not marked Crashed while alive.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from uuid import UUID

NAME = "eyas: mark runs Crashed when their heartbeats stop"
HEARTBEAT_S = 30
WITHIN_S = 300
MESSAGE = "no heartbeat for {within_s} s: the run's machine or process died (marked by the '{name}' automation)"
EXPECTED = (
    "prefect.flow-run.heartbeat",
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
    "prefect.flow-run.Paused",  # waiting at the gate in its process (it keeps beating; this closes the window)
    "prefect.flow-run.Suspended",  # waiting at the gate with no process: no heartbeat until it is resumed
)


def crash_detection(within_s: int = WITHIN_S):
    """The automation (not yet on the server)."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=NAME,
        description="Marks Crashed the flow runs that stopped sending heartbeats (a dead VM); runs waiting at "
        "the approval gate (Paused, Suspended) are left alone. Installed by eyas_cli.automation.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect=set(EXPECTED),
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=MESSAGE.format(within_s=within_s, name=NAME))],
    )


def install_crash_detection(within_s: int = WITHIN_S) -> UUID:
    """Create the automation, or update the installed one if it differs (an identical one is left as is, so
    the windows it is timing keep running). Returns its id."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    wanted = crash_detection(within_s)
    with get_client(sync_client=True) as client:
        installed = client.read_automations_by_name(NAME)
    if not installed:
        return wanted.create().id
    current = Automation(**installed[0].model_dump())
    fields = {"description", "enabled", "trigger", "actions"}
    if current.model_dump(mode="json", include=fields) != wanted.model_dump(mode="json", include=fields):
        for name in fields:
            setattr(current, name, getattr(wanted, name))
        current.update()
    return current.id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas_cli.automation", description=__doc__.splitlines()[0])
    parser.add_argument("--within-s", type=int, default=WITHIN_S, help="seconds without a heartbeat before Crashed")
    args = parser.parse_args(argv)
    from eyas_cli.main import connect

    api = connect()  # PREFECT_API_URL, or the local server eyas starts
    automation_id = install_crash_detection(args.within_s)
    print(
        f"automation {NAME!r} installed on {api} ({automation_id}): Crashed after {args.within_s} s without heartbeat"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
