"""eyas.train.checkpoint_copy: copies of complete checkpoints on a real S3 API server (moto) and in a directory,
their rotation, and restore into an empty output dir, falling back past a damaged copy or a damaged local checkpoint;
plus the trainer's use of them."""

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
from eyas.train.checkpoint_copy import copy_checkpoint, copy_steps, restore_latest, rotate_copies, sync_at_start
from eyas.train.checkpoint_verify import CheckpointDamagedError

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


def corrupt_remote(s3_bucket: str, s3_endpoint: str, name: str) -> None:
    key = f"run/checkpoints/{name}"  # replaced behind eyas' back, bit rot, ...
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=b"not the weights")


def test_restore_falls_back_past_a_corrupted_remote_file_naming_both(s3_bucket, s3_endpoint, tmp_path):
    store = s3_store(s3_bucket, s3_endpoint)
    for path in saved_steps(tmp_path / "out", [2, 4]).values():
        copy_checkpoint(store, path)
    corrupt_remote(s3_bucket, s3_endpoint, "step-00000004/model.safetensors")
    said = []
    restored = restore_latest(store, tmp_path / "fresh", log=said.append)
    assert restored == tmp_path / "fresh" / "checkpoints" / "step-00000002" == latest_complete(tmp_path / "fresh")
    assert said == [
        f"checkpoint copy s3://{s3_bucket}/run/checkpoints/step-00000004/model.safetensors: its bytes do not match "
        f"the checksum {json.loads(store.get_bytes('step-00000004.complete.json'))['files']['model.safetensors']['checksum']} "
        f"recorded when it was copied; the copy is corrupt and was not restored ({tmp_path / 'fresh'} is unchanged); "
        f"restoring step-00000002 from s3://{s3_bucket}/run/checkpoints instead, the newest older copy that verifies"
    ]
    assert [p.name for p in (tmp_path / "fresh" / "checkpoints").iterdir()] == ["step-00000002"]


def test_restore_refuses_when_every_copy_is_corrupt(s3_bucket, s3_endpoint, tmp_path):
    store = s3_store(s3_bucket, s3_endpoint)
    copy_checkpoint(store, save(tmp_path / "out", 4))
    corrupt_remote(s3_bucket, s3_endpoint, "step-00000004/model.safetensors")
    said = []
    with pytest.raises(
        CheckpointError, match=re.escape(f"checkpoint copy s3://{s3_bucket}/run/checkpoints: every copy")
    ):
        restore_latest(store, tmp_path / "fresh", log=said.append)
    assert len(said) == 1 and said[0].endswith(
        "was not restored (" + str(tmp_path / "fresh") + " is unchanged); no older copy verifies"
    )
    assert list_checkpoints(tmp_path / "fresh") == []
    assert list((tmp_path / "fresh" / "checkpoints").iterdir()) == []


def test_restore_falls_back_past_a_copy_missing_a_file(store, tmp_path):
    for path in saved_steps(tmp_path / "out", [2, 4]).values():
        copy_checkpoint(store, path)
    store.delete("step-00000004/optimizer.pt")
    said = []
    assert restore_latest(store, tmp_path / "fresh", log=said.append).name == "step-00000002"
    assert said == [
        f"checkpoint copy {store.url}/step-00000004: files ['optimizer.pt'] of its manifest are missing; the copy was "
        f"damaged after it was completed; restoring step-00000002 from {store.url} instead, the newest older copy "
        "that verifies"
    ]


def test_a_copy_that_disagrees_with_its_completion_record_is_not_restored(store, tmp_path):
    """Bytes and manifest replaced together (a copy tool, an edit): the COMPLETE record the copy carries catches it."""
    for path in saved_steps(tmp_path / "out", [2, 4]).values():
        copy_checkpoint(store, path)
    manifest = json.loads(store.get_bytes("step-00000004.complete.json"))
    data = b"other weights"
    manifest["files"]["model.safetensors"] = {"checksum": store.put_bytes("step-00000004/model.safetensors", data),
                                              "bytes": len(data)}  # fmt: skip
    store.put_bytes("step-00000004.complete.json", json.dumps(manifest).encode())
    said = []
    assert restore_latest(store, tmp_path / "fresh", log=said.append).name == "step-00000002"
    assert said[0].startswith(
        f"checkpoint copy {store.url}/step-00000004: model.safetensors has {len(data)} bytes, its COMPLETE record says"
    )
    assert (
        "the checkpoint was damaged before it was copied, and the copy was not restored; restoring step-00000002"
        in said[0]
    )


def test_a_damaged_local_checkpoint_is_set_aside_and_the_copy_restored(store, tmp_path):
    local = saved_steps(tmp_path / "out", [2, 4])
    for path in local.values():
        copy_checkpoint(store, path)
    model = local[4] / "model.safetensors"
    original = model.read_bytes()
    model.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    said = []
    assert sync_at_start(store, tmp_path / "out", keep_last=2, log=said.append) == (
        f"restored step-00000004 from the checkpoint copy {store.url}"
    )
    assert said[0].startswith("checkpoint step-00000004 is damaged: model.safetensors has checksum")
    assert said[0].endswith(
        "set aside as checkpoints/step-00000004.damaged (DAMAGED.json says why); resuming from step-00000002 "
        "instead, the newest older complete checkpoint that verifies"
    )
    assert (local[4] / "model.safetensors").read_bytes() == original  # the copy's intact bytes
    assert (tmp_path / "out" / "checkpoints" / "step-00000004.damaged" / "DAMAGED.json").is_file()


def test_a_damaged_checkpoint_is_never_copied(store, tmp_path):
    path = save(tmp_path / "out", 4)
    data = bytearray((path / "optimizer.pt").read_bytes())
    data[-30] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"checkpoint {path}: optimizer.pt has checksum")):
        copy_checkpoint(store, path)
    assert copy_steps(store) == []
