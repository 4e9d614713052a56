"""The approval gate run in-process (it pauses): answers, overrides, records, timeouts, against a real server.
The suspend path (a deployment's run) is exercised in tests/test_crash_vm.py."""

from __future__ import annotations

import json
import uuid

import pytest
from run_fixtures import gated_run_config
from run_queries import answer_when_waiting, artifacts, top_run_tagged

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")


@pytest.fixture
def config(tmp_path, tiny_target_dir):
    """The tiny preset in a fresh workdir holding a tokenized table of 40 samples."""
    return gated_run_config(tmp_path / "run", tiny_target_dir, num_samples=40)


def run_gate(config, answers: list[dict], accept_overrides: bool = True):
    """Run a flow that only gates, answering it through the API; returns (state, outcomes, flow run id)."""
    from prefect import flow, tags

    from tasks.gate import approval_gate

    @flow(name="gate-probe")
    def gate_probe(config, accept_overrides: bool) -> dict:
        answer = approval_gate(config, "# probe summary", accept_overrides=accept_overrides)
        return {"approve": answer.approve, "reviewer": answer.reviewer, "overrides": answer.overrides()}

    tag = f"gate-{uuid.uuid4().hex[:8]}"
    thread, outcomes = answer_when_waiting(lambda: top_run_tagged(tag), answers)
    with tags(tag):
        state = gate_probe(config, accept_overrides, return_state=True)
    thread.join(timeout=10)
    return state, outcomes, state.state_details.flow_run_id


def decisions(flow_run_id) -> list[str]:
    return [a.data for a in artifacts(flow_run_id, "approval-decision")]


def test_approval_with_overrides_is_returned_recorded_and_shown(prefect_server, config):
    state, outcomes, run_id = run_gate(config, [{"approve": True, "reviewer": "ada", "note": "ok", "num_epochs": 2}])
    assert state.is_completed(), state.message
    assert state.result() == {"approve": True, "reviewer": "ada", "overrides": {"num_epochs": 2}}
    record = json.loads((config.paths.root / "approval.json").read_text())
    assert record["overrides"] == {"num_epochs": 2} and record["reviewer"] == "ada" and record["decided_at"]
    [decision] = decisions(run_id)
    assert "Training approved" in decision and "| overrides | train.num_epochs = 2 |" in decision
    assert f"`{record['config_fingerprint']}`" in decision


def test_same_configuration_is_not_asked_again_and_keeps_its_overrides(prefect_server, config):
    run_gate(config, [{"approve": True, "reviewer": "ada", "num_epochs": 2}])
    state, outcomes, run_id = run_gate(config, [])
    assert state.is_completed() and state.result()["overrides"] == {"num_epochs": 2}
    assert "an earlier approval of this configuration" in decisions(run_id)[0]


def test_changed_configuration_asks_again(prefect_server, config):
    run_gate(config, [{"approve": True, "reviewer": "ada"}])
    changed = config.model_copy(update={"train": config.train.model_copy(update={"lr": 0.001})})
    state, outcomes, _ = run_gate(changed, [{"approve": True, "reviewer": "bob"}])
    assert outcomes == [("accepted", {"approve": True, "reviewer": "bob"})]
    assert state.result()["reviewer"] == "bob"


def test_rejection_fails_the_run_with_the_reviewer_and_note(prefect_server, config):
    state, _, run_id = run_gate(config, [{"approve": False, "reviewer": "ada", "note": "wrong layers"}])
    assert state.is_failed()
    assert "training rejected by ada: wrong layers; nothing was trained" in state.message
    assert not (config.paths.root / "approval.json").exists()
    assert "Training rejected" in decisions(run_id)[0]


def test_form_without_overrides_refuses_them_and_keeps_waiting(prefect_server, config):
    answers = [{"approve": True, "reviewer": "ada", "num_epochs": 2}, {"approve": True, "reviewer": "ada"}]
    state, outcomes, _ = run_gate(config, answers, accept_overrides=False)
    assert state.is_completed()
    refused, accepted = outcomes
    assert refused[0] == "refused" and "num_epochs" in refused[1] and refused[2] is True  # still waiting
    assert accepted == ("accepted", answers[1])


def test_override_that_would_be_ignored_is_refused_and_asked_again(prefect_server, config):
    checkpoint = config.paths.train_dir / "checkpoints" / "step-00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("done\n")
    answers = [{"approve": True, "reviewer": "ada", "lr": 0.01}, {"approve": True, "reviewer": "ada"}]
    state, outcomes, run_id = run_gate(config, answers)
    assert [o[0] for o in outcomes] == ["accepted", "accepted"]  # the second answer went to a second wait
    assert state.is_completed() and state.result()["overrides"] == {}
    refused, approved = decisions(run_id)
    assert "Training overrides refused" in refused and f"training resumes from {checkpoint}" in refused
    assert "Training approved" in approved


def test_unanswered_gate_fails_the_run_with_the_reason(prefect_server, config):
    config = config.model_copy(update={"approval": config.approval.model_copy(update={"timeout_s": 10})})
    state, _, run_id = run_gate(config, [])
    assert state.is_failed()
    reason = "approval gate: nobody answered within approval.timeout_s=10 s; nothing was trained"
    assert reason in state.message
    assert "Training timed out" in decisions(run_id)[0]


def test_a_suspension_waits_until_just_after_a_heartbeat(prefect_server):
    """A beat sent after Suspended would open a crash-automation window nothing closes (tasks.gate
    just_after_a_heartbeat): with the newest stored beat 25 s old the gate waits for the next one."""
    import threading
    import time
    from datetime import datetime, timedelta, timezone

    from prefect.events import emit_event
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from tasks.gate import HEARTBEAT_EVENT, just_after_a_heartbeat, newest_heartbeat

    run_id = uuid.uuid4()
    resource = {"prefect.resource.id": f"prefect.flow-run.{run_id}"}

    def beat(age_s: float) -> datetime:
        occurred = datetime.now(timezone.utc) - timedelta(seconds=age_s)
        emit_event(HEARTBEAT_EVENT, resource, occurred=occurred)
        return occurred

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 30}):
        old = beat(25)
        deadline = time.monotonic() + 30
        while newest_heartbeat(run_id, 60) is None:  # the server stores events every few seconds
            assert time.monotonic() < deadline, "the emitted heartbeat was never stored"
            time.sleep(0.5)
        later = threading.Timer(3, beat, args=(0,))
        later.start()
        start = time.monotonic()
        waited = just_after_a_heartbeat(run_id)
        later.join()
        newest = newest_heartbeat(run_id, 60)
        assert waited >= 3 and time.monotonic() - start >= 3 and newest > old
        assert (datetime.now(timezone.utc) - newest).total_seconds() <= 20  # the next beat is >= 10 s away
        assert just_after_a_heartbeat(run_id) < 2  # a fresh beat: no wait
    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        assert just_after_a_heartbeat(uuid.uuid4()) == 0.0  # no heartbeats: nothing to wait for
