"""Storage: a local directory and a real S3 API server (moto) behind one interface, with injected faults."""

from __future__ import annotations

import os

import boto3
import pytest
from botocore.exceptions import ClientError
from s3_server import Fault

from eyas.checksum import checksum_bytes
from eyas.storage import open_storage
from eyas.storage.base import ChecksumMismatchError
from eyas.storage.local import LocalStorage
from eyas.storage.s3 import MIN_PART_BYTES, S3Storage


def _s3(bucket, endpoint, **kw):
    kw.setdefault("retry_backoff_s", 0.01)
    return S3Storage(f"s3://{bucket}/run/shards", endpoint_url=endpoint, **kw)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return LocalStorage(tmp_path / "shards")
    bucket = request.getfixturevalue("s3_bucket")
    return _s3(bucket, request.getfixturevalue("s3_endpoint"))


def test_put_get_list_delete_round_trip(store):
    digest = store.put_bytes("shard-00000.safetensors", b"abc" * 1000)
    store.put_bytes("rows/shard-00000.json", b"{}")
    assert digest == checksum_bytes(b"abc" * 1000)
    assert store.get_bytes("shard-00000.safetensors", checksum=digest) == b"abc" * 1000
    assert store.list() == {"shard-00000.safetensors": 3000}
    assert store.list("rows/") == {"rows/shard-00000.json": 2}
    store.delete("rows/shard-00000.json")
    assert not store.exists("rows/shard-00000.json") and store.exists("shard-00000.safetensors")


def test_move_keeps_the_bytes_and_their_checksum_under_the_new_name(store):
    digest = store.put_bytes("shard-00001.safetensors", b"xyz" * 500)
    store.move("shard-00001.safetensors", "quarantine/shard-00001.safetensors.T")
    assert store.list() == {} and store.list("quarantine/") == {"quarantine/shard-00001.safetensors.T": 1500}
    # read back without a checksum: on S3 the one recorded at write came along with the copy
    assert store.get_bytes("quarantine/shard-00001.safetensors.T") == b"xyz" * 500
    assert store.get_bytes("quarantine/shard-00001.safetensors.T", checksum=digest) == b"xyz" * 500
    with pytest.raises(FileNotFoundError if isinstance(store, LocalStorage) else ClientError):
        store.move("shard-00001.safetensors", "quarantine/again")


def test_a_version_changes_when_an_object_is_written_again(store):
    store.put_bytes("shard-00000.safetensors", b"a" * 100)
    store.put_bytes("rows/shard-00000.json", b"{}")
    first = store.versions()
    assert sorted(first) == ["shard-00000.safetensors"] and sorted(store.versions("rows/")) == ["rows/shard-00000.json"]
    assert store.versions() == first  # listing again changes nothing
    store.put_bytes("shard-00000.safetensors", b"b" * 100)  # same size, other bytes
    assert store.versions() != first


def test_read_with_wrong_checksum_is_refused(store):
    store.put_bytes("a.bin", b"payload")
    with pytest.raises(
        ChecksumMismatchError, match=r"a.bin: checksum xxh3-128:.* of 7 bytes read, expected xxh3-128:0000"
    ):
        store.get_bytes("a.bin", checksum="xxh3-128:" + "0" * 32)


def test_download_to_writes_the_whole_object_checked_or_nothing(store, tmp_path):
    digest = store.put_bytes("a.bin", b"payload")
    out = tmp_path / "downloads"
    out.mkdir()
    store.download_to("a.bin", out / "a.bin", checksum=digest)
    store.download_to("a.bin", out / "unchecked.bin")
    with pytest.raises(
        ChecksumMismatchError, match=r"a.bin: checksum xxh3-128:.* of 7 bytes read.*, expected xxh3-128:0000"
    ):
        store.download_to("a.bin", out / "b.bin", checksum="xxh3-128:" + "0" * 32)
    assert sorted(p.name for p in out.iterdir()) == ["a.bin", "unchecked.bin"]  # no temporary, no b.bin
    assert (out / "a.bin").read_bytes() == (out / "unchecked.bin").read_bytes() == b"payload"


def test_open_storage_dispatches_on_the_url(tmp_path):
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage("s3://bucket/prefix"), S3Storage)
    with pytest.raises(ValueError, match=r"'gs://b/p': expected a local directory or s3://bucket/prefix"):
        open_storage("gs://b/p")


def test_local_remove_partial_deletes_only_temporaries(tmp_path):
    store = LocalStorage(tmp_path)
    store.put_bytes("rows/x.json", b"1")
    (tmp_path / ".shard-00003.safetensors.tmp-123").write_bytes(b"half")
    (tmp_path / "rows" / ".x.json.tmp-9").write_bytes(b"half")
    assert sorted(store.remove_partial()) == [".shard-00003.safetensors.tmp-123", "rows/.x.json.tmp-9"]
    assert store.list() == {} and store.list("rows/") == {"rows/x.json": 1}


def test_large_object_goes_up_in_parts_with_checksums(s3_bucket, s3_endpoint, fault_proxy):
    store = _s3(s3_bucket, fault_proxy.url, multipart_threshold_bytes=MIN_PART_BYTES, part_bytes=MIN_PART_BYTES)
    data = os.urandom(2 * MIN_PART_BYTES + 1234)
    digest = store.put_bytes("big.safetensors", data)
    assert fault_proxy.count("PUT", "partNumber=") == 3
    assert store.get_bytes("big.safetensors") == data
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(Bucket=s3_bucket, Key="run/shards/big.safetensors")
    assert head["Metadata"]["eyas-checksum"] == digest


def test_failed_multipart_upload_leaves_no_object_and_no_parts(s3_bucket, s3_endpoint, fault_proxy):
    store = _s3(
        s3_bucket, fault_proxy.url, multipart_threshold_bytes=MIN_PART_BYTES, part_bytes=MIN_PART_BYTES, max_attempts=2
    )
    fault_proxy.faults.append(Fault("PUT", "partNumber=2", "500", times=10))
    with pytest.raises(ClientError, match="InternalError"):
        store.put_bytes("big.safetensors", os.urandom(2 * MIN_PART_BYTES))
    assert store.list() == {}
    assert (
        boto3.client("s3", endpoint_url=s3_endpoint).list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    )


def test_interrupted_multipart_upload_is_removed_on_resume(s3_bucket, s3_endpoint):
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_multipart_upload(Bucket=s3_bucket, Key="run/shards/shard-00001.safetensors")
    store = _s3(s3_bucket, s3_endpoint)
    assert store.list() == {}  # never visible
    assert store.remove_partial() == ["shard-00001.safetensors"]
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []


@pytest.mark.parametrize("action", ["503", "500", "drop"])
def test_transient_write_failures_are_retried(s3_bucket, fault_proxy, action):
    store = _s3(s3_bucket, fault_proxy.url)
    fault_proxy.faults.append(Fault("PUT", "shard-00000", action, times=2))
    store.put_bytes("shard-00000.safetensors", b"x" * 100)
    assert fault_proxy.count("PUT", "shard-00000") == 3  # two faults, then success
    assert store.get_bytes("shard-00000.safetensors") == b"x" * 100


def test_read_timeout_is_retried(s3_bucket, fault_proxy):
    store = _s3(s3_bucket, fault_proxy.url, read_timeout_s=1.0)
    store.put_bytes("a.bin", b"late")
    fault_proxy.faults.append(Fault("GET", "a.bin", "delay", delay_s=2.5))
    assert store.get_bytes("a.bin") == b"late"
    assert fault_proxy.count("GET", "a.bin") == 2


def test_corrupted_read_is_retried_then_refused(s3_bucket, fault_proxy):
    store = _s3(s3_bucket, fault_proxy.url, num_read_attempts=3)
    store.put_bytes("a.bin", b"0123456789")
    fault_proxy.faults.append(Fault("GET", "a.bin", "corrupt", times=1))
    assert store.get_bytes("a.bin") == b"0123456789"  # one bad body, read again
    fault_proxy.faults.append(Fault("GET", "a.bin", "corrupt", times=3))
    with pytest.raises(ChecksumMismatchError, match="a.bin: checksum"):
        store.get_bytes("a.bin")
    assert fault_proxy.count("GET", "a.bin") == 2 + 3


def test_body_corrupted_on_the_way_up_is_sent_again(s3_bucket, fault_proxy):
    store = _s3(s3_bucket, fault_proxy.url)
    fault_proxy.faults.append(Fault("PUT", "a.bin", "corrupt_request", times=1))
    store.put_bytes("a.bin", b"0123456789")
    assert fault_proxy.count("PUT", "a.bin") == 2
    assert store.get_bytes("a.bin") == b"0123456789"


def test_part_corrupted_on_the_way_up_is_sent_again(s3_bucket, fault_proxy):
    store = _s3(s3_bucket, fault_proxy.url, multipart_threshold_bytes=MIN_PART_BYTES, part_bytes=MIN_PART_BYTES)
    data = os.urandom(MIN_PART_BYTES + 10)
    fault_proxy.faults.append(Fault("PUT", "partNumber=2", "corrupt_request", times=1))
    store.put_bytes("big.bin", data)
    assert store.get_bytes("big.bin") == data


def test_write_that_stays_corrupt_is_refused_and_removed(s3_bucket, fault_proxy):
    store = _s3(s3_bucket, fault_proxy.url, num_write_attempts=2)
    fault_proxy.faults.append(Fault("PUT", "a.bin", "corrupt_request", times=2))
    with pytest.raises(ChecksumMismatchError, match=r"a.bin: the server stored .* \(ETag .*\), expected ETag"):
        store.put_bytes("a.bin", b"0123456789")
    assert store.list() == {}


def test_a_local_listing_leaves_out_a_file_deleted_while_it_reads(tmp_path, monkeypatch):
    """A producer releasing shards (extract.retention) deletes files while a status reader or a progress callback
    lists the directory: the file read by scandir and gone by its stat is not listed, and the listing does not fail."""
    import contextlib

    store = LocalStorage(tmp_path)
    store.put_bytes("shard-00000.safetensors", b"1")
    store.put_bytes("shard-00001.safetensors", b"22")
    real = os.scandir

    def scandir_then_delete(path):
        entries = list(real(path))  # read, not yet stat'ed
        (tmp_path / "shard-00000.safetensors").unlink()
        return contextlib.nullcontext(entries)

    monkeypatch.setattr(os, "scandir", scandir_then_delete)
    assert store.list() == {"shard-00001.safetensors": 2}
