"""train.start='streaming': the config's limits, the streamed trainer job, and the whole pipeline against a real
local Prefect server (gate answered through the API), whose weights equal those of the same run offline."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from run_fixtures import small_run_config
from safetensors.torch import load_file

from eyas.extract.plan import describe_extraction
from eyas.facts import facts_for
from eyas.shards.manifest import read_manifest
from eyas.train.checkpoint import FINAL_FILE, MODEL_FILE
from eyas.train.launch import train_job
from eyas.train.metrics import METRICS_FILE, read_metrics


def conversations(tiny: Path, path: Path, num_samples: int = 16) -> Path:
    """`num_samples` of the tiny target's prompts, each answered by the next one's text (no regeneration)."""
    prompts = [json.loads(line) for line in (tiny / "prompts.jsonl").read_text().splitlines()[: num_samples + 1]]
    with open(path, "w") as out:
        for prompt, answer in zip(prompts, prompts[1:]):
            turns = [*prompt["conversations"], {"role": "assistant", "content": answer["conversations"][0]["content"]}]
            out.write(json.dumps({"id": prompt["id"], "conversations": turns}) + "\n")
    return path


def run_config(workdir: Path, tiny: Path, start: str = "offline", **sections):
    workdir.mkdir(parents=True, exist_ok=True)
    return small_run_config(
        workdir,
        tiny,
        train={
            "start": start,
            "num_epochs": 2,
            "global_batch_size": 4,
            "save_every_steps": 4,
            "num_warmup_steps": 2,
            **sections.pop("train", {}),
        },  # fmt: skip
        dataset={
            "prompts_path": str(conversations(tiny, workdir / "conversations.jsonl")),
            "responses": "as_given",
            "num_samples": 16,
        },  # fmt: skip
        smoke={"num_samples": 2, "num_steps": 20},
        bench={
            "prompts_path": str(tiny / "heldout_prompts.jsonl"),
            "num_prompts": 2,
            "max_new_tokens": 8,
            "min_tau": 0.0,
        },  # fmt: skip
        **sections,
    )


def test_streaming_refuses_extract_worker_flow_runs(tmp_path, tiny_target_dir):
    with pytest.raises(ValidationError) as err:
        run_config(tmp_path, tiny_target_dir, "streaming").model_validate(
            {
                **run_config(tmp_path, tiny_target_dir, "streaming").model_dump(),
                "extract": {"fanout": "deployment", "worker_deployment": "extract-worker/gpu"},
            }  # fmt: skip
        )
    assert "train.start='streaming' with extract.fanout='deployment'" in str(err.value)
    assert "set extract.fanout='local'" in str(err.value)


def test_streaming_from_s3_needs_the_shard_cache(tmp_path, tiny_target_dir):
    data = run_config(tmp_path, tiny_target_dir, "streaming").model_dump()
    data["extract"]["storage_url"] = "s3://bucket/run"
    with pytest.raises(ValidationError) as err:
        type(run_config(tmp_path, tiny_target_dir)).model_validate(data)
    assert "extract.storage_url='s3://bucket/run' and train.cache_bytes=0" in str(err.value)
    assert "set train.cache_bytes" in str(err.value)


def test_offline_start_is_left_out_of_every_dump(tmp_path, tiny_target_dir):
    offline = run_config(tmp_path, tiny_target_dir)
    assert "start" not in offline.model_dump()["train"]
    assert run_config(tmp_path, tiny_target_dir, "streaming").model_dump()["train"]["start"] == "streaming"
    assert type(offline).model_validate(offline.model_dump()).train.start == "offline"


@pytest.fixture(scope="module")
def tokenized_run(tmp_path_factory, tiny_target_dir):
    """A tokenized table and vocab of the tiny run (the dataset stage's library call), and its facts."""
    from eyas.dataset.build import build_dataset

    config = run_config(tmp_path_factory.mktemp("job"), tiny_target_dir)
    build_dataset(config)
    return config, facts_for(target_path=tiny_target_dir, tokenized_path=config.paths.tokenized,
                             shards_dir=config.paths.shards_dir)  # fmt: skip


def test_the_streamed_job_carries_the_extractions_plan(tokenized_run):
    config, facts = tokenized_run
    streaming = config.model_copy(update={"train": config.train.model_copy(update={"start": "streaming"})})
    job = train_job(streaming, facts)
    _, plan = describe_extraction(config.extract, facts, target_dtype=config.target.dtype)
    assert len(plan) > 2
    assert [(p.sample_start, p.sample_end, p.num_tokens) for p in job.stream.plan] == [
        (p.sample_start, p.sample_end, p.num_tokens) for p in plan
    ]
    assert job.stream.verify_mode == config.verify.mode
    offline = train_job(config, facts)
    assert offline.stream is None and '"start"' not in offline.model_dump_json()
    assert offline.model_dump_json() == job.model_copy(update={"stream": None, "train": config.train}).model_dump_json()


def answer_gate(tag: str, config, seen: dict) -> None:
    """Once the tagged run is paused at the gate: record the shards committed then (`seen["manifest"]`), and
    approve through the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.flow_runs import resume_flow_run

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
        paused = [r for r in runs if r.state is not None and r.state.is_paused()]
        if paused:
            seen["manifest"] = [r.shard_index for r in read_manifest(config.paths.shards_dir)]
            seen["trained"] = config.paths.train_dir.exists()
            resume_flow_run(paused[0].id, run_input={"approve": True, "reviewer": "stream-test", "note": ""})
            return
        time.sleep(0.5)


def run_pipeline(config) -> tuple[object, dict]:
    from prefect import tags

    from flows.pipeline import pipeline

    tag, seen = f"stream-{uuid.uuid4().hex[:8]}", {}
    thread = threading.Thread(target=answer_gate, args=(tag, config, seen), daemon=True)
    thread.start()
    with tags(tag):
        state = pipeline(config, return_state=True)
    thread.join(timeout=5)
    return state, seen


def final_weights(config) -> dict[str, torch.Tensor]:
    final = json.loads((config.paths.train_dir / FINAL_FILE).read_text())
    return load_file(Path(final["checkpoint"]) / MODEL_FILE)


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_a_streamed_pipeline_gates_on_the_smoke_shards_and_trains_as_offline(prefect_server, tmp_path, tiny_target_dir):
    from tasks.stream import smoke_shards

    offline = run_config(tmp_path / "offline", tiny_target_dir)
    streaming = run_config(tmp_path / "streaming", tiny_target_dir, "streaming")
    state, seen_offline = run_pipeline(offline)
    assert state.is_completed(), state.message
    state, seen = run_pipeline(streaming)
    assert state.is_completed(), state.message

    facts = facts_for(target_path=tiny_target_dir, tokenized_path=streaming.paths.tokenized,
                      shards_dir=streaming.paths.shards_dir)  # fmt: skip
    planned = len(describe_extraction(streaming.extract, facts)[1])
    assert seen["manifest"] == smoke_shards(streaming, facts) and len(seen["manifest"]) < planned, seen
    assert seen["trained"] is False
    assert len(seen_offline["manifest"]) == planned  # offline gates after the whole extraction
    assert len(read_manifest(streaming.paths.shards_dir)) == planned
    job = json.loads((streaming.paths.train_dir / "job.json").read_text())
    assert len(job["stream"]["plan"]) == planned  # its ranks read each shard once its verdict is there
    assert json.loads((offline.paths.train_dir / "job.json").read_text())["stream"] is None

    a, b = final_weights(offline), final_weights(streaming)
    assert sorted(a) == sorted(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    steps_a = [(m["step"], m["sample_ids"]) for m in read_metrics(offline.paths.train_dir / METRICS_FILE)]
    steps_b = [(m["step"], m["sample_ids"]) for m in read_metrics(streaming.paths.train_dir / METRICS_FILE)]
    assert steps_a == steps_b and len(steps_a) > 4


def test_only_the_smoke_shards_are_extracted_and_verified(tokenized_run):
    from eyas.extract.streamed import run_streamed_extraction
    from eyas.shards.verdicts import read_verdicts
    from tasks.stream import smoke_shards, trainer_order

    config, facts = tokenized_run
    only = smoke_shards(config, facts)
    with pytest.raises(ValueError, match=r"only=\[99\], expected a non-empty set of planned shard indices"):
        run_streamed_extraction(config, facts, only=[99], log=lambda line: None)
    summary = run_streamed_extraction(config, facts, shard_order=trainer_order(config, facts), only=only,
                                      log=lambda line: None, poll_s=0.02)  # fmt: skip
    assert [r.shard_index for r in read_manifest(config.paths.shards_dir)] == only
    assert summary.shards_total == summary.shards_written == len(only)
    assert summary.samples_total >= config.smoke.num_samples
    verdicts = read_verdicts(config.paths.shards_dir)
    assert {name.rsplit("/", 1)[-1].split(".")[0] for name in verdicts} == {f"shard-{k:05d}" for k in only}, verdicts
