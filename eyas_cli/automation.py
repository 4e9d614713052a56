"""Crash detection for runs whose machine died: flow-run heartbeats and an automation on the server.

Usage:
  python -m eyas_cli.automation [--within-s 90]     install it, or update it (idempotent)

A flow run's process emits `prefect.flow-run.heartbeat` every PREFECT_FLOWS_HEARTBEAT_FREQUENCY
seconds (Prefect sends none when it is unset; at least 30). Every process eyas starts sets it to
HEARTBEAT_S = 30: the flow runs `eyas worker` starts, and the runs `eyas run`, `eyas demo`
and the stage verbs execute in their own process (eyas_cli.main, which installs this automation too).
A process killed under a live worker is reported Crashed by the worker; when the whole VM dies, or a
run executing in the `eyas` command's own process is killed, nobody reports anything and the run
stays Running. This automation (Prefect's documented "detect zombie flows" one) marks a run Crashed
when a heartbeat is followed within `within_s` by neither another heartbeat nor a final state, so
that it can be retried and resume.

Unlike the documented one it also expects `Suspended`: a deployment's run waiting at the approval gate
is suspended, has no process at all and sends no heartbeats, and must not be marked Crashed. The gate
also sends `eyas.gate.suspending` for the run just before it suspends (eyas.gate.GATE_SUSPENDING_EVENT):
Prefect's Suspended event follows the run's previous state event, and the server's triggers hold it back
until they have processed that one, on a busy server past the window (seen under the test suite's load). It does
not expect `Paused`: a run paused at the gate waits in its process and keeps beating, and a Paused
event must not close the window (a process killed within one beat of pausing would never be marked).

The window, `within_s`: default WITHIN_S = 3 x HEARTBEAT_S = 90 s, so a dead run is Crashed (and
can be retried) at most about 90 s after its last beat, while a live one may miss two beats in a row
(a machine too busy to send them for a minute) without being marked. A longer window costs only
time before a retry; a shorter one risks marking a live run Crashed. A run started by other means
beats at the interval its own environment sets (none, or e.g. 180 s): with such runs on the same
server, choose a window above twice their interval. Set it with `--within-s` here and for the
worker, or EYAS_CRASH_WITHIN_S for every eyas command (the automation is one per server: the last
command to install it sets the window).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from uuid import UUID

from eyas.gate import GATE_SUSPENDING_EVENT

NAME = "eyas: mark runs Crashed when their heartbeats stop"
HEARTBEAT_S = 30
WITHIN_S = 3 * HEARTBEAT_S
WINDOW_ENV = "EYAS_CRASH_WITHIN_S"
MESSAGE = "no heartbeat for {within_s} s: the run's machine or process died (marked by the '{name}' automation)"
EXPECTED = (
    "prefect.flow-run.heartbeat",
    "prefect.flow-run.Completed",
    "prefect.flow-run.Failed",
    "prefect.flow-run.Cancelled",
    "prefect.flow-run.Crashed",
    "prefect.flow-run.Suspended",  # waiting at the gate with no process: no heartbeat until it is resumed
    GATE_SUSPENDING_EVENT,  # the gate's own word for it, sent just before (eyas.gate)
)


def crash_window_s() -> int:
    """The window: EYAS_CRASH_WITHIN_S when set (whole seconds, above one heartbeat interval), else WITHIN_S."""
    raw = os.environ.get(WINDOW_ENV, "").strip()
    if not raw:
        return WITHIN_S
    try:
        within_s = int(raw)
    except ValueError:
        within_s = 0
    if within_s <= HEARTBEAT_S:
        from eyas_cli.errors import UserError

        raise UserError(
            f"{WINDOW_ENV}={raw!r}: expected whole seconds above the heartbeat interval ({HEARTBEAT_S} s), e.g. "
            f"{WITHIN_S}; a window shorter than one beat would mark live runs Crashed"
        )
    return within_s


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
    """Create the automation, or update the installed one if it does something else (an identical one is left as
    is). Returns its id.

    An update loses the windows open at that moment: the server times one window per run (an automation bucket)
    keyed by the trigger's id, and gives the trigger a new id on every update (whatever id is sent). A run
    whose process died within one window before a change of the window is therefore not marked Crashed;
    `eyas status` still says that its process is gone."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    wanted = crash_detection(within_s)
    with get_client(sync_client=True) as client:
        installed = client.read_automations_by_name(NAME)
    if not installed:
        return wanted.create().id
    current = Automation(**installed[0].model_dump())
    if not same_automation(current, wanted):
        for name in AUTOMATION_FIELDS:
            setattr(current, name, getattr(wanted, name))
        current.update()
    return current.id


AUTOMATION_FIELDS = ("description", "enabled", "trigger", "actions")


def same_automation(installed, wanted) -> bool:
    """Whether the installed automation does what `wanted` does. Compared as Python values: the trigger's
    `after`, `expect` and `for_each` are sets, whose JSON lists come in an order that differs from one process
    to the next (string hashing is salted per process); compared as JSON, about every other eyas command found
    the identical automation changed and updated it, losing the windows of the runs killed just before."""
    fields = set(AUTOMATION_FIELDS)
    return installed.model_dump(include=fields) == wanted.model_dump(include=fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas_cli.automation", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--within-s", type=int, default=None, help=f"seconds without a heartbeat before Crashed (default {WITHIN_S})"
    )
    args = parser.parse_args(argv)
    within_s = args.within_s or crash_window_s()
    from eyas_cli.server import connect

    api = connect()  # PREFECT_API_URL, or the local server eyas starts
    automation_id = install_crash_detection(within_s)
    print(f"automation {NAME!r} installed on {api} ({automation_id}): Crashed after {within_s} s without heartbeat")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
