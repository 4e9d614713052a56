"""Whole-machine crashes of a pipeline run from a deployment, on a real server and a real process worker.

One run of a small configuration is crashed three times: the worker and every process under it are
SIGKILLed together while the target's hidden states are extracted, while the run is suspended at the
approval gate, and while the trainer runs; each time a new worker is started and the run retried. The
crash-detection automation (eyas_cli.automation) marks the orphaned run Crashed from its missing
heartbeats, and leaves alone a run suspended at the gate well past the heartbeat window.
The scenario runs once (module fixture); each test checks one of its outcomes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from machine import alive, crash_machine, start_worker
from run_fixtures import small_run_config
from run_queries import (
    answer_when_waiting,
    artifacts,
    client,
    drain_run_logs,
    logs,
    read_run,
    task_runs,
    wait_for,
)
from safetensors.torch import load_file

from eyas.shards.manifest import done_shard_indices, read_manifest
from eyas.train.checkpoint import latest_complete

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
POOL = "crash-test"
WITHIN_S = 60  # heartbeat window of the test's automation (heartbeats every 30 s, the minimum)
NUM_EPOCHS = 5  # the reviewer's override of train.num_epochs (the config says 3)


def small_config(workdir: Path, tiny: Path, **approval):
    return small_run_config(
        workdir,
        tiny,
        extract={"batch_size": 1},
        train={"num_epochs": 3, "global_batch_size": 4, "save_every_steps": 5, "num_warmup_steps": 2},
        smoke={"num_samples": 2, "num_steps": 30},
        approval={"timeout_s": 900, **approval},
        bench={
            "prompts_path": str(tiny / "heldout_prompts.jsonl"),
            "num_prompts": 2,
            "max_new_tokens": 8,
            "min_tau": 0.0,
        },
    )


def descendants(run_id) -> list:
    """Flow runs started under run_id (subflows of every attempt), recursively."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    found, todo = [], [run_id]
    with client() as c:
        while todo:
            children = c.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[todo.pop()]))
            )
            found += children
            todo += [r.id for r in children]
    return found


def crash_running(run_id, message: str) -> None:
    """What the automation does to a dead run and its subflows (used where the test does not wait for it)."""
    from prefect.states import Crashed

    with client() as c:
        for run in [read_run(run_id), *descendants(run_id)]:
            if run.state.is_running():
                c.set_flow_run_state(run.id, Crashed(message=message), force=True)


def retry(run_id) -> None:
    """What the UI's Retry does to a crashed deployment run: schedule it again."""
    from prefect.states import Scheduled

    with client() as c:
        result = c.set_flow_run_state(run_id, Scheduled(name="AwaitingRetry", message="retried after a machine crash"))
    assert result.status.value == "ACCEPT", result.details


def state_of(run_id) -> str:
    return read_run(run_id).state.name


class Timeline:
    def __init__(self):
        self.t0, self.events = time.monotonic(), {}

    def mark(self, name: str, **data) -> None:
        self.events[name] = {"t": round(time.monotonic() - self.t0, 1), **data}
        print(f"[{self.events[name]['t']:7.1f} s] {name} {data or ''}", flush=True)


def reference_outputs(config, ref: Path, log) -> subprocess.Popen:
    """An uninterrupted extraction of the same tokenized table, then an uninterrupted training on it."""
    from eyas.facts import resolve_facts
    from eyas.gate.approval import apply_overrides
    from eyas.train.launch import train_job

    ref.mkdir(parents=True, exist_ok=True)
    (ref / "extract.json").write_text(config.extract.model_dump_json())
    facts = resolve_facts(config)
    job = train_job(apply_overrides(config, {"num_epochs": NUM_EPOCHS}), facts, output_dir=ref / "train")
    (ref / "job.json").write_text(job.model_copy(update={"shards_dir": str(ref / "shards")}).model_dump_json())
    py = sys.executable
    extract = [py, "-m", "eyas.extract", "--tokenized", config.paths.tokenized, "--shards", ref / "shards"]
    extract += ["--target", config.target.model_path, "--config", ref / "extract.json"]
    train = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.train.num_processes}"]
    train += ["-m", "eyas.train", "--config", ref / "job.json"]
    script = f"{shlex.join(map(str, extract))} && {shlex.join(map(str, train))}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def scenario(prefect_server, tmp_path_factory, tiny_target_dir):
    from prefect import flow
    from prefect.deployments import run_deployment

    from eyas_cli.automation import install_crash_detection
    from eyas_cli.worker import ensure_process_pool, worker_environment

    root = tmp_path_factory.mktemp("crash-vm")
    config = small_config(root / "run", tiny_target_dir)
    env = {**os.environ, "PREFECT_API_URL": prefect_server, **worker_environment(root / "results")}
    ensure_process_pool(POOL)
    automation_id = install_crash_detection(within_s=WITHIN_S)
    for name, entrypoint in (
        ("crash-test", "flows/pipeline.py:pipeline"),
        ("crash-test", "tests/gate_probe_flow.py:gate_probe"),
    ):
        flow.from_source(source=str(REPO), entrypoint=entrypoint).deploy(
            name=name, work_pool_name=POOL, build=False, push=False, print_next_steps=False
        )
    timeline, obs = Timeline(), {"config": config, "root": root}
    workers = []

    def new_worker():
        workers.append(start_worker(POOL, env, root / f"worker-{len(workers)}.log", REPO))
        return workers[-1]

    def start(deployment, cfg):
        return run_deployment(deployment, parameters={"config": cfg.model_dump(mode="json")}, timeout=0).id

    try:
        worker = new_worker()
        # a run waiting at the gate long past the heartbeat window, and one whose gate times out
        obs["waiting"] = start("gate-probe/crash-test", small_config(root / "waiting", tiny_target_dir))
        obs["expiring"] = start("gate-probe/crash-test", small_config(root / "expiring", tiny_target_dir, timeout_s=10))
        # both suspend before the pipeline starts (a gate suspends just after a heartbeat: up to ~15 s late)
        waiting_since = wait_for(lambda: read_run(obs["waiting"]).state.is_paused() and time.monotonic(), 120, "gate")
        wait_for(lambda: (s := read_run(obs["expiring"]).state).is_paused() or s.is_final(), 120, "the other gate")
        run_id = obs["run"] = start("pipeline/crash-test", config)
        timeline.mark("started")

        # 1. the machine dies while the hidden states are extracted
        shards = config.paths.shards_dir
        rows = wait_for(lambda: len(done_shard_indices(shards)) >= 3 if shards.is_dir() else 0, 300, "3 shards", 0.01)
        killed = crash_machine(worker.pid)
        worker.wait()
        obs["rows_at_kill"] = len(done_shard_indices(shards))
        timeline.mark("killed during extraction", rows=obs["rows_at_kill"], processes=len(killed))
        assert rows and state_of(run_id) == "Running"
        reference = reference_outputs(config, root / "reference", open(root / "reference.log", "wb"))
        wait_for(lambda: state_of(run_id) == "Crashed", 3 * WITHIN_S, "the automation to mark the run Crashed")
        timeline.mark("marked Crashed by the automation", message=read_run(run_id).state.message)
        obs["next_after_crash"] = status_next_steps(config)
        wait_for(lambda: time.monotonic() > waiting_since + WITHIN_S + 20, 2 * WITHIN_S, "the window to pass")
        obs["waiting_state_past_window"] = state_of(obs["waiting"])
        obs["expiring_state"] = read_run(obs["expiring"]).state

        # 2. retried on a new machine: the gate suspends the run; that machine dies while it waits
        worker = new_worker()
        retry(run_id)
        wait_for(lambda: read_run(run_id).state.name == "Suspended", 600, "the run to suspend at the gate")
        timeline.mark("suspended at the gate")
        obs["next_at_gate"] = status_next_steps(config)
        crash_machine(worker.pid)
        worker.wait()
        worker = new_worker()
        answers = [
            {"approve": True, "reviewer": ""},
            {"approve": True, "reviewer": "crash-test", "num_epochs": NUM_EPOCHS},
        ]
        thread, obs["answers"] = answer_when_waiting(lambda: read_run(run_id), answers)
        thread.join(timeout=60)

        # 3. the machine dies while the trainer runs (after its first checkpoints)
        train_dir = config.paths.train_dir
        wait_for(lambda: (c := latest_complete(train_dir)) and c.name >= "step-00000010", 600, "checkpoint 10", 0.05)
        killed = crash_machine(worker.pid)
        worker.wait()
        obs["checkpoint_at_kill"] = latest_complete(train_dir)
        time.sleep(2)  # the kernel tears the killed processes down
        obs["survivors"] = alive(killed)
        timeline.mark("killed during training", checkpoint=obs["checkpoint_at_kill"].name)
        crash_running(run_id, "marked Crashed by the test, as the automation would after its window")
        worker = new_worker()
        retry(run_id)
        wait_for(lambda: read_run(run_id).state.is_final(), 600, "the run to finish")
        timeline.mark("finished", state=state_of(run_id))

        # the run waiting at the gate is rejected: it runs again from the top and fails without training
        thread, _ = answer_when_waiting(
            lambda: read_run(obs["waiting"]), [{"approve": False, "reviewer": "crash-test"}]
        )
        thread.join(timeout=60)
        wait_for(lambda: read_run(obs["waiting"]).state.is_final(), 120, "the rejected run to end")
        assert reference.wait(timeout=600) == 0, (root / "reference.log").read_text()[-3000:]
        drain_run_logs()
        obs["timeline"] = timeline.events
        yield obs
    finally:
        for worker in workers:
            if worker.poll() is None:  # only a worker of this test still running (its pid is not reused)
                crash_machine(worker.pid)
                worker.wait()
        from prefect.automations import Automation

        Automation.read(id=automation_id).delete()  # the session's other runs beat every 180 s
        drain_run_logs()


def status_next_steps(config) -> list[str]:
    """What `eyas status CONFIG` advises now, with the server's flow runs (as eyas_cli.main.show_status)."""
    from eyas.status.report import run_status
    from tasks.status import recent_flow_runs

    status = run_status(config)
    status.attach_flow_runs(recent_flow_runs(config.paths.root))
    return status.next_steps()


def all_runs(obs) -> list:
    return [read_run(obs["run"]), *descendants(obs["run"])]


def task_states(obs, name: str) -> list[str]:
    """States of the task's runs over every attempt of the run, in the order they started (without the task
    runs that stand for subflow calls: the flow `verify-shards` has one in its parent, like the task)."""
    runs = all_runs(obs)
    subflow_calls = {run.parent_task_run_id for run in runs}
    found = [r for run in runs for r in task_runs(run.id, name) if r.id not in subflow_calls]
    return [r.state.name for r in sorted(found, key=lambda r: r.start_time or r.expected_start_time)]


def test_run_on_a_dead_machine_is_marked_crashed_by_the_automation(scenario):
    from prefect.client.schemas.objects import StateType

    with client() as c:
        crashed = [s for s in c.read_flow_run_states(scenario["run"]) if s.type == StateType.CRASHED]
    assert crashed and "no heartbeat for 60 s" in crashed[0].message


def test_status_advises_the_retry_of_a_crashed_deployment_run(scenario):
    run_id = scenario["run"]
    [step] = scenario["next_after_crash"]
    assert step.startswith(f"flow run {run_id} (pipeline) Crashed (no heartbeat for 60 s")
    assert f"retry it with `.venv/bin/prefect flow-run retry {run_id}` (its deployment's worker" in step


def test_status_at_the_suspended_gate_gives_the_exact_answer_commands(scenario):
    run_id = scenario["run"]
    assert scenario["next_at_gate"] == [
        f"flow run {run_id} (pipeline) waits at the approval gate: read the summary in the UI (Resume), then "
        f"`eyas approve {run_id}` or `eyas approve {run_id} --reject --note WHY`"
    ]


def test_run_suspended_at_the_gate_past_the_heartbeat_window_is_not_crashed(scenario):
    assert scenario["waiting_state_past_window"] == "Suspended"


def test_pipeline_run_retried_after_every_crash_completes(scenario):
    run = read_run(scenario["run"])
    assert run.state.is_completed(), run.state.message
    assert run.run_count == 3  # two retries after crashes (a resumed suspension is the same attempt)


def test_nothing_a_crashed_attempt_left_stays_running(scenario):
    """The killed attempts left task runs Running (launch-torchrun among them) and their subflows were marked
    Crashed around them; each retry settles them (tasks.attempts): when the run is over, every task run and flow
    run of every attempt is final, and the settled ones say which attempt replaced them."""
    runs = all_runs(scenario)
    stuck = [(run.name, t.name, t.state.name) for run in runs for t in task_runs(run.id) if not t.state.is_final()]
    assert not stuck, stuck
    assert all(run.state.is_final() for run in runs), [(r.name, r.state.name) for r in runs]
    settled = [t for run in runs for t in task_runs(run.id) if "an earlier attempt" in (t.state.message or "")]
    assert any(t.name.startswith("launch-torchrun") for t in settled), [t.name for t in settled]
    assert all(t.state.name == "Crashed" for t in settled)


def test_finished_stages_come_back_from_cache(scenario):
    assert task_states(scenario, "regenerate-and-tokenize") == ["Completed", "Cached", "Cached", "Cached"]
    assert task_states(scenario, "build-vocab-mapping") == ["Completed", "Cached", "Cached", "Cached"]
    assert task_states(scenario, "verify-shards") == ["Completed", "Cached", "Cached"]
    assert task_states(scenario, "smoke-run") == ["Completed", "Cached", "Cached"]


def test_interrupted_extraction_resumes_from_its_manifest(scenario):
    messages = "\n".join(m for run in all_runs(scenario) for m in logs(run.id))
    total = len(read_manifest(scenario["config"].paths.shards_dir))
    done = scenario["rows_at_kill"]
    assert f"extraction plan: {total} shards, {done} done, {total - done} to extract" in messages


def test_the_newest_training_subflow_plots_the_whole_resumed_run(scenario):
    trainings = sorted(
        (r for r in descendants(scenario["run"]) if artifacts(r.id, "loss-curve")),
        key=lambda r: r.start_time or r.expected_start_time,
    )
    assert trainings, "no training subflow drew a loss curve"
    [curve] = artifacts(trainings[-1].id, "loss-curve")
    step = int(scenario["checkpoint_at_kill"].name.split("-")[1])
    assert curve.description.startswith("training loss per TTT step and accuracy per position, steps 1-")
    assert f"over 2 launches (resumed at [{step + 1}])" in curve.description


def test_interrupted_training_resumes_from_its_newest_checkpoint(scenario):
    checkpoint = scenario["checkpoint_at_kill"]
    messages = "\n".join(m for run in all_runs(scenario) for m in logs(run.id))
    assert f"resuming from {checkpoint} (step {int(checkpoint.name.split('-')[1])}," in messages
    assert f"resumed from {checkpoint}" in (scenario["config"].paths.train_dir / "torchrun.log").read_text()
    assert scenario["survivors"] == set()


def test_outputs_equal_an_uninterrupted_run(scenario):
    shards, ref = scenario["config"].paths.shards_dir, scenario["root"] / "reference"
    names = sorted(p.name for p in shards.glob("shard-*.safetensors"))
    assert names == sorted(p.name for p in (ref / "shards").glob("shard-*.safetensors"))
    assert all((shards / n).read_bytes() == (ref / "shards" / n).read_bytes() for n in names)
    assert read_manifest(shards) == read_manifest(ref / "shards")
    final, expected = latest_complete(scenario["config"].paths.train_dir), latest_complete(ref / "train")
    assert final.name == expected.name
    got, want = load_file(final / "model.safetensors"), load_file(expected / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_gate_refuses_invalid_input_while_suspended_and_applies_the_override(scenario):
    refused, accepted = scenario["answers"]
    assert refused[0] == "refused" and "reviewer" in refused[1] and refused[2] is True
    assert accepted[0] == "accepted"
    job = json.loads((scenario["config"].paths.train_dir / "job.json").read_text())
    assert job["train"]["num_epochs"] == NUM_EPOCHS
    record = json.loads((scenario["config"].paths.root / "approval.json").read_text())
    assert record["overrides"] == {"num_epochs": NUM_EPOCHS} and record["reviewer"] == "crash-test"
    decisions = [a.data for run in all_runs(scenario) for a in artifacts(run.id, "approval-decision")]
    assert any("Training approved" in d and f"train.num_epochs = {NUM_EPOCHS}" in d for d in decisions)


def test_rejected_suspended_run_fails_without_training(scenario):
    run = read_run(scenario["waiting"])
    assert run.state.is_failed() and "training rejected by crash-test" in run.state.message


def test_suspended_run_past_its_timeout_is_failed_by_the_server(scenario):
    state = scenario["expiring_state"]
    assert state.is_failed() and state.message == "The flow was paused and never resumed."
