"""Fan-out: concurrent workers write disjoint shards, none twice, none missed; S3 as the shard store;
the same shard bytes whatever the number of workers or the storage."""

from __future__ import annotations

import random
import threading
import time

import pytest
from run_fixtures import extract, write_tokenized

from eyas.config import ExtractConfig
from eyas.shards.manifest import read_manifest
from eyas.shards.sync import sync_to_local
from eyas.storage.local import LocalStorage
from eyas.storage.s3 import S3Storage

CFG = ExtractConfig(shard_bytes=1 << 16, batch_size=3)


class RecordingStorage(LocalStorage):
    """A real local directory that also records who wrote which object, and when."""

    def __init__(self, root):
        super().__init__(root)
        self.puts: list[tuple[str, str, float]] = []
        self.lock = threading.Lock()

    def put_bytes(self, name, data):
        digest = super().put_bytes(name, data)
        with self.lock:
            self.puts.append((name, threading.current_thread().name, time.monotonic()))
        return digest


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    rng = random.Random(3)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 24))] for _ in range(30)]
    return write_tokenized(tmp_path_factory.mktemp("dataset") / "tokenized.parquet", samples)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, tokenized, random_target_dir):
    shards = tmp_path_factory.mktemp("one-worker") / "shards"
    _extract(tokenized, shards, random_target_dir, num_workers=1)
    return shards


def _extract(tokenized, shards, target, **update):
    return extract(
        tokenized,
        shards,
        target,
        CFG.model_copy(update=update),
    )


def shard_bytes(where) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(where.glob("shard-*.safetensors"))}


def test_two_workers_write_disjoint_shards_at_once(tmp_path, tokenized, random_target_dir, one_worker):
    store = RecordingStorage(tmp_path / "shards")
    summary = _extract(tokenized, store, random_target_dir, num_workers=2)
    shard_puts = [(n, who, t) for n, who, t in store.puts if n.startswith("shard-")]
    names = [n for n, _, _ in shard_puts]
    planned = [r.file for r in read_manifest(one_worker)]
    assert sorted(names) == planned  # every planned shard written, and each exactly once
    assert summary.num_workers == 2 and summary.shards_written == len(planned) > 4
    by_worker: dict[str, list[float]] = {}
    for _, who, t in shard_puts:
        by_worker.setdefault(who, []).append(t)
    assert len(by_worker) == 2
    (a_first, a_last), (b_first, b_last) = ((min(ts), max(ts)) for ts in by_worker.values())
    assert a_first < b_last and b_first < a_last  # the two workers' writing overlapped in time
    assert read_manifest(store) == read_manifest(one_worker)
    assert shard_bytes(tmp_path / "shards") == shard_bytes(one_worker)  # byte-identical to one worker's


def test_three_workers_on_s3_give_the_same_bytes(
    s3_bucket, s3_endpoint, tmp_path, tokenized, random_target_dir, one_worker
):
    store = S3Storage(f"s3://{s3_bucket}/run-1/shards", endpoint_url=s3_endpoint)
    _extract(tokenized, store, random_target_dir, num_workers=3)
    assert read_manifest(store) == read_manifest(one_worker)
    assert store.list("rows/") == {}  # compacted at the end
    assert sync_to_local(store, tmp_path / "copy") == {"fetched": len(read_manifest(one_worker)), "kept": 0}
    assert shard_bytes(tmp_path / "copy") == shard_bytes(one_worker)
    assert read_manifest(tmp_path / "copy") == read_manifest(one_worker)
    assert sync_to_local(store, tmp_path / "copy")["fetched"] == 0  # an up-to-date copy downloads nothing


def test_rerun_on_s3_skips_everything(s3_bucket, s3_endpoint, tokenized, random_target_dir):
    store = S3Storage(f"s3://{s3_bucket}/shards", endpoint_url=s3_endpoint)
    first = _extract(tokenized, store, random_target_dir, num_workers=2)
    again = _extract(tokenized, store, random_target_dir, num_workers=2)
    assert (again.shards_written, again.shards_skipped) == (0, first.shards_total)


def test_a_missing_shard_on_s3_is_quarantined_and_extracted_again(s3_bucket, s3_endpoint, tokenized, random_target_dir):
    """A shard gone from under its row on S3 is set aside as on a local directory: its reason goes to quarantine/,
    its row is dropped and the resume writes it again, byte for byte."""
    store = S3Storage(f"s3://{s3_bucket}/shards", endpoint_url=s3_endpoint)
    _extract(tokenized, store, random_target_dir)
    rows, before = read_manifest(store), store.get_bytes("shard-00001.safetensors")
    store.delete("shard-00001.safetensors")
    again = _extract(tokenized, store, random_target_dir)
    assert again.shards_written == 1
    assert read_manifest(store) == rows and store.get_bytes("shard-00001.safetensors") == before
    notes = [n for n in store.list("quarantine/") if n.endswith(".reason.txt")]
    assert len(notes) == 1 and notes[0].startswith("quarantine/shard-00001.safetensors.")
    reason = store.get_bytes(notes[0]).decode()
    assert "listed in the manifest" in reason and "(the file was already missing)" in reason


def test_workers_loading_the_target_at_once_keep_its_tied_lm_head(tiny_target_dir):
    """Workers are threads and each loads the target; overlapping from_pretrained calls (unguarded)
    leave a tied lm_head on the meta device in most loads."""
    from eyas.target import load_target

    devices = []

    def load():
        for _ in range(4):
            devices.append(load_target(tiny_target_dir).model.lm_head.weight.device.type)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert devices == ["cpu"] * 8
