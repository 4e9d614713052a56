"""Runs whose process died are marked Crashed by the crash-detection automation (eyas_cli.automation) on a real
server: NUM_RUNS runs beating in one process are SIGKILLed together after two beats each, the automation is
installed again at once (as re-running the command does; it must stay as it is: an update gives its trigger a
new id on the server and loses the windows then open), and every run must be Crashed within the window plus
the server's proactive evaluation period.

The runs beat every BEAT_S seconds and the window is three beats, the ratio of the production values (30 s and
90 s); the server's triggers do the same at either scale (tests/dying_runs.py says how the interval is cut)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from uuid import UUID

from run_queries import client, wait_for

REPO = Path(__file__).resolve().parents[1]
NUM_RUNS = 24
BEAT_S = 4
WITHIN_S = 3 * BEAT_S  # Prefect refuses a proactive window under 10 s
PROACTIVE_S = 5  # PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY: how often the server evaluates proactive triggers
CRASHED_WITHIN_S = 60  # the window, one evaluation period, and time for the server's queues on a busy machine


def heartbeats(run_ids: list[UUID]) -> Counter:
    """The heartbeat events the server stored, per run."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    resources = [f"prefect.flow-run.{run_id}" for run_id in run_ids]
    flt = EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]), resource=EventResourceFilter(id=resources)
    )
    with client() as c:
        page = c.read_events(filter=flt, limit=50)  # the most the API gives per page
        events = list(page.events)
        while page.next_page:
            page = c.read_events_page(page.next_page)
            events += page.events
    return Counter(event.resource.id for event in events)


def installed_trigger_id() -> str:
    """The id the server gave the automation's trigger (Prefect's client models leave it out)."""
    from eyas_cli.automation import NAME

    with client() as c:
        [automation] = c.read_automations_by_name(NAME)
        response = c.request("GET", "/automations/{id}", path_params={"id": automation.id})
    response.raise_for_status()
    return response.json()["trigger"]["id"]


def state_names(run_ids: list[UUID]) -> dict[UUID, str]:
    with client() as c:
        return {run_id: c.read_flow_run(run_id).state.name for run_id in run_ids}


def start_dying_runs(tmp_path: Path) -> tuple[subprocess.Popen, list[UUID]]:
    """tests/dying_runs.py with NUM_RUNS runs beating every BEAT_S; returns it once every run is Running."""
    ids_path, log_path = tmp_path / "run_ids.txt", tmp_path / "dying_runs.log"
    cmd = [sys.executable, str(REPO / "tests" / "dying_runs.py"), str(NUM_RUNS), str(BEAT_S), str(ids_path)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def started() -> list[str] | None:
        assert proc.poll() is None, f"tests/dying_runs.py exited with {proc.returncode}; see {log_path}"
        lines = ids_path.read_text().split() if ids_path.is_file() else []
        return lines if len(lines) == NUM_RUNS else None

    try:
        return proc, [UUID(line) for line in wait_for(started, timeout_s=120, what=f"{NUM_RUNS} runs Running")]
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def beat_twice(run_ids: list[UUID]) -> Counter | None:
    """The heartbeats stored per run, once every run has two; else None."""
    count = heartbeats(run_ids)
    return count if all(count[f"prefect.flow-run.{run_id}"] >= 2 for run_id in run_ids) else None


def test_every_killed_run_is_marked_crashed_also_when_the_automation_is_installed_again(
    prefect_server, removes_crash_automation, tmp_path
):
    from eyas_cli.automation import install_crash_detection

    install_crash_detection(within_s=WITHIN_S)
    proc, run_ids = start_dying_runs(tmp_path)
    try:
        beats = wait_for(lambda: beat_twice(run_ids), timeout_s=120, what="two heartbeats of every run")
        assert set(state_names(run_ids).values()) == {"Running"}
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    trigger_id = installed_trigger_id()
    install_crash_detection(within_s=WITHIN_S)  # the killed command run again at once
    assert installed_trigger_id() == trigger_id

    def all_crashed():
        names = state_names(run_ids)
        return all(name == "Crashed" for name in names.values()) and names

    try:
        wait_for(all_crashed, timeout_s=CRASHED_WITHIN_S, what=f"all {NUM_RUNS} killed runs Crashed", poll_s=1)
    except AssertionError:
        left = Counter(state_names(run_ids).values())
        raise AssertionError(
            f"{CRASHED_WITHIN_S} s after {NUM_RUNS} runs were killed (beats stored: {sorted(beats.values())}), "
            f"their states are {dict(left)}"
        ) from None
    crashed_after_s = time.monotonic() - killed
    print(f"{NUM_RUNS} killed runs Crashed {crashed_after_s:.0f} s after the kill (window {WITHIN_S} s)")
    with client() as c:
        messages = {c.read_flow_run(run_id).state.message for run_id in run_ids}
    assert all(message.startswith("no heartbeat for ") for message in messages), messages
