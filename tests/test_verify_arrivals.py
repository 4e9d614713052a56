"""Verification on arrival (eyas.verify.arrivals): shards committed one by one through extraction's commit path
(eyas.shards.format.write_shard, then eyas.shards.manifest.record_row) into a local directory or the S3 server,
checked while they land, verdicts recorded in the store, bad shards quarantined, readers waiting for a shard."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from run_fixtures import REPO, extract, write_tiny_run, write_tokenized

from eyas.config import ExtractConfig, load_run_config
from eyas.extract.plan import describe_extraction
from eyas.facts import facts_for
from eyas.shards.format import load_shard, shard_filename, write_shard
from eyas.shards.manifest import (
    MANIFEST_NAME,
    ROWS_DIR,
    committed_row,
    compact_manifest,
    read_compacted_rows,
    read_manifest,
    record_row,
    row_name,
)
from eyas.shards.shard_set import QUARANTINE_DIR
from eyas.shards.synthetic import SYNTHETIC_DATASET_HASH, SyntheticSpec
from eyas.shards.verdicts import ShardWaitTimeout, read_verdicts, verdict_name, verified_row, wait_verified
from eyas.storage import open_storage
from eyas.target import target_fingerprint
from eyas.train.stream_order import stream_order
from eyas.verify.arrivals import ArrivalVerifier, arrival_verifier
from eyas.verify.checks import ExpectedShardMeta
from eyas.verify.shard_set import verify_shards

NUM_SHARDS = 6
ORDER = [3, 0, 5, 1, 4, 2]  # the order a trainer first needs them, which the coordinator commits in
POLL_S = 0.02


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Six good shards of a synthetic run (extraction's writers, real checksums), the tokenized table they were
    extracted from and what their metadata must say: the bytes that the tests commit into a store."""
    root = tmp_path_factory.mktemp("arrivals")
    run = write_tiny_run(root, num_samples=4 * NUM_SHARDS, per_shard=4)
    samples = run["samples"]
    tokenized = write_tokenized(root / "tokenized.parquet", [s["input_ids"].tolist() for s in samples],
                                masks=[s["loss_mask"].tolist() for s in samples],
                                dataset_hash=SYNTHETIC_DATASET_HASH)  # fmt: skip
    spec = SyntheticSpec()
    expected = ExpectedShardMeta(target_fingerprint=target_fingerprint(run["target"]),
                                 aux_layer_ids=spec.aux_layer_ids, hidden_size=spec.hidden, num_aux=spec.num_aux,
                                 dtype="float32", dataset_hash=SYNTHETIC_DATASET_HASH)  # fmt: skip
    report = verify_shards(shards_dir=run["shards"], tokenized_path=tokenized, expected=expected, num_workers=1)
    assert report.ok and len(report.rows) == NUM_SHARDS, report.bad_reasons or report.problems
    return {"shards": run["shards"], "tokenized": tokenized, "expected": expected}


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_storage(tmp_path / "store")
    bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
    return open_storage(f"s3://{bucket}/run/shards", endpoint_url=endpoint)


def commit(store, source, k: int, *, flip_byte: bool = False):
    """Commit shard k as an extraction worker does (the shard durable, then its row); with `flip_byte` one byte
    in the middle of the object (inside the hidden states) differs from what its row's checksum says."""
    tensors, meta = load_shard(source["shards"] / shard_filename(k))
    row = write_shard(store, tensors, meta)
    if flip_byte:
        data = bytearray((source["shards"] / row.file).read_bytes())
        data[len(data) // 2] ^= 0x01
        store.put_bytes(row.file, bytes(data))
    record_row(store, row)
    return row


def verifier(store, source, lines: list, **kw) -> ArrivalVerifier:
    return ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                           log=lines.append, **kw)  # fmt: skip


def until(condition, what: str, *, limit_s: float = 60.0) -> None:
    """Block until `condition()` is true; a bound against hanging, not a measure of speed."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, f"{what}: not seen within {limit_s} s"
        time.sleep(POLL_S)


def verified_in_order(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if "verified on arrival" in line]


def test_shards_committed_one_by_one_are_verified_in_commit_order(store, source):
    lines, waits, stop = [], [], threading.Event()
    v = verifier(store, source, lines, order=ORDER)
    with ThreadPoolExecutor(2) as pool:
        following = pool.submit(v.follow, until=stop.is_set, poll_s=POLL_S)
        last = pool.submit(wait_verified, store, ORDER[-1], mode="full", timeout_s=60, poll_s=POLL_S,
                           log=waits.append, log_every_s=0)  # fmt: skip
        until(lambda: waits, "the reader's first message")
        rows = {k: commit(store, source, k) for k in ORDER}
        got = last.result()
        stop.set()
        following.result()
    assert waits[0].startswith(f"waiting for shard {ORDER[-1]:05d} (full verification, 0 s so far): not committed yet")
    assert got.row == rows[ORDER[-1]]
    assert verified_in_order(lines) == ORDER and v.verified == set(ORDER)
    assert read_verdicts(store) == {verdict_name(k, row.checksum, "full") for k, row in rows.items()}
    assert all(verified_row(store, k, mode="cheap") == row for k, row in rows.items())  # full covers cheap
    assert not store.list(QUARANTINE_DIR + "/")


def test_a_flipped_byte_is_quarantined_and_the_reader_waits_for_its_re_extraction(store, source):
    lines, waits, stop = [], [], threading.Event()
    v = verifier(store, source, lines)
    with ThreadPoolExecutor(2) as pool:
        following = pool.submit(v.follow, until=stop.is_set, poll_s=POLL_S)
        for k in (0, 1):
            commit(store, source, k)
        bad = commit(store, source, 2, flip_byte=True)
        reader = pool.submit(wait_verified, store, 2, mode="full", timeout_s=60, poll_s=POLL_S, log=waits.append,
                             log_every_s=0)  # fmt: skip
        until(lambda: any("quarantined" in w for w in waits), "the reader saying shard 2 is quarantined")
        assert committed_row(store, 2) is None and [r.shard_index for r in read_manifest(store)] == [0, 1]
        assert sorted(store.list(ROWS_DIR + "/")) == [row_name(0), row_name(1)]  # the others' rows untouched
        assert bad.file not in store.list()
        aside = sorted(store.list(QUARANTINE_DIR + "/"))
        assert len(aside) == 2 and aside[0].startswith(f"{QUARANTINE_DIR}/{bad.file}.")
        assert f"{bad.file}: checksum mismatch" in store.get_bytes(aside[1]).decode()
        with pytest.raises(ShardWaitTimeout, match=rf"shard 00002 of {store.url}: not verified \(full\) after 0 s of "
                           rf"waiting \(timeout 0.01 s\); last seen: quarantined \({bad.file}: checksum mismatch: "
                           rf".*\), being extracted again; is the extraction running\? it writes quarantined shards "
                           rf"again"):  # fmt: skip
            wait_verified(store, 2, mode="full", timeout_s=0.01, log=waits.append)
        good = commit(store, source, 2)  # the extraction writes it again
        got = reader.result()
        stop.set()
        following.result()
    assert got.row == good == bad  # the same bytes as planned, now stored right
    quarantined = [w for w in waits if "quarantined" in w]
    assert quarantined[0].startswith("waiting for shard 00002 (full verification, ") and quarantined[0].endswith(
        "being extracted again"
    )
    assert [line.split()[1] for line in lines if "quarantined on arrival" in line] == ["00002"]
    rows = {0: committed_row(store, 0), 1: committed_row(store, 1), 2: good}
    assert verified_in_order(lines) == [0, 1, 2]
    assert read_verdicts(store) == {verdict_name(k, r.checksum, "full") for k, r in rows.items()}


def test_a_real_extraction_is_verified_in_the_order_it_commits(tmp_path, random_target_dir):
    """The hf backend extracting in a trainer's order (one worker) while the run's verifier follows its store."""
    rng = random.Random(3)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 16))] for _ in range(24)]
    tokenized = write_tokenized(tmp_path / "tokenized.parquet", samples)
    cfg = ExtractConfig(shard_bytes=1 << 16, batch_size=8)
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    config = base.model_copy(update={"extract": cfg})
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=tmp_path / "shards")
    plan = describe_extraction(cfg, facts)[1]
    order = stream_order(plan, config.train.model_copy(update={"global_batch_size": 4})).shards
    lines, stop = [], threading.Event()
    v = arrival_verifier(config, facts, order=order, log=lines.append)
    with ThreadPoolExecutor(1) as pool:
        following = pool.submit(v.follow, until=stop.is_set, poll_s=POLL_S)
        extract(tokenized, tmp_path / "shards", random_target_dir, cfg, shard_order=order)
        wait_verified(facts.storage(), order[-1], mode="full", timeout_s=60, poll_s=POLL_S, log=lines.append)
        stop.set()
        following.result()
    assert len(plan) > 3 and order != tuple(range(len(plan)))
    assert verified_in_order(lines) == list(order) and v.verified == set(order)
    assert not list((tmp_path / "shards" / "rows").iterdir())  # compacted at the end while the verifier followed


def test_a_bad_compacted_shard_loses_its_row_alone(tmp_path, source):
    store, lines = open_storage(tmp_path / "store"), []
    rows = [commit(store, source, k) for k in (0, 1, 2)]
    compact_manifest(store)  # as a coordinator does when it starts
    data = bytearray((source["shards"] / rows[1].file).read_bytes())
    data[len(data) // 2] ^= 0x01
    store.put_bytes(rows[1].file, bytes(data))
    fourth = commit(store, source, 3)
    results = verifier(store, source, lines).poll()
    assert [(r.shard, r.status) for r in results] == [(0, "ok"), (1, "bad"), (2, "ok"), (3, "ok")]
    assert read_compacted_rows(store) == [rows[0], rows[2]] and store.list(ROWS_DIR + "/").keys() == {row_name(3)}
    assert read_manifest(store) == [rows[0], rows[2], fourth] and store.exists(MANIFEST_NAME)


def test_a_shard_written_again_with_other_bytes_is_verified_again(tmp_path, source):
    store, lines = open_storage(tmp_path / "store"), []
    v = verifier(store, source, lines)
    first = commit(store, source, 0)
    assert [r.shard for r in v.poll()] == [0] and verified_row(store, 0, mode="full") == first
    tensors, meta = load_shard(source["shards"] / shard_filename(0))
    tensors["aux_hidden_states"] = tensors["aux_hidden_states"] + 1.0  # still a valid shard, other bytes
    again = write_shard(store, tensors, meta)
    record_row(store, again)
    assert again.checksum != first.checksum and verified_row(store, 0, mode="full") is None
    assert [(r.shard, r.status) for r in v.poll()] == [(0, "ok")] and v.poll() == []
    assert verified_row(store, 0, mode="full") == again


def test_a_reader_that_times_out_names_the_shard_and_what_it_saw(tmp_path, source):
    store, waits = open_storage(tmp_path / "store"), []
    with pytest.raises(ShardWaitTimeout, match=rf"shard 00004 of {tmp_path / 'store'}: not verified \(cheap\) after "
                       r"0 s of waiting \(timeout 0.01 s\); last seen: not committed yet; is the extraction running "
                       r"\(eyas status shows its progress\)\? run it again"):  # fmt: skip
        wait_verified(store, 4, mode="cheap", timeout_s=0.01, log=waits.append)
    commit(store, source, 4)
    with pytest.raises(ShardWaitTimeout, match=r"last seen: committed, being verified; is the arrival verifier "
                       r"running \(eyas.verify.arrivals.ArrivalVerifier follows the manifest\)\?"):  # fmt: skip
        wait_verified(store, 4, mode="full", timeout_s=0.01, log=waits.append)
    assert waits == ["waiting for shard 00004 (cheap verification, 0 s so far): not committed yet",
                     "waiting for shard 00004 (full verification, 0 s so far): committed, being verified"]  # fmt: skip


def test_a_verifier_against_another_dataset_is_refused(tmp_path, source):
    other = ExpectedShardMeta(**{**source["expected"].__dict__, "dataset_hash": "d5e7"})
    with pytest.raises(ValueError, match=rf"arrival verification of {tmp_path}: tokenized dataset "
                       rf"{source['tokenized']}: content hash 'synthetic', expected 'd5e7'; verify against the "
                       r"dataset the run extracted from"):  # fmt: skip
        ArrivalVerifier(tmp_path, tokenized_path=source["tokenized"], expected=other, mode="full")
    with pytest.raises(ValueError, match=r"verify mode 'fast': expected 'cheap' or 'full' \(verify.mode\)"):
        wait_verified(tmp_path, 0, mode="fast", timeout_s=1)


CHILD = """
import json, os, signal, sys
from eyas.storage import open_storage
from eyas.shards.verdicts import verdict_name
from eyas.verify.arrivals import ArrivalVerifier
from eyas.verify.checks import ExpectedShardMeta
a = json.loads(sys.argv[1])
store = open_storage(a["store"], endpoint_url=a["endpoint"])
if a["die_before_verdict_of"] is not None:  # SIGKILLed after the shard's checks passed, before its verdict is written
    put, doomed = store.put_bytes, verdict_name(a["die_before_verdict_of"], "", "full").removesuffix(".json")
    store.put_bytes = lambda name, data: os.kill(os.getpid(), signal.SIGKILL) if name.startswith(doomed) else put(name, data)
v = ArrivalVerifier(store, tokenized_path=a["tokenized"], expected=ExpectedShardMeta(**a["expected"]), mode="full",
                    log=lambda line: print(line, flush=True))
v.follow(until=lambda: len(v.verified) >= a["num_shards"], poll_s=0.02)
"""


def start_child(store, source, *, die_before_verdict_of: int | None = None) -> subprocess.Popen:
    """A verifier in its own process, following `store` until every shard is verified, printing each verdict."""
    endpoint = store.client.meta.endpoint_url if store.url.startswith("s3://") else ""
    args = {"store": store.url, "endpoint": endpoint, "tokenized": str(source["tokenized"]),
            "expected": source["expected"].__dict__, "num_shards": NUM_SHARDS,
            "die_before_verdict_of": die_before_verdict_of}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip


def read_until(child: subprocess.Popen, marker: str) -> list[str]:
    lines = []
    for line in child.stdout:
        lines.append(line.strip())
        if marker in line:
            return lines
    raise AssertionError(f"the verifier ended (rc {child.wait()}) before printing {marker!r}: {lines}")


def killed(child: subprocess.Popen) -> list[str]:
    """SIGKILL the child; the lines it printed until then."""
    child.send_signal(signal.SIGKILL)
    return died(child)


def died(child: subprocess.Popen) -> list[str]:
    """Wait for the child to end by SIGKILL; the lines it printed."""
    out, _ = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, out
    return out.splitlines()


def verdict_shards(store) -> set[int]:
    return {int(n.split("shard-")[1][:5]) for n in read_verdicts(store)}


def test_a_killed_verifier_resumes_without_checking_a_recorded_shard_again_and_loses_none(store, source):
    """Kills: idle between shards; after a shard's checks passed, before its verdict; at once after a verdict
    (anywhere in what follows). Each restart checks exactly the committed shards without a verdict."""
    for k in (0, 1, 2):
        commit(store, source, k)
    first = start_child(store, source)
    for k in (0, 1, 2):
        wait_verified(store, k, mode="full", timeout_s=60, poll_s=POLL_S, log=lambda _: None)
    lines = read_until(first, "shard 00002 verified") + killed(first)  # nothing left to check: idle
    assert sorted(verified_in_order(lines)) == [0, 1, 2]
    for k in (3, 4, 5):
        commit(store, source, k)
    second = start_child(store, source, die_before_verdict_of=4)
    assert verified_in_order(died(second)) == [3] and verdict_shards(store) == {0, 1, 2, 3}
    third = start_child(store, source)
    lines = read_until(third, "verified on arrival") + killed(third)
    assert verified_in_order(lines)[0] == 4  # checked again: its verdict was never written
    recorded = verdict_shards(store)
    assert {0, 1, 2, 3, 4} <= recorded
    last = start_child(store, source)
    out, _ = last.communicate(timeout=120)
    assert last.returncode == 0, out
    assert sorted(verified_in_order(out.splitlines())) == sorted(set(range(NUM_SHARDS)) - recorded)
    assert "quarantined" not in out and verdict_shards(store) == set(range(NUM_SHARDS))
    assert all(verified_row(store, r.shard_index, mode="full") == r for r in read_manifest(store))
