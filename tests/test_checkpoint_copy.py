"""eyas.train.checkpoint_copy: copies of complete checkpoints on a real S3 API server (moto) and in a directory,
their rotation, and restore into an empty output dir; plus the trainer's use of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import boto3
import pytest
from draft_fixtures import save

from eyas.checksum import checksum_bytes
from eyas.storage.local import LocalStorage
from eyas.storage.s3 import S3Storage
from eyas.train.checkpoint import CheckpointError, latest_complete, list_checkpoints
from eyas.train.checkpoint_copy import copy_checkpoint, copy_steps, restore_latest, rotate_copies

FILES = ["COMPLETE", "arch.json", "model.safetensors", "optimizer.pt", "rng.pt", "scheduler.pt", "trainer_state.json"]


def s3_store(bucket: str, endpoint: str) -> S3Storage:
    return S3Storage(f"s3://{bucket}/run/checkpoints", endpoint_url=endpoint, retry_backoff_s=0.01)


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "copy")
    return s3_store(request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint"))


def saved_steps(output_dir: Path, steps) -> dict[int, Path]:
    return {step: save(output_dir, step) for step in steps}


def test_copy_puts_every_file_then_the_manifest_last(s3_bucket, fault_proxy, tmp_path):
    store = s3_store(s3_bucket, fault_proxy.url)
    local = save(tmp_path / "out", 4)
    manifest = copy_checkpoint(store, local)
    writes = [(method, path.split("/run/checkpoints/")[1].split("?")[0]) for method, path in fault_proxy.log]
    assert writes[0] == ("PUT", "step-00000004.pending")
    assert sorted(name for method, name in writes[1:-2]) == [f"step-00000004/{f}" for f in FILES]
    assert writes[-2:] == [("PUT", "step-00000004.complete.json"), ("DELETE", "step-00000004.pending")]
    assert manifest == {
        "step": 4,
        "files": {
            f: {"checksum": checksum_bytes((local / f).read_bytes()), "bytes": (local / f).stat().st_size}
            for f in FILES
        },
    }
    assert json.loads(store.get_bytes("step-00000004.complete.json")) == manifest
    assert list(store.list()) == ["step-00000004.complete.json"]


def test_rotation_keeps_the_newest_copies_and_clears_interrupted_ones(store, tmp_path):
    for step, path in saved_steps(tmp_path / "out", [1, 2, 3]).items():
        copy_checkpoint(store, path)
    store.put_bytes("step-00000004.pending", b"")  # a copy cut off after its first file
    store.put_bytes("step-00000004/model.safetensors", b"half")
    assert rotate_copies(store, keep_last=2) == [1]
    assert copy_steps(store) == [2, 3]
    assert sorted(store.list()) == ["step-00000002.complete.json", "step-00000003.complete.json"]
    assert store.list("step-00000001/") == {} and store.list("step-00000004/") == {}
    assert len(store.list("step-00000003/")) == len(FILES)


def test_restore_into_an_empty_dir_gives_byte_equal_files(store, tmp_path):
    local = saved_steps(tmp_path / "out", [2, 4])
    for path in local.values():
        copy_checkpoint(store, path)
    fresh = tmp_path / "fresh"
    restored = restore_latest(store, fresh)
    assert restored == fresh / "checkpoints" / "step-00000004" == latest_complete(fresh)
    assert sorted(p.name for p in restored.iterdir()) == FILES
    assert all((restored / f).read_bytes() == (local[4] / f).read_bytes() for f in FILES)
    assert [p.name for p in (fresh / "checkpoints").iterdir()] == ["step-00000004"]  # no temporaries left


def test_a_copy_without_its_manifest_is_never_restored(store, tmp_path):
    local = saved_steps(tmp_path / "out", [2, 4])
    copy_checkpoint(store, local[2])
    copy_checkpoint(store, local[4])
    store.delete("step-00000004.complete.json")  # as if the copy of step 4 was cut off before its manifest
    assert restore_latest(store, tmp_path / "fresh").name == "step-00000002"


def test_restore_leaves_a_local_dir_alone_when_it_is_as_new(store, tmp_path):
    local = saved_steps(tmp_path / "out", [2])
    copy_checkpoint(store, local[2])
    assert restore_latest(store, tmp_path / "out") is None


def test_restore_refuses_a_corrupted_remote_file(s3_bucket, s3_endpoint, tmp_path):
    store = s3_store(s3_bucket, s3_endpoint)
    copy_checkpoint(store, save(tmp_path / "out", 4))
    key = "run/checkpoints/step-00000004/model.safetensors"  # replaced behind eyas' back, bit rot, ...
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=b"not the weights")
    message = (
        f"checkpoint copy s3://{s3_bucket}/run/checkpoints/step-00000004/model.safetensors: its bytes do not match "
        f"the checksum"
    )
    with pytest.raises(CheckpointError, match=re.escape(message) + ".*the copy is corrupt and was not restored"):
        restore_latest(store, tmp_path / "fresh")
    assert list_checkpoints(tmp_path / "fresh") == []
    assert list((tmp_path / "fresh" / "checkpoints").iterdir()) == []


def test_restore_refuses_a_copy_missing_a_file(store, tmp_path):
    copy_checkpoint(store, save(tmp_path / "out", 4))
    store.delete("step-00000004/optimizer.pt")
    with pytest.raises(CheckpointError, match=re.escape("step-00000004: files ['optimizer.pt'] of its manifest")):
        restore_latest(store, tmp_path / "fresh")
