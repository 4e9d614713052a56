"""SIGKILL at random points of an extraction, resumed with other worker counts: the final shard set is
byte-identical to an uninterrupted run's, with no sample lost and none duplicated."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_fixtures import write_tokenized

from eyas.config import ExtractConfig
from eyas.shards.format import load_shard
from eyas.shards.manifest import ROWS_DIR, done_shard_indices, read_manifest

REPO = Path(__file__).resolve().parents[1]
CFG = ExtractConfig(shard_bytes=1 << 16, batch_size=3)


@pytest.fixture(scope="module")
def job(tmp_path_factory, random_target_dir):
    root = tmp_path_factory.mktemp("crash")
    rng = random.Random(11)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 24))] for _ in range(160)]
    (root / "extract.json").write_text(CFG.model_dump_json())
    return {
        "tokenized": write_tokenized(root / "tokenized.parquet", samples),
        "config": root / "extract.json",
        "target": random_target_dir,
        "num_samples": len(samples),
    }


def _start(job, shards: Path, num_workers: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "eyas.extract",
        "--tokenized",
        str(job["tokenized"]),
        "--shards",
        str(shards),
        "--target",
        str(job["target"]),
        "--config",
        str(job["config"]),
        "--num-workers",
        str(num_workers),
    ]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _run(job, shards: Path, num_workers: int) -> dict:
    proc = _start(job, shards, num_workers)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _rows_written(shards: Path) -> int:
    """Shards recorded so far (compacted manifest + row files)."""
    return len(done_shard_indices(shards)) if shards.is_dir() else 0


def _kill_after_rows(job, shards: Path, num_workers: int, num_rows: int, rng: random.Random) -> int:
    """Start an extraction, SIGKILL it once `num_rows` shards are recorded (plus a random few ms); return
    how many it had recorded when it died."""
    proc = _start(job, shards, num_workers)
    deadline = time.monotonic() + 120
    while _rows_written(shards) < num_rows and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.03))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the extraction finished before it could be killed: use more samples"
    return _rows_written(shards)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, job):
    shards = tmp_path_factory.mktemp("uninterrupted") / "shards"
    summary = _run(job, shards, num_workers=1)
    assert summary["shards_total"] >= 30
    return shards


def _snapshot(shards: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(shards.glob("shard-*.safetensors"))}


@pytest.mark.parametrize("seed, workers", [(1, (2, 1, 3)), (2, (1, 3, 2))])
def test_sigkilled_and_resumed_on_other_worker_counts_is_byte_identical(tmp_path, job, uninterrupted, seed, workers):
    rng = random.Random(seed)
    shards = tmp_path / "shards"
    total = len(read_manifest(uninterrupted))
    recorded = []
    for num_workers, upto in zip(workers[:2], sorted(rng.sample(range(1, total // 2), 2))):
        recorded.append(_kill_after_rows(job, shards, num_workers, upto, rng))
    assert 0 < recorded[0] <= recorded[1] < total  # each kill landed mid-run
    final = _run(job, shards, num_workers=workers[2])
    assert final["shards_skipped"] == recorded[1] and final["shards_written"] == total - recorded[1]

    assert _snapshot(shards) == _snapshot(uninterrupted)
    assert read_manifest(shards) == read_manifest(uninterrupted)
    assert not list(shards.glob(".*tmp-*")) and not list((shards / ROWS_DIR).glob("*"))
    indices = torch.cat([load_shard(shards / r.file)[0]["sample_indices"] for r in read_manifest(shards)])
    assert indices.tolist() == list(range(job["num_samples"]))  # 0 lost, 0 duplicated, in order
