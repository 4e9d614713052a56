"""`eyas approve RUN_ID` and `eyas status RUN_ID` without PREFECT_API_URL reach eyas's own Prefect server (the one
`eyas run` and `eyas train` started for the state directory, eyas_cli.server), never a throw-away one.

The session's real server stands as eyas's own: its process is recorded in a fresh state directory the way
`eyas_cli.server.start_server` records the server it starts. A flow run in this process waits at the approval
gate; the commands run in subprocesses whose environment has no PREFECT_API_URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from run_fixtures import gated_run_config
from run_queries import top_run_tagged, wait_for

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")
REPO = Path(__file__).resolve().parents[1]


def server_process(api_url: str) -> int:
    """The pid of the `prefect server start ... --port PORT` process serving api_url (the session fixture's)."""
    port = api_url.split("//")[1].split("/")[0].split(":")[1]
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not a process directory
        if b"server" in argv and (b"--port", port.encode()) in zip(argv, argv[1:]):
            return int(proc.name)
    raise AssertionError(f"no `prefect server start --port {port}` process found")


@pytest.fixture
def own_state_dir(prefect_server, tmp_path) -> Path:
    """A state directory whose record names the session's server, as eyas_cli.server records the one it starts."""
    from eyas.train.preflight import process_start_time
    from eyas_cli.server import SERVER_RECORD

    pid = server_process(prefect_server)
    state = tmp_path / "state"
    (state / "prefect").mkdir(parents=True)
    record = {"pid": pid, "start_time": process_start_time(pid), "api_url": prefect_server}
    (state / "prefect" / SERVER_RECORD).write_text(json.dumps(record) + "\n")
    return state


@pytest.fixture
def config(tmp_path, tiny_target_dir):
    return gated_run_config(tmp_path / "run", tiny_target_dir, num_samples=8)


def eyas_without_api_url(state_dir: Path, *args) -> subprocess.CompletedProcess:
    """The command as a user runs it: no PREFECT_API_URL, and Prefect's home not the server's (else a throw-away
    server Prefect starts on its own would read the same database and hide the mistake)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(EYAS_STATE_DIR=str(state_dir), PREFECT_HOME=str(state_dir / "home"))
    return subprocess.run(
        [sys.executable, "-m", "eyas_cli.main", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


def test_approve_and_status_without_prefect_api_url_reach_eyas_s_own_server(own_state_dir, config):
    import threading

    from prefect import flow, tags

    from tasks.gate import approval_gate

    # the gate of `eyas train`, under the train flow's name (the one `eyas status` lists), without its stages
    @flow(name="train-drafter")
    def train_gate(config) -> dict:
        answer = approval_gate(config, "# probe summary")
        return {"approve": answer.approve, "reviewer": answer.reviewer, "note": answer.note}

    tag = f"approve-{uuid.uuid4().hex[:8]}"
    seen: dict = {}

    def answer_from_the_command_line() -> None:
        run = wait_for(lambda: (r := top_run_tagged(tag)) is not None and r.state.is_paused() and r, 120, "the gate")
        seen["status"] = eyas_without_api_url(own_state_dir, "status", str(run.id), "--json")
        seen["approve"] = eyas_without_api_url(
            own_state_dir, "approve", str(run.id), "--reviewer", "ada", "--note", "from the CLI"
        )
        seen["run_id"] = run.id
        if seen["approve"].returncode != 0:  # not answered: end the wait now rather than at the gate's timeout
            from prefect.flow_runs import resume_flow_run

            resume_flow_run(run.id, run_input={"approve": False, "reviewer": "test", "note": "eyas approve failed"})

    thread = threading.Thread(target=answer_from_the_command_line, daemon=True)
    thread.start()
    with tags(tag):
        state = train_gate(config, return_state=True)
    thread.join(timeout=30)

    approve, status = seen["approve"], seen["status"]
    assert approve.returncode == 0, approve.stderr
    assert approve.stdout.strip() == f"flow run {seen['run_id']}: approved by ada"
    assert "starting a local Prefect server" not in approve.stdout + approve.stderr
    assert state.is_completed(), state.message
    assert state.result() == {"approve": True, "reviewer": "ada", "note": "from the CLI"}

    assert status.returncode == 0, status.stderr
    said, snapshot = status.stdout.split("\n", 1)
    assert said == f"flow run {seen['run_id']} (train-drafter, Paused) runs workdir {config.workdir}"
    [waiting] = [r for r in json.loads(snapshot)["flow_runs"] if r["id"] == str(seen["run_id"])]
    assert waiting["state"] == "Paused"


def test_a_command_that_imported_prefect_before_choosing_the_server_stops_at_once(prefect_server):
    import prefect.context  # noqa: F401  (Prefect reads its settings now: the session server's, set first)

    from eyas_cli.server import check_prefect_points_at

    with pytest.raises(RuntimeError, match=r"prefect was imported before eyas chose its server: it reads "):
        check_prefect_points_at("http://127.0.0.1:9/api")
