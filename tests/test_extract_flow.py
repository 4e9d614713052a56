"""The extract-hidden-states flow against a real Prefect server: two concurrent worker tasks on disjoint
shards, progress as an artifact; S3 as the shard store with a verified local copy, healed through S3; S3 with a
shard cache and no local copy at all (verified, healed, trained and reported from S3)."""

from __future__ import annotations

import math
import random

import pytest
from run_fixtures import write_tokenized
from run_queries import artifacts

from eyas.config import load_run_config
from eyas.shards.format import load_shard, shard_filename, write_shard
from eyas.shards.manifest import read_manifest
from eyas.storage.s3 import S3Storage

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")


def _config(tmp_path, tiny_target_dir, random_target_dir, train=None, **extract):
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    data = base.model_dump()
    data["workdir"] = str(tmp_path / "run")
    data["target"]["model_path"] = str(random_target_dir)
    data["extract"].update({"shard_bytes": 1 << 16, "batch_size": 4, **extract})
    data["train"].update(train or {})
    config = type(base).model_validate(data)  # validated whole: train.cache_bytes needs an s3 storage_url
    rng = random.Random(5)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 20))] for _ in range(24)]
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, samples)
    return config


def _task_runs(flow_run_id, name):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)),
        )


def test_two_worker_tasks_extract_disjoint_shards(prefect_server, tmp_path, tiny_target_dir, random_target_dir):

    from flows.extract import extract_flow

    config = _config(tmp_path, tiny_target_dir, random_target_dir, num_workers=2)
    state = extract_flow(config, return_state=True)
    summary = state.result()
    rows = read_manifest(config.paths.shards_dir)
    assert summary["shards_written"] == summary["shards_total"] == len(rows) > 4
    workers = _task_runs(state.state_details.flow_run_id, "extract-worker-shards")
    assert len(workers) == 2 and all(w.state.is_completed() for w in workers)
    a, b = workers
    assert a.start_time < b.end_time and b.start_time < a.end_time  # the two tasks ran at the same time
    lists = [w["shard_indices"] for w in summary["workers"]]
    assert not set(lists[0]) & set(lists[1])  # disjoint
    assert sorted(lists[0] + lists[1]) == [r.shard_index for r in rows]  # and nothing missed
    progress = artifacts(state.state_details.flow_run_id, "extract-progress")
    assert progress and progress[0].data == 100.0
    assert f"shards {len(rows)}/{len(rows)}" in progress[0].description

    again = extract_flow(config)
    assert (again["shards_written"], again["shards_skipped"]) == (0, len(rows))


def test_s3_shard_store_with_local_copy_heals_through_s3(
    prefect_server, s3_bucket, s3_endpoint, tmp_path, tiny_target_dir, random_target_dir
):
    from flows.extract import extract_flow
    from flows.verify import verify_flow

    url = f"s3://{s3_bucket}/runs/flow/shards"
    config = _config(tmp_path, tiny_target_dir, random_target_dir, storage_url=url, s3_endpoint_url=s3_endpoint)
    summary = extract_flow(config)
    store = S3Storage(url, endpoint_url=s3_endpoint)
    assert summary["storage"] == url and summary["local_copy"]["fetched"] == len(read_manifest(store))
    assert read_manifest(config.paths.shards_dir) == read_manifest(store)

    shards = config.paths.shards_dir  # damage the local copy of shard 1 (valid checksum, a NaN inside)
    tensors, meta = load_shard(shards / shard_filename(1))
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors["aux_hidden_states"][0, 0] = math.nan
    write_shard(shards, tensors, meta)
    (shards / "manifest.parquet").unlink()
    from eyas.shards.manifest import write_manifest

    write_manifest(
        shards, [write_shard(shards, tensors, meta) if r.shard_index == 1 else r for r in read_manifest(store)]
    )
    healed = verify_flow(config)
    assert (healed["bad"], healed["quarantined"]) == (0, 1)
    assert read_manifest(config.paths.shards_dir) == read_manifest(store)  # re-extracted on S3, fetched again


def test_deployment_fanout_runs_one_flow_run_per_worker(prefect_server, tmp_path, tiny_target_dir, random_target_dir):
    """fanout='deployment': each worker is a flow run of a served `extract-worker` deployment (the same
    run_deployment call a work pool of GPU nodes answers)."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    from flows.extract import extract_flow

    repo = Path(__file__).resolve().parents[1]
    serve = "from flows.extract import extract_worker_flow; extract_worker_flow.serve(name='fanout-test', limit=2)"
    env = {**os.environ, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = open(tmp_path / "serve.log", "wb")
    runner = subprocess.Popen([sys.executable, "-c", serve], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        with get_client(sync_client=True) as client:
            while True:
                try:
                    client.read_deployment_by_name("extract-worker/fanout-test")
                    break
                except Exception as e:  # ObjectNotFound until the runner has registered it
                    if runner.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the runner did not serve the deployment: {(tmp_path / 'serve.log').read_text()}"
                        ) from e
                    time.sleep(0.5)
        config = _config(
            tmp_path,
            tiny_target_dir,
            random_target_dir,
            num_workers=2,
            fanout="deployment",
            worker_deployment="extract-worker/fanout-test",
        )
        state = extract_flow(config, return_state=True)
        summary = state.result()
        rows = read_manifest(config.paths.shards_dir)
        assert summary["shards_written"] == len(rows) > 4
        with get_client(sync_client=True) as client:
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[state.state_details.flow_run_id])
                )
            )
        workers = [r for r in children if r.deployment_id is not None]
        assert len(workers) == 2 and all(r.state.is_completed() for r in workers)
        assert sorted(r.parameters["worker_index"] for r in workers) == [0, 1]
        lists = [r.parameters["shard_indices"] for r in workers]
        assert not set(lists[0]) & set(lists[1]) and sorted(lists[0] + lists[1]) == [r.shard_index for r in rows]
    finally:
        runner.terminate()
        runner.wait(timeout=30)


def test_retried_worker_task_extracts_only_the_shards_its_failed_attempt_left(
    prefect_server, monkeypatch, tmp_path, tiny_target_dir, random_target_dir
):
    from prefect import flow

    import eyas.extract.worker
    from eyas.extract.plan import describe_extraction
    from eyas.facts import resolve_facts
    from tasks.extract import extract_worker_shards

    config = _config(tmp_path, tiny_target_dir, random_target_dir)
    facts = resolve_facts(config)
    real_worker, attempts = eyas.extract.worker.extract_worker, []

    def worker_losing_its_connection(**kwargs):
        attempts.append(list(kwargs["shard_indices"]))
        if len(attempts) == 1:  # the first attempt writes two shards, then storage drops the connection
            real_worker(**{**kwargs, "shard_indices": kwargs["shard_indices"][:2]})
            raise ConnectionResetError("connection reset by peer")
        return real_worker(**kwargs)

    monkeypatch.setattr(eyas.extract.worker, "extract_worker", worker_losing_its_connection)

    @flow(name="worker-retry-probe")
    def probe() -> dict:
        todo = [p.index for p in describe_extraction(config.extract, facts)[1]]
        return extract_worker_shards.with_options(retry_delay_seconds=0)(config, facts, 0, todo)

    summary = probe()
    first, second = attempts
    assert len(first) > 3 and second == first[2:]  # the retry skipped the two recorded shards
    assert summary["shards_already_recorded"] == 2
    assert sorted(r.shard_index for r in read_manifest(config.paths.shards_dir)) == first


def test_s3_shards_with_a_cache_keep_no_local_copy(
    prefect_server, s3_bucket, s3_endpoint, tmp_path, tiny_target_dir, random_target_dir
):
    """train.cache_bytes > 0: extraction copies nothing to RUN/shards; verification reads S3, quarantines a bad
    shard on S3 (moved to quarantine/ beside its reason), re-extracts it there; training reads S3 through its
    cache; eyas status counts the shards on S3."""
    import tempfile
    import threading
    from pathlib import Path

    from eyas.dataset.vocab import build_vocab
    from eyas.facts import resolve_facts
    from eyas.shards.manifest import write_manifest
    from eyas.status.report import run_status
    from eyas.train.launch import train_job
    from eyas.train.smoke import smoke_train
    from flows.extract import extract_flow
    from flows.train import train_flow
    from flows.verify import verify_flow

    url = f"s3://{s3_bucket}/runs/nocopy/shards"
    train = {"cache_bytes": 4 << 16, "shuffle_window_shards": 1, "max_steps": 3, "save_every_steps": 2}
    config = _config(tmp_path, tiny_target_dir, random_target_dir, train, storage_url=url, s3_endpoint_url=s3_endpoint)
    summary = extract_flow(config)
    store = S3Storage(url, endpoint_url=s3_endpoint)
    rows = read_manifest(store)
    assert summary["storage"] == url and summary["local_copy"] == {"fetched": 0, "kept": 0} and len(rows) > 4
    assert not config.paths.shards_dir.exists()

    with tempfile.TemporaryDirectory() as tmp:  # shard 1 on S3 gets a NaN, its row the damaged bytes' checksum
        store.download_to(shard_filename(1), Path(tmp) / "s")
        tensors, meta = load_shard(Path(tmp) / "s")
        tensors = {k: v.clone() for k, v in tensors.items()}
    tensors["aux_hidden_states"][0, 0] = math.nan
    damaged = write_shard(store, tensors, meta)
    write_manifest(store, [damaged if r.shard_index == 1 else r for r in rows])

    healed = verify_flow(config)
    assert (healed["bad"], healed["quarantined"], healed["heal_rounds"]) == (0, 1, 1)
    quarantined = store.list("quarantine/")
    notes = [n for n in quarantined if n.endswith(".reason.txt")]
    assert len(notes) == 1 and notes[0].startswith(f"quarantine/{shard_filename(1)}.")
    assert "aux_hidden_states has non-finite values" in store.get_bytes(notes[0]).decode()
    assert quarantined[notes[0].removesuffix(".reason.txt")] == damaged.num_bytes  # the bad bytes kept aside
    again = read_manifest(store)
    assert [r.shard_index for r in again] == [r.shard_index for r in rows]
    assert again[1].checksum == rows[1].checksum != damaged.checksum  # extracted again, as it first was

    build_vocab(config)
    # the gate's smoke run reads S3 through a cache as well (its loss on this random target is no test) and ends
    # the cache's thread
    smoke = smoke_train(train_job(config, resolve_facts(config), output_dir=config.paths.smoke_dir), config.smoke)
    assert math.isfinite(smoke.first) and math.isfinite(smoke.last) and not config.paths.shards_dir.exists()
    assert (config.paths.smoke_dir / "shard-cache" / "rank-0").is_dir()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shard-cache")]
    final = train_flow(config, require_approval=False)
    assert final["step"] == 3
    assert not config.paths.shards_dir.exists()
    assert (config.paths.train_dir / "shard-cache" / "rank-0").is_dir()

    status = run_status(config)
    extract = status.stage("extract")
    assert extract.state == "done", extract
    assert f"in {url}, no local copy" in extract.detail and extract.evidence == f"{url}/manifest.parquet"
    assert {f["what"]: f["path"] for f in status.files}["manifest"] == f"{url}/manifest.parquet"
