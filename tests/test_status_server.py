"""`eyas status` against a real Prefect server while runs are in flight: the `eyas` command's own process
running, waiting at the gate, killed (never shown as running; marked Crashed by the automation the
command installed), retried, rejected; and no server at all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_fixtures import small_run_config
from run_queries import wait_for

pytestmark = pytest.mark.e2e
WINDOW_S = 45  # the automation's window in this test (heartbeats every 30 s)


def small_config(workdir: Path, tiny: Path):
    return small_run_config(workdir, tiny, smoke={"num_samples": 2, "num_steps": 20})


@pytest.fixture
def window(prefect_server, removes_crash_automation):
    """The environment of the `eyas` commands; the automation they install is removed afterwards."""
    return {**os.environ, "PREFECT_API_URL": prefect_server, "EYAS_CRASH_WITHIN_S": str(WINDOW_S)}


def eyas(env, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eyas_cli.main", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def status(env, run) -> dict:
    proc = eyas(env, "status", str(run), "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("\n{") if not proc.stdout.startswith("{") else 0 :])


def top_run(snapshot: dict) -> dict | None:
    return next((r for r in snapshot["flow_runs"] if r["flow"] == "pipeline"), None)


def server_state(run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state.name


def test_status_follows_an_in_process_run_through_the_gate_a_kill_and_a_rejection(window, tmp_path, tiny_target_dir):
    config = small_config(tmp_path / "run", tiny_target_dir)
    cfg = tmp_path / "config.json"
    cfg.write_text(config.model_dump_json())
    log = open(tmp_path / "run.log", "w")
    run = subprocess.Popen(
        [sys.executable, "-m", "eyas_cli.main", "run", str(cfg)],
        stdin=subprocess.DEVNULL,  # not a terminal: the gate is answered elsewhere
        stdout=log,
        stderr=subprocess.STDOUT,
        env=window,
        start_new_session=True,
    )
    try:
        # 1. running: the command's own process is named, and the advice is to wait
        def running():
            snap = status(window, cfg)
            top = top_run(snap)
            return snap if top and top["state"] == "Running" and top.get("process") == "alive" else None

        snap = wait_for(running, 240, "the pipeline to run")
        top = top_run(snap)
        assert top["pid"] == run.pid and top["host"] == os.uname().nodename
        assert snap["next_steps"][0].startswith(f"flow run {top['id']} (pipeline) is Running in the `eyas` process")
        assert "wait for it" in snap["next_steps"][0] and len(snap["next_steps"]) == 1

        # 2. paused at the gate: the exact command; the flow-run id gives the same answer as the config
        snap = wait_for(lambda: (s := status(window, cfg)) and top_run(s)["state"] == "Paused" and s, 600, "the gate")
        run_id = top_run(snap)["id"]
        assert snap["next_steps"] == [
            f"flow run {run_id} (pipeline) waits at the approval gate: read the summary in the UI (Resume), then "
            f"`eyas approve {run_id}` or `eyas approve {run_id} --reject --note WHY`"
        ]
        by_id = status(window, run_id)
        assert by_id["workdir"] == config.workdir and by_id["next_steps"] == snap["next_steps"]
        assert by_id["config_path"] == str(Path(config.workdir) / "run.json")

        # 3. the process dies while it waits: never shown as waiting or running, re-run advised at once
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
        snap = status(window, cfg)
        top = top_run(snap)
        assert top["state"] == "Paused" and top["process"] == "gone"
        [step] = snap["next_steps"]
        assert step.startswith(f"flow run {run_id} (pipeline) is Paused on the server, but the `eyas` process")
        assert f"({run.pid} on {os.uname().nodename}) is gone" in step and f"`eyas run {cfg}`" in step

        # 4. the automation the command installed marks it Crashed; the advice is to retry
        wait_for(lambda: server_state(run_id) == "Crashed", WINDOW_S + 30 + 90, "the run to be marked Crashed", 5)
        snap = status(window, cfg)
        [step] = snap["next_steps"]
        assert step.startswith(f"flow run {run_id} (pipeline) Crashed (no heartbeat for {WINDOW_S} s")
        assert f"retry it with `eyas run {cfg}`" in step
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()

    # 5. the retry reaches the gate again (the stages before it come back) and is rejected with a note
    retry = subprocess.Popen(
        [sys.executable, "-m", "eyas_cli.main", "run", str(cfg)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=window,
        start_new_session=True,
    )
    try:
        snap = wait_for(
            lambda: (s := status(window, cfg)) and top_run(s)["state"] == "Paused" and top_run(s)["id"] != run_id and s,
            600,
            "the retried run at the gate",
        )
        retry_id = top_run(snap)["id"]
        answered = eyas(window, "approve", retry_id, "--reject", "--reviewer", "ana", "--note", "use lr 1e-4")
        assert answered.returncode == 0, answered.stderr
        assert retry.wait(timeout=120) == 1
    finally:
        if retry.poll() is None:
            os.killpg(retry.pid, signal.SIGKILL)
            retry.wait()
    snap = status(window, cfg)
    approval = next(s for s in snap["stages"] if s["stage"] == "approval")
    assert approval["state"] == "rejected" and approval["evidence"] == "rejection.json"
    assert approval["detail"].startswith("rejected by ana at ") and approval["detail"].endswith(": use lr 1e-4")
    [step] = snap["next_steps"]
    assert step.startswith("ana rejected training at ") and '"use lr 1e-4"' in step
    assert f"Change what the note asks for in {cfg}" in step and f"then `eyas run {cfg}`" in step
    assert not any("eyas train" in s for s in snap["next_steps"])


def test_status_says_it_could_not_check_when_no_server_answers(tmp_path, tiny_target_dir):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    config = small_config(tmp_path / "run", tiny_target_dir)
    cfg = tmp_path / "config.json"
    cfg.write_text(config.model_dump_json())
    snap = status(env, cfg)
    assert snap["flow_runs"] == []
    assert snap["next_steps"][0] == (
        f"could not check for runs in flight or waiting at the gate: no Prefect server answers at "
        f"http://127.0.0.1:{port}/api: flow runs not shown (the stages come from files)"
    )
    assert snap["next_steps"][1].startswith(f"`eyas dataset {cfg}`")
    by_id = eyas(env, "status", "0b6c4a3e-2f1d-4c6b-9a57-3e8f0d1c2b4a")
    assert by_id.returncode == 2
    assert "a flow-run id, but no Prefect server answers at" in by_id.stderr
