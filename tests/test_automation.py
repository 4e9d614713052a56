"""The crash-detection automation and the worker set-up (eyas_cli.automation, eyas_cli.worker) on a real server.
Its behaviour on dead and suspended runs is exercised in tests/test_crash_vm.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def installed(removes_crash_automation):
    """Remove the automation after the test (a short window would mark other tests' live runs Crashed)."""
    yield


def test_crash_detection_expects_suspended_runs_but_not_paused_ones(prefect_server):
    from eyas_cli.automation import HEARTBEAT_S, WITHIN_S, crash_detection

    automation = crash_detection()
    trigger = automation.trigger
    assert trigger.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.Suspended", "prefect.flow-run.Completed"} <= trigger.expect
    # a paused run keeps beating in its process: a Paused event must not close the window
    assert "prefect.flow-run.Paused" not in trigger.expect
    assert trigger.posture == "Proactive" and trigger.for_each == {"prefect.resource.id"}
    # three beats of the interval every eyas process sets: two may be missed without a live run being marked
    assert trigger.within.total_seconds() == WITHIN_S == 3 * HEARTBEAT_S
    assert [a.type for a in automation.actions] == ["change-flow-run-state"]
    assert automation.actions[0].state.value == "CRASHED"


def test_install_is_idempotent_and_updates_a_changed_window(prefect_server, installed):
    from prefect.client.orchestration import get_client

    from eyas_cli.automation import NAME, install_crash_detection

    def trigger_id(automation_id) -> str:  # the server's id for the trigger, which its windows are keyed by
        with get_client(sync_client=True) as client:
            response = client.request("GET", "/automations/{id}", path_params={"id": automation_id})
        return response.json()["trigger"]["id"]

    first = install_crash_detection(within_s=120)
    opened_windows_under = trigger_id(first)
    assert install_crash_detection(within_s=120) == first
    assert trigger_id(first) == opened_windows_under  # left as is: the windows it is timing keep running
    assert install_crash_detection(within_s=240) == first
    with get_client(sync_client=True) as client:
        [automation] = client.read_automations_by_name(NAME)
    assert automation.trigger.within.total_seconds() == 240


def test_an_installed_automation_is_the_same_whatever_order_its_sets_come_back_in():
    """The server returns the trigger's sets as lists in its own process's order; another eyas process orders the
    same sets otherwise (string hashing is salted per process). Compared as JSON they differed, and the update
    that followed lost the windows of the runs killed just before (tests/test_crash_detection.py)."""
    from prefect.automations import Automation

    from eyas_cli.automation import crash_detection, same_automation

    wanted = crash_detection(90)
    answer = wanted.model_dump(mode="json") | {"id": "7d8c2f1e-0000-4000-8000-000000000001"}
    answer["trigger"]["expect"] = list(reversed(answer["trigger"]["expect"]))
    installed = Automation(**answer)
    assert same_automation(installed, wanted)
    assert not same_automation(installed, crash_detection(120))


def test_worker_setup_creates_its_process_pool_once(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    from eyas_cli.worker import ensure_process_pool

    def stream_default(name: str):
        with get_client(sync_client=True) as client:
            template = client.read_work_pool(name).base_job_template
        return template["variables"]["properties"]["stream_output"]["default"]

    assert ensure_process_pool("setup-test") is True
    assert ensure_process_pool("setup-test") is False
    assert stream_default("setup-test") is False  # a flow run's stdout is no pipe to the worker
    # a pool made by hand (`prefect work-pool create --type process`) streams; eyas's set-up turns that off
    with get_client(sync_client=True) as client:
        template = ProcessWorker.get_default_base_job_template()
        client.create_work_pool(WorkPoolCreate(name="by-hand", type="process", base_job_template=template))
    assert stream_default("by-hand") is True
    assert ensure_process_pool("by-hand") is False
    assert stream_default("by-hand") is False


def test_worker_environment_sets_heartbeats_and_durable_results(tmp_path):
    from eyas_cli.worker import REPO, worker_environment

    env = worker_environment(tmp_path / "results")
    assert env == {
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
        "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str((tmp_path / "results").resolve()),
        "EYAS_REPO": str(REPO),
    }


def test_the_window_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    from eyas_cli.automation import WINDOW_ENV, WITHIN_S, crash_window_s
    from eyas_cli.errors import UserError

    monkeypatch.delenv(WINDOW_ENV, raising=False)
    assert crash_window_s() == WITHIN_S
    monkeypatch.setenv(WINDOW_ENV, "240")
    assert crash_window_s() == 240
    for bad in ("20", "30", "ninety", "-5"):
        monkeypatch.setenv(WINDOW_ENV, bad)
        with pytest.raises(UserError, match=f"{WINDOW_ENV}='{bad}': expected whole seconds above the heartbeat"):
            crash_window_s()


def test_in_process_clients_talk_to_the_suites_server(prefect_server):
    """Collection imports prefect (tests/test_progress.py imports tasks.reporting) before the server starts: the
    fixture makes prefect read its settings again, or these clients would start a temporary server of their own."""
    import sys

    from prefect.client.orchestration import get_client

    assert "prefect" in sys.modules
    with get_client(sync_client=True) as client:
        assert str(client.api_url).rstrip("/") == prefect_server


def test_a_beat_followed_by_the_gates_event_is_not_marked_crashed(prefect_server, installed):
    """Two runs beat once; one then sends the gate's event (tasks.gate.announce_suspension): after the window
    only the other is Crashed."""
    import time
    import uuid

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.events import emit_event
    from prefect.states import Running

    from eyas_cli.automation import install_crash_detection
    from tasks.gate import announce_suspension

    @flow(name="automation-probe")
    def probe():
        pass

    with get_client(sync_client=True) as client:
        gated, silent = (
            client.create_flow_run(probe, name=f"probe-{uuid.uuid4().hex[:6]}", state=Running()).id for _ in range(2)
        )
        install_crash_detection(within_s=10)
        for run_id in (gated, silent):
            emit_event("prefect.flow-run.heartbeat", {"prefect.resource.id": f"prefect.flow-run.{run_id}"})
        assert announce_suspension(gated)  # stored by the server
        deadline = time.monotonic() + 60
        while client.read_flow_run(silent).state.name != "Crashed":
            assert time.monotonic() < deadline, "the run that only beat was never marked Crashed"
            time.sleep(0.5)
        time.sleep(10)  # one more window and proactive sweep
        assert client.read_flow_run(gated).state.name == "Running"
