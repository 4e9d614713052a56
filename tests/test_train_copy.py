"""eyas.train with train.checkpoint_copy_url: checkpoints copied to a real S3 API server (moto) as they
complete, a fresh machine resuming from the copy, and what happens when a copy fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from run_fixtures import run_trainer, tiny_job, write_tiny_run
from s3_server import Fault
from safetensors.torch import load_file

from eyas.config import TrainConfig
from eyas.storage.base import ChecksumMismatchError
from eyas.storage.s3 import S3Storage
from eyas.train.__main__ import main
from eyas.train.checkpoint import latest_complete
from eyas.train.checkpoint_copy import copy_steps


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("copy-run"), num_samples=32)


def write_job(run: dict, out: Path, url: str, endpoint: str, *, max_steps: int = 4) -> Path:
    job = tiny_job(
        run,
        out,
        max_steps=max_steps,
        save_every_steps=2,
        num_checkpoints_kept=2,
        checkpoint_copy_url=url,
        s3_endpoint_url=endpoint,
    )
    path = out.parent / f"{out.name}.json"
    path.write_text(job.model_dump_json())
    return path


def test_a_fresh_machine_resumes_from_the_copy_bit_identically(tiny_run, s3_bucket, s3_endpoint, tmp_path):
    url = f"s3://{s3_bucket}/run"
    run_trainer(write_job(tiny_run, tmp_path / "first", url, s3_endpoint), nproc=2)
    store = S3Storage(url, endpoint_url=s3_endpoint)
    assert copy_steps(store) == [2, 4]
    # the first machine died while copying step 4: its manifest never got written
    store.put_bytes("step-00000004.pending", b"")
    store.delete("step-00000004.complete.json")

    stdout, metrics = run_trainer(write_job(tiny_run, tmp_path / "fresh", url, s3_endpoint), nproc=2)
    assert f"restored step-00000002 from the checkpoint copy {url}" in stdout
    assert re.search(r"resumed from \S+/fresh/checkpoints/step-00000002 at step 2 ", stdout), stdout
    assert [m["step"] for m in metrics] == [3, 4]
    first, fresh = (load_file(latest_complete(tmp_path / d) / "model.safetensors") for d in ("first", "fresh"))
    assert sorted(k for k in first if not first[k].equal(fresh[k])) == []
    assert copy_steps(store) == [2, 4] and sorted(store.list()) == [
        "step-00000002.complete.json",
        "step-00000004.complete.json",
    ]


def test_a_failed_copy_stops_the_run_and_the_rerun_copies_the_checkpoint(
    tiny_run, s3_bucket, s3_endpoint, fault_proxy, tmp_path
):
    url = f"s3://{s3_bucket}/run"
    fault_proxy.faults.append(Fault("PUT", "step-00000002/model.safetensors", "corrupt_request", times=3))
    job = write_job(tiny_run, tmp_path / "out", url, fault_proxy.url, max_steps=2)
    with pytest.raises(ChecksumMismatchError, match="step-00000002/model.safetensors: the server stored other bytes"):
        main(["--config", str(job)])
    assert latest_complete(tmp_path / "out").name == "step-00000002"  # the local checkpoint is complete
    store = S3Storage(url, endpoint_url=s3_endpoint)
    assert copy_steps(store) == []

    assert main(["--config", str(job)]) == 0  # the faults are spent: the re-run copies step 2, trains nothing
    assert copy_steps(store) == [2] and "step-00000002.pending" not in store.list()


def test_copy_url_must_be_s3_or_an_absolute_directory():
    with pytest.raises(ValidationError, match=re.escape("train.checkpoint_copy_url='gs://b/p': expected empty")):
        TrainConfig(checkpoint_copy_url="gs://b/p")
    with pytest.raises(ValidationError, match=re.escape("train.checkpoint_copy_url='copies': expected empty")):
        TrainConfig(checkpoint_copy_url="copies")
    assert TrainConfig(checkpoint_copy_url="/mnt/copies").checkpoint_copy_url == "/mnt/copies"


def test_an_s3_endpoint_without_an_s3_copy_url_is_refused():
    with pytest.raises(ValidationError, match=re.escape("train.s3_endpoint_url='http://minio:9000' would do nothing")):
        TrainConfig(s3_endpoint_url="http://minio:9000")
