"""Training from S3 through a bounded shard cache (train.cache_bytes, eyas.shards.cache): a real S3 API server
on loopback (moto) behind the fault proxy, real torchrun processes. A cache of 2 shards over 20 trains the
same weights as a full local copy, bit for bit, and never holds more than its budget plus one shard; a shard
whose every fetch is damaged is retried, then refused by name; a run killed with SIGKILL resumes with the
partial cache it left, and with none."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from run_fixtures import run_trainer, tiny_job, write_tiny_run
from s3_server import Fault
from safetensors.torch import load_file
from test_train_crash import kill_at_step, run_to_end, torchrun

from eyas.config import TrainJob
from eyas.shards.cache import ShardCache, ShardFetchError
from eyas.shards.manifest import read_manifest
from eyas.shards.reader import ShardSamples
from eyas.storage import LocalStorage
from eyas.storage.s3 import S3Storage
from eyas.train.checkpoint import latest_complete
from eyas.train.data import ShardWindows, global_order
from eyas.train.metrics import METRIC_PREFIX
from eyas.train.setup import CACHE_DIR

NUM_SHARDS, PER_SHARD = 20, 2
STEPS = 20  # 2 epochs of 40 samples, 4 a step


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    run = write_tiny_run(tmp_path_factory.mktemp("cache-run"), num_samples=NUM_SHARDS * PER_SHARD, per_shard=PER_SHARD)
    run["largest"] = max(r.num_bytes for r in read_manifest(run["shards"]))
    return run


def upload(shards: Path, store) -> None:
    """The shard set as extraction with extract.storage_url = s3://... leaves it."""
    for path in sorted(p for p in shards.rglob("*") if p.is_file()):
        store.put_bytes(str(path.relative_to(shards)), path.read_bytes())


@pytest.fixture
def s3_shards(tiny_run, s3_bucket, fault_proxy) -> S3Storage:
    store = S3Storage(f"s3://{s3_bucket}/run/shards", endpoint_url=fault_proxy.url, retry_backoff_s=0.01)
    upload(Path(tiny_run["shards"]), store)
    return store


def write_job(run: dict, out: Path, **train) -> Path:
    job = tiny_job(run, out, num_epochs=2, global_batch_size=4, save_every_steps=3, shuffle_window_shards=1, **train)
    path = out.parent / f"{out.name}.json"
    path.write_text(job.model_dump_json())
    return path


def cached_job(run: dict, out: Path, store: S3Storage, num_shards: int = 2) -> Path:
    path = write_job(run, out, cache_bytes=num_shards * run["largest"])
    job = TrainJob.model_validate_json(path.read_text())
    path.write_text(
        job.model_copy(
            update={"shards_dir": store.url, "shards_endpoint_url": store.client.meta.endpoint_url}
        ).model_dump_json()
    )
    return path


@pytest.fixture(scope="module")
def reference(tiny_run, tmp_path_factory) -> dict:
    """The same training from the full local copy (the shards' directory)."""
    out = tmp_path_factory.mktemp("reference") / "train"
    run_trainer(write_job(tiny_run, out), nproc=2)
    return load_file(latest_complete(out) / "model.safetensors")


class DiskSampler:
    """The bytes in each rank's cache directory, sampled every millisecond while a run goes on."""

    def __init__(self, out: Path):
        self.root, self.peak, self.peak_files, self.samples = out / CACHE_DIR, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for rank_dir in self.root.glob("rank-*"):
                sizes = []
                for p in list(rank_dir.iterdir()) if rank_dir.is_dir() else []:
                    try:
                        sizes.append(p.stat().st_size)
                    except FileNotFoundError:  # evicted while we looked
                        pass
                self.peak, self.peak_files = max(self.peak, sum(sizes)), max(self.peak_files, len(sizes))
            self.samples += 1
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def assert_equal_weights(reference: dict, out: Path) -> None:
    final = latest_complete(out)
    assert final is not None and final.name == f"step-{STEPS:08d}"
    trained = load_file(final / "model.safetensors")
    assert trained.keys() == reference.keys()
    different = sorted(k for k in reference if not torch.equal(reference[k], trained[k]))
    assert different == [], f"{different} differ from the run on a full local copy"


def test_a_two_shard_cache_over_twenty_trains_what_a_local_copy_trains_bit_for_bit(
    tiny_run, reference, s3_shards, fault_proxy, tmp_path
):
    out = tmp_path / "cached"
    with DiskSampler(out) as disk:
        stdout, metrics = run_trainer(cached_job(tiny_run, out, s3_shards), nproc=2)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert_equal_weights(reference, out)
    budget = 2 * tiny_run["largest"]
    assert disk.samples > 100 and 0 < disk.peak <= budget + tiny_run["largest"], (disk.peak, budget)
    assert disk.peak_files <= 3  # two shards, and one being written
    # with windows of one shard and 2 samples per rank a step, each rank reads 10 of the 20 shards an epoch:
    # 2 ranks x 2 epochs x 10 fetches from the server (through the proxy), evicted and fetched again
    gets = sum(fault_proxy.count("GET", f"shard-{i:05d}.safetensors") for i in range(NUM_SHARDS))
    assert gets >= 2 * 2 * NUM_SHARDS // 2
    assert "shards fetched" in stdout


def test_a_fetch_damaged_on_the_way_is_retried_and_one_always_damaged_is_refused_by_name(
    tiny_run, s3_shards, fault_proxy, tmp_path
):
    samples = ShardSamples(s3_shards, cache_dir=tmp_path / "cache", cache_bytes=2 * tiny_run["largest"], log=print)
    order = list(range(NUM_SHARDS * PER_SHARD))
    samples.plan(order)
    fault_proxy.faults.append(Fault("GET", "shard-00003.safetensors", "corrupt", times=1))
    fault_proxy.faults.append(Fault("GET", "shard-00007.safetensors", "corrupt", times=s3_shards.num_read_attempts))
    for i in order[: 7 * PER_SHARD]:
        assert samples.load_sample(i)["sample_index"] == i
    assert fault_proxy.count("GET", "shard-00003.safetensors") == 2  # one damaged body, fetched again
    with pytest.raises(ShardFetchError, match=r"shard shard-00007\.safetensors: fetching it from s3://.*checksum"):
        samples.load_sample(7 * PER_SHARD)
    assert fault_proxy.count("GET", "shard-00007.safetensors") == s3_shards.num_read_attempts
    assert not (tmp_path / "cache" / "shard-00007.safetensors").exists()
    samples.close()


def kill_at_step_seeing(job: Path, step: int) -> str:
    """kill_at_step, returning what the run printed until the kill."""
    proc, seen = torchrun(job), []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(METRIC_PREFIX) and json.loads(line[len(METRIC_PREFIX) :])["step"] == step:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    return "".join(seen)


def test_sigkill_resumes_with_the_partial_cache_it_left_and_with_none(tiny_run, reference, s3_shards, tmp_path):
    out = tmp_path / "crashed"
    job = cached_job(tiny_run, out, s3_shards)
    kill_at_step(job, 5)
    survivor = latest_complete(out)
    assert survivor is not None and list((out / CACHE_DIR).rglob("shard-*")), "the kill left no checkpoint or cache"
    seen = kill_at_step_seeing(job, 14)  # resumed with the partial cache, then killed again
    assert f"resumed from {survivor}" in seen
    assert re.search(r"rank \d: shard cache .*: kept [1-9]\d* whole shards from before", seen), seen
    assert latest_complete(out).name > survivor.name
    for rank_dir in (out / CACHE_DIR).iterdir():  # a fresh machine: no cache at all
        shutil.rmtree(rank_dir)
    assert f"resumed from {latest_complete(out)}" in run_to_end(job)
    assert_equal_weights(reference, out)


def test_a_cache_smaller_than_a_shard_and_remote_shards_without_a_cache_are_refused(tiny_run, tmp_path):
    store = LocalStorage(tiny_run["shards"])
    with pytest.raises(ValueError, match=r"train.cache_bytes=100: smaller than the largest shard \(shard-\d+"):
        ShardCache(store, read_manifest(store), tmp_path / "c", 100)
    job = TrainJob.model_validate_json(write_job(tiny_run, tmp_path / "t").read_text()).model_dump()
    with pytest.raises(ValidationError, match="s3://b/p.* with train.cache_bytes=0: a storage URL is read through"):
        TrainJob.model_validate({**job, "shards_dir": "s3://b/p"})


def test_a_cache_left_behind_keeps_whole_shards_and_deletes_the_rest(tiny_run, tmp_path):
    store, cache_dir = LocalStorage(tiny_run["shards"]), tmp_path / "cache"
    rows = read_manifest(store)
    cache_dir.mkdir()
    (cache_dir / rows[1].file).write_bytes((Path(tiny_run["shards"]) / rows[1].file).read_bytes())
    damaged = bytearray((Path(tiny_run["shards"]) / rows[2].file).read_bytes())
    damaged[-1] ^= 0xFF
    (cache_dir / rows[2].file).write_bytes(bytes(damaged))
    (cache_dir / f".{rows[3].file}.tmp-123").write_bytes(b"partial")
    cache = ShardCache(store, rows, cache_dir, 3 * max(r.num_bytes for r in rows), log=print)
    assert (cache.stats.kept_at_start, cache.stats.removed_at_start) == (1, 2)
    assert sorted(p.name for p in cache_dir.iterdir()) == [rows[1].file]
    with cache.opened(2) as path:  # the damaged one is fetched again, whole
        assert path.read_bytes() == (Path(tiny_run["shards"]) / rows[2].file).read_bytes()
    cache.close()


def test_the_shard_local_order_is_a_permutation_that_reads_one_window_at_a_time():
    starts, n = tuple(range(0, 40, 4)), 40  # 10 shards of 4 samples
    order = global_order(n, seed=1, epoch=0, windows=ShardWindows(starts, 2))
    assert sorted(order) == list(range(n))
    windows = [{i // 4 for i in order[w : w + 8]} for w in range(0, n, 8)]
    assert all(len(w) == 2 for w in windows) and set().union(*windows) == set(range(10))
    assert global_order(n, 1, 1, ShardWindows(starts, 2)) != order
