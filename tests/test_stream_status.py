"""`eyas status` of a streamed run (eyas.status.stream): a real trainer started on a shard store where extraction has
committed nothing leaves a note of each wait (train/waits/), and status shows both sides as they move: shards
extracted and verified n/N, the trainer's step and the shards it reads next, how far the producer leads it, the
time it waited, and which shard it waits for now, since when; a note left by a killed rank is shown as stale."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from types import SimpleNamespace

import test_stream_reader as stream_reader_tests
import torch
from run_fixtures import REPO, tiny_job
from test_stream_reader import LIMIT_S, TRAIN, commit, fresh_store, stream_source

from eyas.shards.reader import ShardSamples
from eyas.shards.shard_set import RUN_META_NAME
from eyas.shards.wait_record import WAITS_DIR, WaitRecord
from eyas.status.report import run_status
from eyas.status.stream import batch_shards, stream_brief, stream_lines, stream_status
from eyas.storage import open_storage
from eyas.train.launch import JOB_FILE, write_train_job
from eyas.train.metrics import METRICS_FILE, read_metrics
from eyas.train.parallel import Dist
from eyas.train.stream_order import stream_order
from eyas.train.trainer import Trainer
from eyas.verify.arrivals import ArrivalVerifier

CPU = torch.device("cpu")
# the reader's tests' fixtures: the finished 6-shard source, quick waits, one gloo process group
source = stream_reader_tests.source
quick_waits = stream_reader_tests.quick_waits
one_process_group = stream_reader_tests.one_process_group


def streamed_job(source, tmp_path):
    """A streamed job over a store where extraction has started (extract.json, no shard), written to its output
    directory RUN/train as the train stage writes it; -> (job, store, order)."""
    store, fields = fresh_store(source, "local", None, tmp_path)
    job = tiny_job(source["run"], tmp_path / "run" / "train", **TRAIN)
    job = job.model_copy(update={**fields, "stream": stream_source(source)})
    write_train_job(job, tmp_path / "run" / "train" / JOB_FILE)
    return job, store, stream_order(source["plan"], job.train)


def status_when(train_dir, ready) -> dict:
    """The stream status once `ready(status)` holds (the trainer moves on its own)."""
    end = time.monotonic() + LIMIT_S
    while not ready(status := stream_status(train_dir)):
        assert time.monotonic() < end, f"status never reached the expected state; last: {status}"
        time.sleep(0.02)
    return status


def waiting_for(shard: int, step: int):
    return lambda s: s["step"] == step and [w["shard"] for w in s["waits"]] == [shard]


def observe(store, source, verifier, order, train_dir, held: int) -> list[dict]:
    """The producer and an operator reading `eyas status`: before any shard; with every shard but `held` verified
    (the trainer then waits for it); and each time after releasing it. -> the statuses seen."""
    first = order.shards[0]
    seen = [status_when(train_dir, waiting_for(first, 0))]
    for k in order.shards:
        if k != held:
            commit(store, source, k)
            verifier.poll()
    seen.append(status_when(train_dir, waiting_for(held, order.first_step[held] - 1)))
    commit(store, source, held)
    verifier.poll()
    return seen


def test_status_shows_both_sides_of_a_streamed_run_and_the_wait_in_progress(
    source, tmp_path, one_process_group, capsys
):
    job, store, order = streamed_job(source, tmp_path)
    train_dir = tmp_path / "run" / "train"
    held = max(order.first_step, key=order.first_step.get)  # the shard the trainer needs last: it trains up to it
    step_before = order.first_step[held] - 1
    verifier = ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                               order=order.shards, log=lambda line: None)  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        operator = pool.submit(observe, store, source, verifier, order, train_dir, held)
        Trainer(job, Dist(rank=0, world=1, device=CPU)).run()
        before, stuck = operator.result()
    after = stream_status(train_dir)
    records = read_metrics(train_dir / METRICS_FILE)

    first, note = order.shards[0], before["waits"][0]
    assert (before["planned"], before["extracted"], before["verified"], before["step"]) == (6, 0, 0, 0)
    assert before["reads_next"] == batch_shards(job, source["plan"], 1) and first in before["reads_next"]
    assert (note["rank"], note["pid"], note["host"]) == (0, os.getpid(), socket.gethostname())
    assert (note["state"], note["seen"], note["what"]) == ("live", "not committed yet", f"shard-{first:05d}")
    assert note["said"].startswith(f"waiting for shard {first:05d} (full verification, 0 s so far)")
    assert (before["ready_through_step"], before["steps_ahead"], before["next_unverified"]) == (0, 0, first)
    assert "streaming: shards extracted 0/6, verified 0/6 (full mode)" in stream_lines(before)

    ahead = {k for k in order.shards if k != held and order.first_step.get(k, 10**9) > step_before}
    assert (stuck["extracted"], stuck["verified"], stuck["step"]) == (5, 5, step_before)
    assert (stuck["next_unverified"], stuck["ready_through_step"], stuck["steps_ahead"]) == (held, step_before, 0)
    assert stuck["verified_ahead"] == len(ahead) and held in stuck["reads_next"]
    wait = stuck["waits"][0]
    assert (wait["state"], wait["seen"]) == ("live", "not committed yet") and wait["since"] >= note["since"]
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(wait["since"]))
    lines = stream_lines(stuck)
    assert "streaming: shards extracted 5/6, verified 5/6 (full mode)" in lines
    assert any(line.startswith(f"streaming wait now: rank 0 waits for shard {held:05d} since {since} (") and
               line.endswith("s; not committed yet), live") for line in lines), lines  # fmt: skip
    assert any(line.endswith(f"the producer owes shard {held:05d} next") for line in lines), lines
    brief = stream_brief(stuck)  # the progress artifacts' clause (tasks.reporting.StreamSides)
    assert brief.startswith(f"streaming: trainer step {step_before}/") and "verified 5/6" in brief
    assert f"rank 0 waits for shard {held:05d} (" in brief and brief.endswith("s; not committed yet), live")

    last = records[-1]["step"]
    assert (after["extracted"], after["verified"], after["step"], after["last_step"]) == (6, 6, last, last)
    assert after["waits"] == [] and not list((train_dir / WAITS_DIR).iterdir())  # every wait's note removed
    assert after["reads_next"] == [] and after["next_unverified"] is None and after["steps_ahead"] == 0
    assert after["data_wait_s"] == round(sum(r["data_wait_s"] for r in records), 3) > 0
    assert f"streaming trainer: step {last} of {last}; no step left" in stream_lines(after)


def test_status_names_a_wait_for_extract_json_and_for_a_quarantined_shard(source, tmp_path):
    """A real streamed reader with the rank's WaitRecord: opened before extraction recorded extract.json, then reading
    a shard whose first copy was quarantined on arrival; status names each wait while it lasts."""
    job = tiny_job(source["run"], tmp_path / "run" / "train", **TRAIN)
    job = job.model_copy(update={"shards_dir": str(tmp_path / "store"), "stream": stream_source(source)})
    write_train_job(job, tmp_path / "run" / "train" / JOB_FILE)
    train_dir, store = tmp_path / "run" / "train", open_storage(tmp_path / "store")
    record = WaitRecord(train_dir, 0)
    verifier = ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                               log=lambda line: None)  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(ShardSamples, store, stream=job.stream, log=lambda line: None, wait_record=record)
        early = status_when(train_dir, lambda s: [w["what"] for w in s["waits"]] == ["extract-json"])
        store.put_bytes(RUN_META_NAME, json.dumps(asdict(source["run_meta"])).encode())
        samples = opening.result(timeout=LIMIT_S)
        assert stream_status(train_dir)["waits"] == []
        commit(store, source, 2, flip_byte=True)
        assert [r.status for r in verifier.poll()] == ["bad"]
        reading = pool.submit(samples.load_sample, source["plan"][2].sample_start)
        stuck = status_when(train_dir, lambda s: [w["shard"] for w in s["waits"]] == [2])
        commit(store, source, 2)
        assert [r.status for r in verifier.poll()] == ["ok"]
        assert reading.result(timeout=LIMIT_S)["sample_index"] == source["plan"][2].sample_start
    assert any(line.startswith("streaming wait now: rank 0 waits for extract.json since ") and
               line.endswith("s; extraction has not recorded extract.json), live") for line in stream_lines(early))  # fmt: skip
    assert (stuck["extracted"], stuck["verified"]) == (0, 0)
    assert stuck["waits"][0]["seen"] == "quarantined, being extracted again"
    after = stream_status(train_dir)
    assert (after["extracted"], after["verified"], after["waits"]) == (1, 1, [])


NOTE_AND_HANG = """
import sys, time
from eyas.shards.wait_record import WaitRecord
with WaitRecord(sys.argv[1], 1).waiting("shard-00004", shard=4, log=print) as say:
    say("waiting for shard 00004 (full verification, 0 s so far): not committed yet")
    time.sleep(600)
"""


def test_a_rank_killed_mid_wait_leaves_a_note_that_status_calls_stale(source, tmp_path, capsys, monkeypatch):
    """A real process noting a wait, killed with SIGKILL: its note stays, and `eyas status` says it is stale,
    naming the dead process and the note's file."""
    from eyas_cli.main import main

    streamed_job(source, tmp_path)
    train_dir = tmp_path / "run" / "train"
    notes = train_dir / WAITS_DIR
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", NOTE_AND_HANG, str(train_dir)], env=env, cwd=REPO)
    try:
        end = time.monotonic() + LIMIT_S
        while not notes.is_dir() or not list(notes.glob("rank-1.shard-00004.*.json")):
            assert proc.poll() is None and time.monotonic() < end, "the waiting process wrote no note"
            time.sleep(0.02)
        assert stream_status(train_dir)["waits"][0]["state"] == "live"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    [note] = notes.glob("rank-1.shard-00004.*.json")
    wait = stream_status(train_dir)["waits"][0]
    assert wait["state"] == f"stale (process {proc.pid} on {socket.gethostname()} is gone)"
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # no server: the files alone
    assert main(["status", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "- streaming: shards extracted 0/6, verified 0/6 (full mode)" in out
    assert "- streaming wait now: rank 1 waits for shard 00004 since " in out
    assert f"not committed yet), {wait['state']}: a note left by a rank that died mid-wait, {note}" in out


def test_a_job_that_is_not_streamed_has_no_stream_status(source, tmp_path):
    job = tiny_job(source["run"], tmp_path / "run" / "train", **TRAIN)
    write_train_job(job, tmp_path / "run" / "train" / JOB_FILE)
    assert stream_status(tmp_path / "run" / "train") is None
    assert "stream" not in run_status(tmp_path / "run").progress


def test_the_progress_of_a_streamed_run_carries_both_sides_read_at_most_every_interval(source, tmp_path):
    """tasks.reporting.StreamSides around a progress callback: the other side's clause under "sides" (read from the
    run's files once per interval), shown by StageProgress.describe; a job that is not streamed passes through."""
    from tasks.reporting import StageProgress, StreamSides

    job, store, order = streamed_job(source, tmp_path)
    train_dir = tmp_path / "run" / "train"
    seen: list[dict] = []
    sides = StreamSides(train_dir, seen.append, every_s=3600.0)
    sides({"samples_done": 0, "samples_total": 24})
    commit(store, source, order.shards[0])  # read again only after the interval
    sides({"samples_done": 4, "samples_total": 24})
    assert seen[0]["sides"] == seen[1]["sides"] == stream_brief(stream_status(train_dir) | {"extracted": 0})
    assert (
        seen[0]["sides"].startswith("streaming: trainer step 0/") and "extracted 0/6, verified 0/6" in seen[0]["sides"]
    )
    now = StreamSides(train_dir, seen.append, every_s=0.0)
    now({"samples_done": 4, "samples_total": 24})
    assert "extracted 1/6, verified 0/6" in seen[-1]["sides"]
    line = StageProgress.describe(SimpleNamespace(title="extracting"), {**seen[-1], "samples_done": 4})
    assert line == f"extracting; samples 4/24; {seen[-1]['sides']}"
    offline = tmp_path / "offline" / "train"
    write_train_job(job.model_copy(update={"stream": None}), offline / JOB_FILE)
    StreamSides(offline, seen.append)({"samples_done": 1, "samples_total": 2})
    assert seen[-1] == {"samples_done": 1, "samples_total": 2}
