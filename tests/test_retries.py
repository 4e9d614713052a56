"""Retry policies (tasks/retry.py, tasks/train.py): transient failures are retried, deterministic ones
never, the trainer is relaunched only after progress. Attempts are counted on the server."""

from __future__ import annotations

import errno
import sys
import textwrap

import pytest
from run_queries import logs, task_run_state_names, task_runs

from eyas.config import load_run_config
from eyas.facts import RunFacts

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")


@pytest.fixture
def config(tmp_path, tiny_target_dir):
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    return base.model_copy(
        update={
            "workdir": str(tmp_path / "run"),
            "target": base.target.model_copy(update={"model_path": str(tiny_target_dir)}),
            "dataset": base.dataset.model_copy(update={"prompts_path": str(tiny_target_dir / "prompts.jsonl")}),
        }
    )


def transient_cases():
    import httpx
    from botocore.exceptions import ClientError, EndpointConnectionError

    throttled = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject")
    denied = ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject")
    request = httpx.Request("POST", "http://server/api")
    server_error = httpx.HTTPStatusError("503", request=request, response=httpx.Response(503, request=request))
    not_found = httpx.HTTPStatusError("404", request=request, response=httpx.Response(404, request=request))
    wrapped = RuntimeError("manifest unreadable")
    wrapped.__cause__ = ConnectionResetError()
    verdict = ValueError("shard 3: width 128, expected 384")
    verdict.__cause__ = TimeoutError()
    return [
        (ConnectionResetError(), True),
        (TimeoutError(), True),
        (OSError(errno.EIO, "I/O error"), True),
        (OSError(errno.ESTALE, "stale NFS handle"), True),
        (EndpointConnectionError(endpoint_url="http://s3"), True),
        (throttled, True),
        (server_error, True),
        (httpx.ConnectError("refused"), True),
        (wrapped, True),
        (FileNotFoundError(errno.ENOENT, "no such file"), False),
        (PermissionError(errno.EACCES, "denied"), False),
        (denied, False),
        (not_found, False),
        (verdict, False),
        (ValueError("bad config"), False),
        (RuntimeError("smoke run: loss went 5.1 -> 5.0"), False),
        (KeyError("aux_hidden_states"), False),
    ]


def test_failures_are_classified_transient_or_deterministic(prefect_server):
    from tasks.retry import is_transient

    wrong = [(type(e).__name__, str(e), expected) for e, expected in transient_cases() if is_transient(e) != expected]
    assert wrong == []


def test_deterministic_errors_of_the_pipeline_are_not_transient(prefect_server):
    from eyas.dataset.prompts import DatasetError
    from eyas.verify.shard_set import ShardVerificationError
    from tasks.gate import TrainingRejected
    from tasks.retry import is_transient

    for exc in (DatasetError("x"), ShardVerificationError("x", report=None), TrainingRejected("x")):
        assert not is_transient(exc), exc


def run_task_in_flow(task_fn, *args):
    """Call one task (no retry delay) inside a flow run; returns (flow state, the task's runs)."""
    from prefect import flow

    @flow(name="retry-probe", log_prints=True)
    def probe():
        return task_fn.with_options(retry_delay_seconds=0)(*args)

    state = probe(return_state=True)
    flow_run_id = state.state_details.flow_run_id
    return state, task_runs(flow_run_id, task_fn.name), flow_run_id


def test_transient_failure_is_retried_and_then_succeeds(prefect_server, config, monkeypatch):
    import tasks.export
    from tasks.export import export_checkpoint

    calls = []

    def flaky_export(config):
        calls.append(config)
        if len(calls) == 1:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return config.paths.export_dir / "sglang"

    monkeypatch.setattr(tasks.export, "export_run", flaky_export)
    state, [run], _ = run_task_in_flow(export_checkpoint, config)
    assert state.is_completed(), state.message
    assert run.run_count == 2 and len(calls) == 2
    assert "Retrying" in task_run_state_names(run.id)


def test_deterministic_error_is_not_retried(prefect_server, config):
    from tasks.export import export_checkpoint

    state, [run], _ = run_task_in_flow(export_checkpoint, config)  # no checkpoint: FileNotFoundError
    assert state.is_failed() and "no complete checkpoint" in state.message
    assert run.run_count == 1 and "Retrying" not in task_run_state_names(run.id)


def test_bad_data_error_is_not_retried(prefect_server, config, monkeypatch):
    import tasks.dataset
    from eyas.dataset.prompts import DatasetError
    from tasks.dataset import regenerate_and_tokenize

    def bad_dataset(*args, **kwargs):
        raise DatasetError("sample p3: roles do not alternate")

    monkeypatch.setattr(tasks.dataset, "build_dataset", bad_dataset)
    state, [run], _ = run_task_in_flow(regenerate_and_tokenize, config)
    assert state.is_failed() and "roles do not alternate" in state.message
    assert run.run_count == 1


FAKE_TRAINER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["output_dir"])
    done = sorted((out / "checkpoints").glob("step-*"))

    def checkpoint(step):
        path = out / "checkpoints" / f"step-{step:08d}"
        path.mkdir(parents=True)
        (path / "trainer_state.json").write_text(json.dumps({"step": step, "samples_consumed": 16 * step}))
        (path / "COMPLETE").write_text("")

    if os.environ["FAKE_TRAINER"] == "crash-without-progress":
        sys.exit(3)
    if not done:  # first launch: a checkpoint at step 2, then the node dies
        checkpoint(2)
        sys.exit(1)
    checkpoint(4)
    (out / "final.json").write_text(json.dumps({"step": 4}))
    """
)


@pytest.fixture
def fake_trainer(tmp_path, monkeypatch):
    import eyas.train.launch

    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(
        eyas.train.launch, "torchrun_command", lambda config, job_path: [sys.executable, str(script), str(job_path)]
    )
    return monkeypatch


def facts_of(config) -> RunFacts:
    """Facts for a trainer that reads no shard (the fake one)."""
    target = {"model_path": config.target.model_path, "num_layers": 8, "hidden_size": 128, "vocab_size": 512}
    return RunFacts(
        target={**target, "fingerprint": "f"},
        aux_layer_ids=[2, 4, 5],
        tokenized_path=str(config.paths.tokenized),
        dataset_hash="h",
        num_samples=64,
        shards_dir=str(config.paths.shards_dir),
        storage_url=str(config.paths.shards_dir),
    )


def test_trainer_that_progressed_is_relaunched_from_its_newest_checkpoint(prefect_server, config, fake_trainer):
    from tasks.train import launch_torchrun

    fake_trainer.setenv("FAKE_TRAINER", "crash-after-checkpoint")
    state, [run], flow_run_id = run_task_in_flow(launch_torchrun, config, facts_of(config))
    assert state.is_completed(), state.message
    assert state.result() == {"step": 4} and run.run_count == 2
    messages = "\n".join(logs(flow_run_id))
    assert f"no complete checkpoint in {config.paths.train_dir}: training starts at step 0" in messages
    assert "trainer failed after reaching step-00000002 (started from step 0): relaunching" in messages
    resumed = config.paths.train_dir / "checkpoints" / "step-00000002"
    assert f"resuming from {resumed} (step 2, 32 samples consumed)" in messages


def test_trainer_that_failed_without_progress_is_not_relaunched(prefect_server, config, fake_trainer):
    from tasks.train import launch_torchrun

    fake_trainer.setenv("FAKE_TRAINER", "crash-without-progress")
    state, [run], flow_run_id = run_task_in_flow(launch_torchrun, config, facts_of(config))
    assert state.is_failed() and "torchrun exited with 3" in state.message
    assert run.run_count == 1
    assert "no progress, not relaunched" in "\n".join(logs(flow_run_id))
