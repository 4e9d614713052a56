"""Cache keys of the tasks before the gate (tasks/caching.py): same config sections, inputs and workdir come
back Cached from another flow run; any change of those runs the task again."""

from __future__ import annotations

import shutil

import pytest
from run_queries import task_runs

from eyas.config import load_run_config

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")


@pytest.fixture
def config(tmp_path, tiny_target_dir):
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    prompts = tmp_path / "prompts.jsonl"
    shutil.copy(tiny_target_dir / "prompts.jsonl", prompts)
    return base.model_copy(
        update={
            "workdir": str(tmp_path / "run"),
            "target": base.target.model_copy(update={"model_path": str(tiny_target_dir)}),
            "dataset": base.dataset.model_copy(update={"prompts_path": str(prompts)}),
        }
    )


class FakeReport:
    def to_dict(self) -> dict:
        return {"num_samples": 3}


@pytest.fixture
def builds(monkeypatch):
    """Calls of the dataset build behind regenerate-and-tokenize (the real one takes a minute)."""
    import tasks.dataset

    calls = []
    monkeypatch.setattr(tasks.dataset, "build_dataset", lambda *a, **k: calls.append(a) or FakeReport())
    return calls


def run_dataset_task(config) -> str:
    """regenerate-and-tokenize in a new flow run; returns its final state name."""
    from prefect import flow

    from tasks.dataset import regenerate_and_tokenize

    @flow(name="cache-probe")
    def probe(config):
        return regenerate_and_tokenize(config)

    state = probe(config, return_state=True)
    assert state.is_completed(), state.message
    [run] = task_runs(state.state_details.flow_run_id, "regenerate-and-tokenize")
    return run.state.name


def test_same_config_and_inputs_come_back_cached_in_another_run(prefect_server, config, builds):
    assert run_dataset_task(config) == "Completed"
    assert run_dataset_task(config) == "Cached"
    unrelated = config.model_copy(update={"bench": config.bench.model_copy(update={"num_prompts": 3})})
    assert run_dataset_task(unrelated) == "Cached"  # the bench section is not part of this task's key
    assert len(builds) == 1


def test_changed_config_section_runs_again(prefect_server, config, builds):
    run_dataset_task(config)
    changed = config.model_copy(update={"dataset": config.dataset.model_copy(update={"max_new_tokens": 8})})
    assert run_dataset_task(changed) == "Completed"
    assert len(builds) == 2


def test_changed_input_file_runs_again(prefect_server, config, builds):
    run_dataset_task(config)
    prompts = config.dataset.prompts_path
    with open(prompts, "a") as f:
        f.write('{"id": "extra", "conversations": [{"role": "user", "content": "one more"}]}\n')
    assert run_dataset_task(config) == "Completed"
    assert len(builds) == 2


def test_deleted_workdir_runs_again(prefect_server, config, builds):
    run_dataset_task(config)
    shutil.rmtree(config.paths.root)
    assert run_dataset_task(config) == "Completed"  # the recreated workdir has a new id
    assert len(builds) == 2


def test_full_mode_evidence_sees_bytes_changed_without_the_file_system_knowing(tmp_path, monkeypatch):
    """Bit rot, or a device written under the file system, changes bytes past the header without moving size,
    mtime or ctime: simulated by handing back the stat from before. Cheap evidence cannot see it (and does not
    claim to); full-mode evidence, which holds every file's checksum, does."""
    import os
    from pathlib import Path

    from tasks.caching import shard_files

    shard = tmp_path / "shard-00000.safetensors"
    shard.write_bytes(os.urandom(3 << 20))
    before = shard.stat()
    cheap, full = shard_files(tmp_path), shard_files(tmp_path, full=True)
    data = bytearray(shard.read_bytes())
    data[2 << 20] ^= 0x01  # one bit, two MiB in
    shard.write_bytes(bytes(data))
    real_stat = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, **kw: before if self == shard else real_stat(self, **kw))
    assert shard_files(tmp_path) == cheap
    assert shard_files(tmp_path, full=True) != full


def test_shard_evidence_on_s3_changes_with_any_write_and_leaves_bookkeeping_out(s3_bucket, s3_endpoint):
    """With no local copy (train.cache_bytes > 0) the verification task's cache is keyed by the objects on S3:
    a shard rewritten with the same size changes the evidence, the coordinator's extract.json does not, and a
    manifest row added changes the manifest's."""
    from eyas.storage.s3 import S3Storage
    from tasks.caching import manifest_content, shard_files

    store = S3Storage(f"s3://{s3_bucket}/shards", endpoint_url=s3_endpoint)
    assert shard_files(store) == manifest_content(store) == "absent"
    store.put_bytes("shard-00000.safetensors", b"a" * 4096)
    store.put_bytes("manifest.parquet", b"m")
    first, manifest = shard_files(store), manifest_content(store)
    store.put_bytes("extract.json", b"{}")
    assert shard_files(store) == first
    store.put_bytes("shard-00000.safetensors", b"b" * 4096)
    assert shard_files(store) != first
    store.put_bytes("rows/shard-00001.json", b"{}")
    assert manifest_content(store) != manifest
