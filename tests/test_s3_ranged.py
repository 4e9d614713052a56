"""Ranged, parallel fetches from S3 (S3Storage.download_to, eyas.storage.s3_fetch) against a real S3 API server
(moto's server mode) behind the fault proxy: byte-identical files, parts whose stream breaks, an object written
again mid-fetch, and the rank cache's fetch built on them."""

from __future__ import annotations

import os
import threading

import boto3
import pytest
from s3_server import Fault

from eyas.checksum import checksum_bytes
from eyas.shards.cache import ShardCache, ShardFetchError
from eyas.shards.manifest import ManifestRow
from eyas.storage.base import ChecksumMismatchError
from eyas.storage.s3 import MIN_PART_BYTES, S3Storage
from eyas.storage.s3_fetch import ObjectChangedError, PartFetchError

PART = 1 << 20
NUM_PARTS = 6


def _s3(bucket, endpoint, **kw) -> S3Storage:
    kw = {"retry_backoff_s": 0.01, "fetch_part_bytes": PART, "num_fetch_streams": 4, **kw}
    return S3Storage(f"s3://{bucket}/run/shards", endpoint_url=endpoint, **kw)


@pytest.fixture
def data() -> bytes:
    return os.urandom(NUM_PARTS * PART - 123)  # the last part is short


def _part_range(number: int) -> str:
    """The Range header of part `number` (1-based) of the fetch."""
    return f"bytes={(number - 1) * PART}-"


def test_a_fetch_in_parts_is_byte_identical_and_leaves_only_the_file(s3_bucket, fault_proxy, data, tmp_path):
    store = _s3(s3_bucket, fault_proxy.url)
    digest = store.put_bytes("a.bin", data)
    store.download_to("a.bin", tmp_path / "a.bin", checksum=digest)
    assert (tmp_path / "a.bin").read_bytes() == data
    assert fault_proxy.count("GET", "a.bin") == NUM_PARTS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin"]


def test_an_object_uploaded_in_parts_is_fetched_in_other_parts(s3_bucket, fault_proxy, tmp_path):
    store = _s3(s3_bucket, fault_proxy.url, multipart_threshold_bytes=MIN_PART_BYTES, part_bytes=MIN_PART_BYTES)
    data = os.urandom(MIN_PART_BYTES + PART // 2)
    digest = store.put_bytes("big.bin", data)  # a multipart ETag ("...-2"): If-Match must carry it as it is
    store.download_to("big.bin", tmp_path / "big.bin", checksum=digest)
    assert (tmp_path / "big.bin").read_bytes() == data
    assert fault_proxy.count("GET", "big.bin") == 6


def test_a_part_whose_stream_breaks_is_fetched_again(s3_bucket, fault_proxy, data, tmp_path):
    store = _s3(s3_bucket, fault_proxy.url)
    digest = store.put_bytes("a.bin", data)
    fault_proxy.faults.append(Fault("GET", "a.bin", "cut", range=_part_range(3)))
    store.download_to("a.bin", tmp_path / "a.bin", checksum=digest)
    assert (tmp_path / "a.bin").read_bytes() == data
    assert fault_proxy.count("GET", "a.bin") == NUM_PARTS + 1  # part 3 twice, nothing else again


def test_a_part_that_always_breaks_fails_the_fetch_naming_object_and_part_and_leaves_no_file(
    s3_bucket, fault_proxy, data, tmp_path
):
    store = _s3(s3_bucket, fault_proxy.url, num_read_attempts=3)
    digest = store.put_bytes("a.bin", data)
    fault_proxy.faults.append(Fault("GET", "a.bin", "cut", range=_part_range(3), times=3))
    with pytest.raises(PartFetchError) as failure:
        store.download_to("a.bin", tmp_path / "a.bin", checksum=digest)
    assert str(failure.value).startswith(
        f"s3://{s3_bucket}/run/shards/a.bin: part 3 of {NUM_PARTS} (bytes {2 * PART}-{3 * PART - 1}): its stream "
        "broke in each of 3 attempts (last: "
    )
    assert "fix the path to the server, or raise num_read_attempts" in str(failure.value)
    assert list(tmp_path.iterdir()) == []


def test_a_part_damaged_on_the_way_is_fetched_again_whole_then_refused(s3_bucket, fault_proxy, data, tmp_path):
    store = _s3(s3_bucket, fault_proxy.url, num_read_attempts=2)
    digest = store.put_bytes("a.bin", data)
    fault_proxy.faults.append(Fault("GET", "a.bin", "corrupt", range=_part_range(2)))
    store.download_to("a.bin", tmp_path / "a.bin", checksum=digest)
    assert (tmp_path / "a.bin").read_bytes() == data
    assert fault_proxy.count("GET", "a.bin") == 2 * NUM_PARTS
    (tmp_path / "a.bin").unlink()
    fault_proxy.faults.append(Fault("GET", "a.bin", "corrupt", range=_part_range(2), times=2))
    with pytest.raises(ChecksumMismatchError, match=r"a.bin: checksum .* \(6 ranged parts of ETag .*\), expected"):
        store.download_to("a.bin", tmp_path / "a.bin", checksum=digest)
    assert list(tmp_path.iterdir()) == []


def _write_again_after_first_part(store: S3Storage, name: str, data: bytes) -> None:
    """Write `name` again when the first part's GET has answered; every later GET starts after that write."""
    lock, done = threading.Lock(), []

    def after_get(**_):
        with lock:
            if not done:
                writer = boto3.client("s3", endpoint_url=store.client.meta.endpoint_url)
                writer.put_object(Bucket=store.bucket, Key=store._key(name), Body=data)
                done.append(True)

    store.client.meta.events.register("after-call.s3.GetObject", after_get)


def test_an_object_written_again_mid_fetch_is_refused_and_leaves_no_file(s3_bucket, s3_endpoint, data, tmp_path):
    store = _s3(s3_bucket, s3_endpoint, num_fetch_streams=2)
    digest = store.put_bytes("a.bin", data)
    _write_again_after_first_part(store, "a.bin", data[::-1])
    with pytest.raises(ObjectChangedError) as failure:
        store.download_to("a.bin", tmp_path / "a.bin", checksum=digest)
    message = str(failure.value)
    assert message.startswith(
        f"s3://{s3_bucket}/run/shards/a.bin: the object changed while it was fetched: the server "
    )
    assert (
        f"of {NUM_PARTS} (bytes " in message and "(412 PreconditionFailed); it was written again mid-fetch" in message
    )
    assert list(tmp_path.iterdir()) == []


def test_download_without_a_checksum_still_refuses_a_change_mid_fetch(s3_bucket, s3_endpoint, data, tmp_path):
    store = _s3(s3_bucket, s3_endpoint, num_fetch_streams=1)
    store.put_bytes("a.bin", data)
    _write_again_after_first_part(store, "a.bin", data[:-1] + b"x")  # same size, other bytes
    with pytest.raises(ObjectChangedError, match="part 2 of 6 .* because its ETag is no longer"):
        store.download_to("a.bin", tmp_path / "a.bin")
    assert list(tmp_path.iterdir()) == []


def test_fetch_options_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"s3://b/p: fetch_part_bytes=0, num_fetch_streams=16; expected both >= 1"):
        S3Storage("s3://b/p", fetch_part_bytes=0)


def test_the_rank_cache_fetches_in_parts_and_a_broken_part_fails_it_by_name_leaving_no_file(
    s3_bucket, fault_proxy, data, tmp_path
):
    store = _s3(s3_bucket, fault_proxy.url, num_read_attempts=2)
    blobs = [data, data[::-1]]
    rows = [
        ManifestRow(
            i, f"shard-{i:05d}.safetensors", i, i + 1, 1, len(b), store.put_bytes(f"shard-{i:05d}.safetensors", b)
        )
        for i, b in enumerate(blobs)
    ]
    fault_proxy.faults.append(Fault("GET", "shard-00001", "cut", range=_part_range(4), times=2))
    cache = ShardCache(store, rows, tmp_path / "cache", 2 * len(data), log=print)
    cache.plan([0, 1])
    with cache.opened(0) as path:
        assert path.read_bytes() == data and checksum_bytes(path.read_bytes()) == rows[0].checksum
    with pytest.raises(ShardFetchError) as failure:
        with cache.opened(1):
            pass
    assert str(failure.value).startswith(
        f"shard shard-00001.safetensors: fetching it from s3://{s3_bucket}/run/shards into the cache "
        f"{tmp_path / 'cache'} failed: s3://{s3_bucket}/run/shards/shard-00001.safetensors: part 4 of {NUM_PARTS} "
    )
    cache.close()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["shard-00000.safetensors"]
    assert cache.stats.fetched == 1
