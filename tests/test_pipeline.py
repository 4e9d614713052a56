"""End to end: the pipeline flow against a real local Prefect server, the gate answered through the API."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from eyas.config import load_run_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def e2e_config(tmp_path_factory, tiny_target_dir):
    """The tiny preset, smaller: fewer samples and prompts, so the whole run takes a few minutes."""
    config = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    workdir = tmp_path_factory.mktemp("e2e-run")
    return config.model_copy(
        update={
            "workdir": str(workdir),
            "target": config.target.model_copy(update={"model_path": str(tiny_target_dir)}),
            "dataset": config.dataset.model_copy(
                update={"prompts_path": str(tiny_target_dir / "prompts.jsonl"), "num_samples": 192, "max_new_tokens": 48}
            ),
            "train": config.train.model_copy(update={"num_epochs": 3}),
            "bench": config.bench.model_copy(
                update={"prompts_path": str(tiny_target_dir / "heldout_prompts.jsonl"), "num_prompts": 12,
                        "max_new_tokens": 48, "min_tau": 1.0}
            ),
        }
    )


def answer_gate_via_api(tag: str, approve: bool, answered: list) -> None:
    """Poll the server for the tagged run; once it is Paused, resume it with the typed input."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.flow_runs import resume_flow_run

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
        for run in runs:
            if run.state is not None and run.state.is_paused():
                resume_flow_run(run.id, run_input={"approve": approve, "reviewer": "e2e-test", "note": "via API"})
                answered.append(run.id)
                return
        time.sleep(1.0)


def run_pipeline_answering(config, approve: bool):
    from prefect import tags

    from flows.pipeline import pipeline

    tag = f"e2e-{uuid.uuid4().hex[:8]}"
    answered: list = []
    thread = threading.Thread(target=answer_gate_via_api, args=(tag, approve, answered), daemon=True)
    thread.start()
    with tags(tag):
        state = pipeline(config, return_state=True)
    thread.join(timeout=5)
    return state, answered


def task_run_names(flow_run_id) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0] for r in runs}


def test_rejected_gate_never_starts_torchrun(prefect_server, e2e_config):
    (e2e_config.paths.root / "approval.json").unlink(missing_ok=True)
    state, answered = run_pipeline_answering(e2e_config, approve=False)
    assert answered, "the run never paused at the approval gate"
    assert state.is_failed()
    assert "training rejected by e2e-test" in state.message
    train_dir = e2e_config.paths.train_dir
    assert not (train_dir / "job.json").exists() and not (train_dir / "torchrun.log").exists()
    assert not (train_dir / "checkpoints").exists()
    names = task_run_names(answered[0])
    assert "smoke-run" in names and "launch-torchrun" not in names
    assert not (e2e_config.paths.root / "approval.json").exists()


def test_approved_pipeline_trains_a_draft_that_beats_a_random_one(prefect_server, e2e_config):
    (e2e_config.paths.root / "approval.json").unlink(missing_ok=True)
    state, answered = run_pipeline_answering(e2e_config, approve=True)
    assert answered, "the run never paused at the approval gate"
    assert state.is_completed(), state.message
    result = json.loads((e2e_config.paths.bench_dir / "benchmark.json").read_text())
    assert result["lossless"] is True
    assert result["num_prompts"] == 12 and result["steps"] == 3
    assert result["tau_random"] <= 1.2
    assert result["tau_mean"] >= result["tau_random"] + 0.5, result
    record = json.loads((e2e_config.paths.root / "approval.json").read_text())
    assert record["approve"] is True and record["reviewer"] == "e2e-test"
    checkpoints = sorted((e2e_config.paths.train_dir / "checkpoints").glob("step-*"))
    assert checkpoints and all((c / "COMPLETE").exists() for c in checkpoints)
