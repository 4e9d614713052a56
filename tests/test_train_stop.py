"""`eyas stop` and `eyas status` on a job of two torchrun agents ("nodes") on loopback, 1 gloo process each, that
share one train directory: the status lists both nodes with their ranks while they train; the stop, run with only
one agent's launcher in the train directory's registry, stops both at the same step with a complete checkpoint
there; a resume then trains to the end with one metric record per step. And the launcher (train_run, one real
torchrun agent): a stop ends it with TrainingStopped, and the next launch clears the request and resumes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_fixtures import tiny_job, write_tiny_run
from test_multinode import free_port

from eyas.config import load_run_config
from eyas.facts import RunFacts
from eyas.fsio import TMP_MARKER
from eyas.status.report import run_status
from eyas.target import TargetFacts
from eyas.train.checkpoint import CHECKPOINTS_DIR, latest_complete, read_trainer_state
from eyas.train.failure import read_failures, record_failure
from eyas.train.launch import JOB_FILE, torchrun_launcher, train_run
from eyas.train.metrics import METRICS_FILE
from eyas.train.nodes import STOP_FILE, TrainingStopped, clear_stop, raise_if_stopped, read_stop, request_stop
from eyas.train.preflight import record_launch

REPO = Path(__file__).resolve().parents[1]
STEPS = 240  # about 25 s of training here: room to look at the nodes and stop them before the end
GUARD_S = 240  # a hang guard only, never a figure the test asserts


def start_agents(cmd: list[str], logs: list[Path]) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )
        for log in logs
    ]


def wait_all(agents: list[subprocess.Popen]) -> list[int]:
    try:
        return [a.wait(timeout=GUARD_S) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()


def wait_for(what: str, ready, agents: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + GUARD_S
    while not ready():
        assert all(a.poll() is None for a in agents), f"an agent exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within the hang guard"
        time.sleep(0.2)


def eyas(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    proc = subprocess.run([sys.executable, "-m", "eyas_cli.main", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=GUARD_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def metric_steps(train_dir: Path) -> list[int]:
    path = train_dir / METRICS_FILE
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def stopped_job(tmp_path_factory) -> dict:
    """Two agents train; once both nodes wrote their records, the status is read and `eyas stop` runs; then the
    status again, and a resume (which clears the request as a launch does) to the last step."""
    root = tmp_path_factory.mktemp("stop")
    run = write_tiny_run(root / "data", num_samples=32)
    workdir = root / "run"
    train_dir = workdir / "train"
    job = tiny_job(run, train_dir, num_epochs=1000, max_steps=STEPS, save_every_steps=1000, num_processes=1,
                   num_nodes=2, rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_join_timeout_s=120)  # fmt: skip
    train_dir.mkdir(parents=True)
    (train_dir / JOB_FILE).write_text(job.model_dump_json())
    cmd = [*torchrun_launcher(job.train, rdzv_id="eyas-stop-test"), "-m", "eyas.train", "--config",
           str(train_dir / JOB_FILE)]  # fmt: skip
    agents = start_agents(cmd, [root / "agent-0.log", root / "agent-1.log"])
    try:
        record_launch(train_dir, agents[0].pid, cmd)  # this machine's registry knows one agent only
        nodes = lambda: run_status(workdir).progress["train"]["nodes"]  # noqa: E731
        wait_for("two node records and a step", lambda: nodes()["alive"] == 2 and metric_steps(train_dir), agents)
        running = run_status(workdir)
        stop = eyas("stop", str(train_dir))
        codes = wait_all(agents)
    finally:
        wait_all(agents)
    logs = [(root / f"agent-{i}.log").read_text() for i in range(2)]
    after = json.loads(eyas("status", str(workdir), "--json").stdout)
    record, final_after_stop = read_stop(train_dir), (train_dir / "final.json").exists()
    checkpoints = sorted((train_dir / CHECKPOINTS_DIR).iterdir())
    launch_id = running.progress["train"]["nodes"]["launch_id"]
    clear_stop(train_dir)  # what every launch does first (eyas.train.launch.train_run)
    resumed = start_agents(cmd, [root / "resume-0.log", root / "resume-1.log"])
    resume_codes = wait_all(resumed)
    return {"train_dir": train_dir, "running": running, "stop": stop, "codes": codes, "logs": logs, "after": after,
            "record": record, "final_after_stop": final_after_stop, "checkpoints": checkpoints, "launch_id": launch_id, "resume_codes": resume_codes,
            "resume_logs": [(root / f"resume-{i}.log").read_text() for i in range(2)]}  # fmt: skip


def test_status_lists_both_nodes_with_their_ranks_while_the_job_runs(stopped_job):
    running = stopped_job["running"]
    nodes = running.progress["train"]["nodes"]["nodes"]
    assert [(n["node_rank"], n["ranks"], n["world_size"], n["alive"]) for n in nodes] == [(0, [0], 2, True),
                                                                                        (1, [1], 2, True)]  # fmt: skip
    assert running.stage("train").state == "running"
    assert "trainer running on 2 node(s)" in running.stage("train").detail
    markdown = running.to_markdown()
    assert "nodes of the running job: 2 of 2 alive" in markdown
    assert f"node 1 on {nodes[1]['host']} (rank 1 of 2, pid {nodes[1]['pid']}): step " in markdown


def test_eyas_stop_stops_both_agents_at_the_same_step_with_a_complete_checkpoint(stopped_job):
    assert stopped_job["codes"] == [0, 0], "\n\n".join(log[-3000:] for log in stopped_job["logs"])
    record, train_dir = stopped_job["record"], stopped_job["train_dir"]
    step = record["stopped_at_step"]
    assert 0 < step < STEPS
    assert record["checkpoint"] == str(train_dir / CHECKPOINTS_DIR / f"step-{step:08d}")
    stop = stopped_job["stop"].stdout
    assert f"stop requested in {train_dir / STOP_FILE}: every rank of the job, on every node, stops" in stop
    assert "exited after the stop: [" in stop and "SIGTERM" not in stop, stop  # the launcher ended on its own
    assert "node 0 on " in stop and "node 1 on " in stop
    assert [c.name for c in stopped_job["checkpoints"]] == [f"step-{step:08d}"]  # no other dir, no temporary
    assert all((c / "COMPLETE").is_file() and TMP_MARKER not in c.name for c in stopped_job["checkpoints"])
    assert read_trainer_state(stopped_job["checkpoints"][0])["samples_consumed"] == step * 8
    assert not stopped_job["final_after_stop"]
    assert f"stopped by `eyas stop` at step {step}" in stopped_job["logs"][0] + stopped_job["logs"][1]


def test_after_the_stop_status_shows_the_nodes_stopped_and_none_alive(stopped_job):
    after, step = stopped_job["after"], stopped_job["record"]["stopped_at_step"]
    summary = after["progress"]["train"]["nodes"]
    assert summary["launch_id"] == stopped_job["launch_id"] and summary["alive"] == 0
    assert [(n["node_rank"], n["ranks"], n["state"], n["step"]) for n in summary["nodes"]] == [
        (0, [0], "stopped", step),
        (1, [1], "stopped", step),
    ]
    train = next(s for s in after["stages"] if s["stage"] == "train")
    assert train["state"] == "partial"
    assert train["detail"].startswith(f"stopped by `eyas stop` at step {step:,} (requested by ")


def test_a_resume_after_the_stop_trains_to_the_end_with_one_metric_record_per_step(stopped_job):
    assert stopped_job["resume_codes"] == [0, 0], "\n\n".join(log[-3000:] for log in stopped_job["resume_logs"])
    train_dir = stopped_job["train_dir"]
    assert metric_steps(train_dir) == list(range(1, STEPS + 1))
    assert latest_complete(train_dir).name == f"step-{STEPS:08d}"
    assert json.loads((train_dir / "final.json").read_text())["step"] == STEPS
    resumed_at = f"resumed from {train_dir / CHECKPOINTS_DIR}/step-{stopped_job['record']['stopped_at_step']:08d}"
    assert resumed_at in "".join(stopped_job["resume_logs"])


def test_the_launcher_raises_on_a_stopped_run_and_names_the_checkpoint_to_resume(tmp_path):
    (tmp_path / STOP_FILE).write_text(json.dumps({"requested_by": "ana", "host": "login-1", "pid": 7,
                                                  "requested_at": "2026-01-02T03:04:05+00:00"}))  # fmt: skip
    raise_if_stopped(tmp_path, 0)  # asked, but the run reached its last step first: finished, nothing raised
    with pytest.raises(TrainingStopped) as killed:
        raise_if_stopped(tmp_path, -15)
    assert str(killed.value).startswith(
        "training stopped by `eyas stop` (requested by ana on login-1 at 2026-01-02T03:04:05+00:00): torchrun exited "
        "with -15 before its ranks stopped (torchrun.log says how); "
    )
    assert str(killed.value).endswith("to start again from step 0 (no complete checkpoint)")
    record = {**json.loads((tmp_path / STOP_FILE).read_text()), "stopped_at_step": 12, "checkpoint": "/c/step-12"}
    (tmp_path / STOP_FILE).write_text(json.dumps(record))
    with pytest.raises(TrainingStopped) as stopped:
        raise_if_stopped(tmp_path, 0)
    assert str(stopped.value) == (
        "training stopped by `eyas stop` at step 12 (requested by ana on login-1 at 2026-01-02T03:04:05+00:00); the "
        f"request: {tmp_path / STOP_FILE}; run `eyas train CONFIG` with this run's config to resume from /c/step-12"
    )


def run_over(run: dict, workdir: Path, **train) -> tuple:
    """(RunConfig, RunFacts) of the tiny preset trained on the synthetic run `run` (its target stub, vocab and
    shards), one agent of one process, with the tiny job's draft and these train settings."""
    job = tiny_job(run, workdir / "train", num_processes=1, **train)
    preset = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    target = preset.target.model_copy(update={"model_path": str(run["target"])})
    config = preset.model_copy(
        update={"workdir": str(workdir), "target": target, "draft": job.draft, "train": job.train}
    )
    config.paths.vocab.parent.mkdir(parents=True)
    shutil.copy(run["vocab"], config.paths.vocab)
    facts = RunFacts(target=TargetFacts.read(run["target"]), aux_layer_ids=job.aux_layer_ids, tokenized_path="",
                     dataset_hash="h", num_samples=32, shards_dir=str(run["shards"]), storage_url=str(run["shards"]))  # fmt: skip
    return config, facts


def test_the_launcher_raises_on_a_stop_and_the_next_launch_clears_it_and_resumes(tmp_path):
    """train_run under a real torchrun: a stop requested as step 3's record arrives (what `eyas stop` writes first)
    ends the launch with TrainingStopped naming the step and checkpoint; the next train_run clears the request
    and trains from that checkpoint to the last step."""
    config, facts = run_over(write_tiny_run(tmp_path / "data", num_samples=32), tmp_path / "run", num_epochs=1000,
                             max_steps=120, save_every_steps=1000)  # fmt: skip
    train_dir = config.paths.train_dir

    def stop_at_step_3(record: dict) -> None:
        if record["step"] == 3:
            request_stop(train_dir)

    with pytest.raises(TrainingStopped) as stopped:
        train_run(config, facts, on_metric=stop_at_step_3)
    step = read_stop(train_dir)["stopped_at_step"]
    checkpoint = train_dir / CHECKPOINTS_DIR / f"step-{step:08d}"
    assert 3 <= step < 120 and str(stopped.value).startswith(f"training stopped by `eyas stop` at step {step} (")
    assert str(stopped.value).endswith(f"run `eyas train CONFIG` with this run's config to resume from {checkpoint}")
    assert latest_complete(train_dir) == checkpoint and not (train_dir / "final.json").exists()

    def a_rank_failed_before_a_restart(record: dict) -> None:  # what a rank torch then restarted leaves behind
        if record["step"] == step + 1:
            record_failure(train_dir, ConnectionResetError("gloo: Connection reset by peer"))

    final = train_run(config, facts, on_metric=a_rank_failed_before_a_restart)
    assert read_stop(train_dir) is None and final["step"] == 120
    assert read_failures(train_dir) == []  # a launch that ended well leaves no reason for `eyas status` to say failed
    assert metric_steps(train_dir) == list(range(1, 121))
