"""The trainer's side of streaming (TrainJob.stream, eyas.shards.streamed): a real trainer started on a shard store
where extraction has committed nothing yet (in process with one rank, from a local directory or from the S3
server through its cache; and two ranks under torchrun) reads each shard only once it is verified on arrival,
waits for it and says so, and trains on the same samples to the same weights, bit for bit, as an offline run over
the finished store; a shard whose committed bytes fail verification is never read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
from run_fixtures import REPO, run_trainer, tiny_job, write_tiny_run, write_tokenized
from safetensors.torch import load_file

import eyas.shards.cache as cache
import eyas.shards.streamed as streamed
from eyas.config import PlannedShard, StreamSource
from eyas.shards.format import ShardPlan, load_shard, shard_filename, write_shard
from eyas.shards.manifest import read_manifest, record_row
from eyas.shards.reader import ShardSamples
from eyas.shards.shard_set import RUN_META_NAME, ExtractRunMeta
from eyas.shards.streamed import StreamPlanError
from eyas.shards.synthetic import SYNTHETIC_DATASET_HASH, SyntheticSpec
from eyas.storage import open_storage
from eyas.target import target_fingerprint
from eyas.train.metrics import METRICS_FILE, read_metrics
from eyas.train.parallel import Dist
from eyas.train.stream_order import stream_order
from eyas.train.trainer import Trainer
from eyas.verify.arrivals import ArrivalVerifier
from eyas.verify.checks import ExpectedShardMeta

CPU = torch.device("cpu")
TRAIN = dict(num_processes=1, num_epochs=2, eval_fraction=0.2, save_every_steps=3, prefetch_steps=1)
TIMING = {"elapsed_s", "tokens_per_s", "data_wait_s", "data_stall_fraction"}
LIMIT_S = 60.0  # a bound against hanging, not a measure of speed


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def quick_waits(monkeypatch):
    """A waiting reader looks every 20 ms and says so at every look, so a test sees each state it passes through."""
    monkeypatch.setattr(streamed, "POLL_S", 0.02)
    monkeypatch.setattr(cache, "POLL_S", 0.02)
    monkeypatch.setattr(streamed, "SAY_EVERY_S", 0.0)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A finished synthetic run of 6 shards (the bytes a producer commits), its tokenized table, what its shards'
    metadata must say, its shard plan and its extract.json."""
    root = tmp_path_factory.mktemp("stream-source")
    run = write_tiny_run(root, num_samples=24, per_shard=4)
    samples = run["samples"]
    tokenized = write_tokenized(root / "tokenized.parquet", [s["input_ids"].tolist() for s in samples],
                                masks=[s["loss_mask"].tolist() for s in samples],
                                dataset_hash=SYNTHETIC_DATASET_HASH)  # fmt: skip
    spec, fingerprint = SyntheticSpec(), target_fingerprint(run["target"])
    expected = ExpectedShardMeta(target_fingerprint=fingerprint, aux_layer_ids=spec.aux_layer_ids,
                                 hidden_size=spec.hidden, num_aux=spec.num_aux, dtype="float32",
                                 dataset_hash=SYNTHETIC_DATASET_HASH)  # fmt: skip
    rows = read_manifest(run["shards"])
    _, meta = load_shard(run["shards"] / rows[0].file)
    run_meta = ExtractRunMeta(format_version=meta.format_version, target_fingerprint=meta.target_fingerprint,
                              aux_layer_ids=list(meta.aux_layer_ids), layer_id_convention=meta.layer_id_convention,
                              hidden_size=meta.hidden_size, num_aux=meta.num_aux, dtype=meta.dtype,
                              target_dtype="float32", backend=meta.backend, dataset_hash=meta.dataset_hash,
                              shard_bytes=max(r.num_bytes for r in rows), num_shards=len(rows),
                              aux_dtype=meta.aux_dtype, teacher=meta.teacher, teacher_topk=meta.teacher_topk)  # fmt: skip
    plan = [ShardPlan(r.shard_index, r.sample_start, r.sample_end, r.num_tokens) for r in rows]
    return {"run": run, "tokenized": tokenized, "expected": expected, "plan": plan, "run_meta": run_meta}


def stream_source(source, mode: str = "full") -> StreamSource:
    plan = [PlannedShard(sample_start=p.sample_start, sample_end=p.sample_end, num_tokens=p.num_tokens)
            for p in source["plan"]]  # fmt: skip
    return StreamSource(verify_mode=mode, plan=plan)


def fresh_store(source, where: str, request, tmp_path):
    """A store where extraction has started (extract.json recorded, no shard committed): a local directory, or a
    prefix of the S3 server; -> (store, the job fields that read it)."""
    if where == "local":
        store, fields = open_storage(tmp_path / "store"), {"shards_dir": str(tmp_path / "store")}
    else:
        bucket, endpoint = request.getfixturevalue("s3_bucket"), request.getfixturevalue("s3_endpoint")
        store = open_storage(f"s3://{bucket}/run/shards", endpoint_url=endpoint)
        fields = {"shards_dir": store.url, "shards_endpoint_url": endpoint}
    store.put_bytes(RUN_META_NAME, json.dumps(asdict(source["run_meta"])).encode())
    return store, fields


def commit(store, source, k: int, *, flip_byte: bool = False) -> None:
    """Commit shard k as an extraction worker does (the shard durable, then its row); with `flip_byte` one byte in
    the middle (inside the hidden states) differs from what its row's checksum says."""
    tensors, meta = load_shard(source["run"]["shards"] / shard_filename(k))
    row = write_shard(store, tensors, meta)
    if flip_byte:
        data = bytearray(store.get_bytes(row.file))
        data[len(data) // 2] ^= 0x01
        store.put_bytes(row.file, bytes(data))
    record_row(store, row)


class Transcript:
    """What the trainer printed so far (`take()` returns what is new: capsys's, or a pipe's), read from the
    producer's thread and at the end."""

    def __init__(self, take):
        self.take, self.text, self.lock = take, "", threading.Lock()

    def read(self) -> str:
        with self.lock:
            self.text += self.take()
            return self.text

    def wait_for(self, needle: str, *, after: int = 0) -> int:
        """Block until `needle` is printed past character `after`; -> where the text then ends."""
        end = time.monotonic() + LIMIT_S
        while needle not in self.read()[after:]:
            assert time.monotonic() < end, f"{needle!r}: not printed within {LIMIT_S} s"
            time.sleep(0.02)
        return len(self.text)


def produce(store, source, verifier, order, said: Transcript, *, bad: int | None) -> None:
    """The producer: each shard committed and verified in stream order, each that a step reads only once the trainer
    says it waits for it; shard `bad` first with a flipped byte, which is quarantined, and its good copy only once
    the trainer says it waits on the quarantine."""
    done: set[int] = set()
    try:
        _produce(store, source, verifier, order, said, bad, done)
    except BaseException:  # the trainer waits forever by design: let it end, then fail with the producer's error
        for k in order.shards:
            if k not in done:
                commit(store, source, k)
        verifier.poll()
        raise


def _produce(store, source, verifier, order, said: Transcript, bad: int | None, done: set[int]) -> None:
    for k in order.shards:
        if k in order.first_step:
            seen = said.wait_for(f"waiting for shard {k:05d} (full verification")
        if k == bad:
            commit(store, source, k, flip_byte=True)
            assert [r.status for r in verifier.poll()] == ["bad"]
            said.wait_for(f"waiting for shard {k:05d} (full verification", after=seen)
            said.wait_for("quarantined (", after=seen)  # the trainer saw the quarantine, and goes on waiting
        commit(store, source, k)
        done.add(k)
        assert [r.status for r in verifier.poll()] == ["ok"]


def weights(out) -> dict[str, torch.Tensor]:
    final = sorted((out / "checkpoints").glob("step-*"))[-1]
    return {f"{f.name}:{k}": v for f in sorted(final.glob("*.safetensors")) for k, v in load_file(f).items()}


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.parametrize("bad", [None, "third"])
@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_streamed_run_waits_for_each_verified_shard_and_ends_as_the_offline_run(
    source, tmp_path, capsys, request, one_process_group, where, bad
):
    """Local: the shard directory read in place; s3: read through a cache of two shards, which fetches ahead only
    what is verified."""
    offline = tiny_job(source["run"], tmp_path / "offline", **TRAIN)
    Trainer(offline, Dist(rank=0, world=1, device=CPU)).run()
    store, fields = fresh_store(source, where, request, tmp_path)
    train = offline.train
    if where == "s3":
        train = train.model_copy(update={"cache_bytes": 2 * source["run_meta"].shard_bytes})
    job = offline.model_copy(update={**fields, "output_dir": str(tmp_path / "streamed"), "train": train,
                                     "stream": stream_source(source)})  # fmt: skip
    order = stream_order(source["plan"], job.train)
    bad_shard = order.shards[2] if bad else None
    lines: list[str] = []
    verifier = ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                               order=order.shards, log=lines.append)  # fmt: skip
    capsys.readouterr()
    transcript = Transcript(lambda: capsys.readouterr().out)
    with ThreadPoolExecutor(1) as pool:
        producer = pool.submit(produce, store, source, verifier, order, transcript, bad=bad_shard)
        Trainer(job, Dist(rank=0, world=1, device=CPU)).run()
        producer.result()
    said = transcript.read()
    first = order.shards[0]
    assert (
        f"[eyas.train] rank 0: waiting for shard {first:05d} (full verification, 0 s so far): not committed yet" in said
    )
    for k in order.first_step:
        assert f"waiting for shard {k:05d} (full verification" in said, k
    streamed_records = read_metrics(tmp_path / "streamed" / METRICS_FILE)
    assert without_timing(streamed_records) == without_timing(read_metrics(tmp_path / "offline" / METRICS_FILE))
    assert sum(r["data_wait_s"] for r in streamed_records) > 0
    reference, got = weights(tmp_path / "offline"), weights(tmp_path / "streamed")
    assert reference.keys() == got.keys() and [k for k in reference if not torch.equal(reference[k], got[k])] == []
    if bad:
        assert f"shard {bad_shard:05d} quarantined on arrival" in "\n".join(lines)
        waits = [line for line in said.splitlines() if f"waiting for shard {bad_shard:05d} (full" in line]
        assert any(line.endswith("not committed yet") for line in waits)
        assert any(": quarantined (" in line and line.endswith("being extracted again") for line in waits)


def test_a_plan_with_a_gap_is_refused(source):
    plan = stream_source(source).plan
    broken = [plan[0], plan[2]]
    with pytest.raises(ValueError) as err:
        StreamSource(verify_mode="full", plan=broken)
    assert (
        f"stream.plan[1]: samples {plan[2].sample_start}..{plan[2].sample_end}, expected a non-empty range from sample "
        f"{plan[0].sample_end}; pass the shard plan of eyas.extract.plan.describe_extraction whole, in order"
    ) in str(err.value)


def test_a_reader_waits_for_extract_json_then_refuses_another_plan(source, tmp_path):
    """Before extraction records extract.json the reader waits and says so; a record of another number of shards
    is refused, naming both."""
    store, lines = open_storage(tmp_path / "store"), []
    other = [PlannedShard(sample_start=0, sample_end=24, num_tokens=100)]
    with ThreadPoolExecutor(1) as pool:
        opening = pool.submit(ShardSamples, store, stream=StreamSource(verify_mode="cheap", plan=other),
                              log=lines.append)  # fmt: skip
        end = time.monotonic() + LIMIT_S
        while not lines:
            assert time.monotonic() < end, "no word of the wait for extract.json"
            time.sleep(0.02)
        store.put_bytes(RUN_META_NAME, json.dumps(asdict(source["run_meta"])).encode())
        with pytest.raises(StreamPlanError) as err:
            opening.result()
    assert lines[0] == (
        f"waiting for {store.url}/{RUN_META_NAME} (0 s so far): extraction has not started; is it running?"
    )
    assert str(err.value) == (
        f"{store.url}/{RUN_META_NAME}: extraction plans 6 shards, the job's stream.plan 1; the job was written for "
        f"another extraction: write it again from this run's plan"
    )


def test_a_verified_shard_over_other_samples_than_planned_is_refused(source, tmp_path):
    store, fields = fresh_store(source, "local", None, tmp_path)
    stream = stream_source(source)
    moved = [p.model_copy() for p in stream.plan]
    moved[0] = moved[0].model_copy(update={"sample_end": moved[0].sample_end - 1})
    moved[1] = moved[1].model_copy(update={"sample_start": moved[0].sample_end})
    samples = ShardSamples(store, stream=StreamSource(verify_mode="full", plan=moved), log=print)
    commit(store, source, 0)
    ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                    log=print).poll()  # fmt: skip
    with pytest.raises(StreamPlanError) as err:
        samples.load_sample(0)
    assert str(err.value) == (
        f"shard {shard_filename(0)} of {store.url}: committed over samples 0..4, the job's stream.plan says 0..3; "
        f"the job was written for another extraction: write it again from this run's plan"
    )


def test_two_torchrun_ranks_wait_for_each_verified_shard_and_end_as_the_offline_run(source, tmp_path):
    """Two gloo processes under torchrun, each waiting for the shards of its share and saying so: the samples of
    every step and the final weights are the offline run's."""
    offline = tiny_job(source["run"], tmp_path / "offline", **{**TRAIN, "num_processes": 2})
    (tmp_path / "offline.json").write_text(offline.model_dump_json())
    run_trainer(tmp_path / "offline.json", 2)
    store, fields = fresh_store(source, "local", None, tmp_path)
    job = offline.model_copy(
        update={**fields, "output_dir": str(tmp_path / "streamed"), "stream": stream_source(source)}
    )
    (tmp_path / "streamed.json").write_text(job.model_dump_json())
    order = stream_order(source["plan"], job.train)
    verifier = ArrivalVerifier(store, tokenized_path=source["tokenized"], expected=source["expected"], mode="full",
                               order=order.shards, log=lambda line: None)  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "eyas.train",
           "--config", str(tmp_path / "streamed.json")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reading = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reading.start()
    taken = [0]  # lines handed to the transcript

    def take() -> str:
        new = lines[taken[0] :]
        taken[0] += len(new)
        return "".join(new)

    transcript = Transcript(take)
    try:
        produce(store, source, verifier, order, transcript, bad=None)
        assert proc.wait(timeout=LIMIT_S) == 0, transcript.read()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    reading.join(timeout=LIMIT_S)
    said = transcript.read()
    for k in order.first_step:
        assert re.search(
            rf"rank [01]: waiting for shard {k:05d} \(full verification, 0 s so far\): not committed yet", said
        ), k
    records = read_metrics(tmp_path / "streamed" / METRICS_FILE)
    assert without_timing(records) == without_timing(read_metrics(tmp_path / "offline" / METRICS_FILE))
    reference, got = weights(tmp_path / "offline"), weights(tmp_path / "streamed")
    assert reference.keys() == got.keys() and [k for k in reference if not torch.equal(reference[k], got[k])] == []
