"""The producer side of a streamed run (eyas.extract.streamed): a real extraction (hf backend, random tiny target)
in a trainer's first-need order with each shard verified as it commits, a shard written bad healed within the run,
and a producer SIGKILLed mid-run resumed to the uninterrupted run's manifest."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from run_fixtures import REPO, write_tokenized

from eyas.config import ExtractConfig, load_run_config
from eyas.extract.plan import describe_extraction
from eyas.extract.streamed import ShardQueue, run_streamed_extraction
from eyas.facts import facts_for
from eyas.shards.format import shard_filename
from eyas.shards.manifest import ROWS_DIR, read_manifest
from eyas.shards.shard_set import QUARANTINE_DIR
from eyas.shards.verdicts import read_verdicts, verdict_name, verified_row
from eyas.storage import open_storage
from eyas.train.stream_order import stream_order

CFG = ExtractConfig(shard_bytes=1 << 16, batch_size=8)  # a few samples per shard of the random target (H=64)
NUM_SAMPLES = 60
POLL_S = 0.02


def run_config(num_workers: int = 1, **verify):
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    extract = CFG.model_copy(update={"num_workers": num_workers})
    train = base.train.model_copy(update={"global_batch_size": 4, "shuffle_window_shards": 2})
    return base.model_copy(update={"extract": extract, "train": train, "verify": base.verify.model_copy(update=verify)})


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    rng = random.Random(5)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 16))] for _ in range(NUM_SAMPLES)]
    return write_tokenized(tmp_path_factory.mktemp("streamed") / "tokenized.parquet", samples)


def run_facts(tokenized, target, shards):
    return facts_for(target_path=target, tokenized_path=tokenized, shards_dir=shards)


def trainer_order(config, facts) -> tuple[int, ...]:
    return stream_order(describe_extraction(config.extract, facts)[1], config.train).shards


def verified_in_order(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if "verified on arrival" in line]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tokenized, random_target_dir):
    """A streamed extraction with one worker, uninterrupted: (shards dir, its order, its log, its summary, its
    progress reports)."""
    shards = tmp_path_factory.mktemp("uninterrupted") / "shards"
    config, facts = run_config(), run_facts(tokenized, random_target_dir, shards)
    order, lines, reports = trainer_order(config, facts), [], []
    summary = run_streamed_extraction(config, facts, shard_order=order, log=lines.append, poll_s=POLL_S,
                                      progress=reports.append)  # fmt: skip
    return shards, order, lines, summary, reports


def test_every_shard_is_committed_and_verified_in_the_trainers_order(uninterrupted):
    shards, order, lines, summary, reports = uninterrupted
    rows = read_manifest(shards)
    assert len(order) > 8 and list(order) != sorted(order)
    assert verified_in_order(lines) == list(order)
    assert summary.shards_total == summary.shards_written == len(rows) == len(order) and summary.shards_skipped == 0
    assert [w["shard_indices"] for w in summary.workers] == [list(order)]  # one worker, in the trainer's order
    assert summary.tokens_total == summary.tokens_written == sum(r.num_tokens for r in rows)
    assert read_verdicts(shards) == {verdict_name(r.shard_index, r.checksum, "full") for r in rows}
    assert not list((shards / ROWS_DIR).iterdir()) and not (shards / QUARANTINE_DIR).exists()
    verified = [r["shards_verified"] for r in reports]
    assert verified == sorted(verified) and verified[-1] == len(order)  # counted up as the verifier went
    assert reports[-1]["shards_done"] == len(order) and reports[-1]["tokens_done"] == summary.tokens_total


def corrupting_first_write(store, shard: int):
    """The store, writing shard `shard`'s first copy with one byte flipped (a disk that corrupts one write): the
    row records the checksum of the bytes extraction meant, the file holds others."""
    put, name, seen = store.put_bytes, shard_filename(shard), []

    def put_bytes(object_name: str, data: bytes) -> str:
        if object_name == name and not seen:
            seen.append(object_name)
            data = bytearray(data)
            data[len(data) // 2] ^= 0x01
            data = bytes(data)
        return put(object_name, data)

    store.put_bytes = put_bytes
    return store


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path, tokenized, random_target_dir):
    """(facts, store) of a fresh shard store: a local directory or a prefix on the S3 server."""
    if request.param == "local":
        shards = tmp_path / "shards"
        return run_facts(tokenized, random_target_dir, shards), open_storage(shards)
    bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
    url = f"s3://{bucket}/run/shards"
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, storage_url=url,
                      s3_endpoint_url=endpoint)  # fmt: skip
    return facts, open_storage(url, endpoint_url=endpoint)


def test_a_shard_written_bad_is_quarantined_and_written_again_within_the_run(where, uninterrupted):
    clean, order, *_ = uninterrupted
    bad = order[1]  # needed early: written again before the shards needed after it
    (facts, store), config, lines = where, run_config(num_workers=2), []
    summary = run_streamed_extraction(config, facts, shard_order=order, store=corrupting_first_write(store, bad),
                                      log=lines.append, poll_s=POLL_S)  # fmt: skip
    quarantined = [line for line in lines if "quarantined on arrival" in line]
    assert len(quarantined) == 1 and quarantined[0].startswith(f"shard {bad:05d} quarantined on arrival: ")
    assert f"{shard_filename(bad)}: checksum mismatch" in quarantined[0]
    assert f"1 quarantined shards written again in this run ({bad:05d})" in lines[-1]
    written = sorted(k for w in summary.workers for k in w["shard_indices"])
    assert written == sorted([*order, bad])  # every shard once, the bad one twice
    assert sorted(verified_in_order(lines)) == sorted(order) and summary.shards_total == len(order)
    assert read_manifest(store) == read_manifest(clean) and not store.list(ROWS_DIR + "/")
    assert all(verified_row(store, k, mode="full") is not None for k in order)
    aside = sorted(store.list(QUARANTINE_DIR + "/"))
    assert len(aside) == 2 and aside[0].startswith(f"{QUARANTINE_DIR}/{shard_filename(bad)}.")


def test_a_shard_bad_on_every_write_stops_the_run_with_its_reasons(tmp_path, tokenized, random_target_dir):
    shards = tmp_path / "shards"
    config, facts = run_config(num_heal_rounds=0), run_facts(tokenized, random_target_dir, shards)
    order = trainer_order(config, facts)
    store = corrupting_first_write(open_storage(shards), order[0])
    with pytest.raises(RuntimeError, match=rf"{shards}: shard {order[0]:05d} was quarantined on arrival 1 times in "
                       rf"this run, expected at most 0 \(verify.num_heal_rounds\); each write came out bad: "
                       rf"{shard_filename(order[0])}: checksum mismatch.*raise verify.num_heal_rounds"):  # fmt: skip
        run_streamed_extraction(config, facts, shard_order=order, store=store, log=lambda _: None, poll_s=POLL_S)


CHILD = """
import json, sys
from eyas.extract.streamed import ShardQueue, run_streamed_extraction
sys.path.insert(0, "tests")
from test_streamed_extraction import run_config, run_facts, trainer_order
a = json.loads(sys.argv[1])
config, facts = run_config(), run_facts(a["tokenized"], a["target"], a["shards"])
summary = run_streamed_extraction(config, facts, shard_order=trainer_order(config, facts), poll_s=0.02,
                                  log=lambda line: print(line, flush=True))
print(json.dumps(summary.to_dict()), flush=True)
"""


def start_child(tokenized, target, shards) -> subprocess.Popen:
    args = json.dumps({"tokenized": str(tokenized), "target": str(target), "shards": str(shards)})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, args], cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)


def verdict_shards(shards) -> set[int]:
    return {int(n.split("shard-")[1][:5]) for n in read_verdicts(shards)} if shards.is_dir() else set()


def kill_after_verdicts(child: subprocess.Popen, shards, count: int, rng: random.Random) -> str:
    """SIGKILL the child once `count` shards have a verdict (plus a random few ms); what it printed."""
    deadline = time.monotonic() + 120  # a bound against hanging, not a measure of speed
    while len(verdict_shards(shards)) < count and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.03))
    child.send_signal(signal.SIGKILL)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, f"the extraction ended before it was killed: {out[-2000:]}"
    return out


def test_a_producer_killed_mid_run_resumes_to_the_uninterrupted_manifest(
    tmp_path, tokenized, random_target_dir, uninterrupted
):
    clean, order, *_ = uninterrupted
    shards, rng = tmp_path / "shards", random.Random(7)
    for count in (2, len(order) // 2):
        kill_after_verdicts(start_child(tokenized, random_target_dir, shards), shards, count, rng)
        assert count <= len(verdict_shards(shards)) < len(order)  # the kill landed mid-run
    kept = {n: (shards / n).stat().st_mtime_ns for n in read_verdicts(shards)}
    committed = {r.shard_index for r in read_manifest(shards)}
    last = start_child(tokenized, random_target_dir, shards)
    out, _ = last.communicate(timeout=120)
    assert last.returncode == 0, out[-3000:]
    summary = json.loads(out.splitlines()[-1])
    assert summary["shards_skipped"] == len(committed) and summary["shards_written"] == len(order) - len(committed)
    assert sorted(k for w in summary["workers"] for k in w["shard_indices"]) == sorted(set(order) - committed)
    again = set(verified_in_order(out.splitlines()))
    assert again == set(order) - {int(n.split("shard-")[1][:5]) for n in kept}  # none checked twice
    assert all((shards / n).stat().st_mtime_ns == t for n, t in kept.items())  # verdicts kept as they were
    assert read_manifest(shards) == read_manifest(clean)
    assert all(verified_row(shards, k, mode="full") == r for k, r in enumerate(read_manifest(clean)))
    assert not list(shards.glob(".*tmp-*")) and not list((shards / ROWS_DIR).iterdir())


def test_a_shard_put_back_is_taken_before_every_shard_needed_after_it():
    queue = ShardQueue([5, 2, 7, 1], position={5: 0, 2: 1, 7: 2, 1: 3, 4: 4})
    assert [queue.take(), queue.take()] == [5, 2]
    queue.put(5)  # quarantined after its commit
    assert [queue.take(), queue.take(), queue.take()] == [5, 7, 1]
    queue.close()
    assert queue.take() is None


def test_a_verified_shard_whose_file_is_lost_is_written_and_verified_again(
    tmp_path, tokenized, random_target_dir, uninterrupted
):
    clean, order, *_ = uninterrupted
    shards, lost = tmp_path / "shards", order[-1]
    shutil.copytree(clean, shards)
    (shards / shard_filename(lost)).unlink()
    config, facts, lines = run_config(), run_facts(tokenized, random_target_dir, shards), []
    summary = run_streamed_extraction(config, facts, shard_order=order, log=lines.append, poll_s=POLL_S)
    assert "1 to extract" in lines[0] and "1 verdicts of shards to rewrite dropped" in lines[0]
    assert f"{shard_filename(lost)}: listed in the manifest" in lines[1]
    assert verified_in_order(lines) == [lost]  # its old verdict was not taken for the new file's
    assert summary.shards_written == 1 and summary.workers[0]["shard_indices"] == [lost]
    assert read_manifest(shards) == read_manifest(clean) and read_verdicts(shards) == read_verdicts(clean)
