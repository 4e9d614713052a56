"""SIGKILL of either side of a streamed run, and of both: a producer (run_streamed_extraction over the S3 server) and
a trainer (torchrun, gloo ranks, reading the store through its cache as each shard is verified) as two processes
of their own (tests/stream_sides.py). The kill points come from a seeded generator (SEED, printed; the
environment's EYAS_KILL_SEED picks others); each case ends with the uninterrupted streamed run's metric records
(one per step, the same sample ids) and final weights bit for bit, the same manifest, and one verdict per
committed shard. The kill table is printed at the end."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_fixtures import REPO, write_tokenized
from safetensors.torch import load_file

from eyas.config import DraftConfig, PlannedShard, StreamSource, load_run_config
from eyas.dataset.vocab import build_vocab
from eyas.extract.plan import describe_extraction
from eyas.facts import facts_for
from eyas.shards.manifest import done_shard_indices, read_manifest
from eyas.shards.verdicts import read_verdicts, verdict_name
from eyas.storage import open_storage
from eyas.train.checkpoint import latest_complete
from eyas.train.launch import train_job
from eyas.train.metrics import METRIC_PREFIX, METRICS_FILE, read_metrics
from eyas.train.stream_order import stream_order

SEED = int(os.environ.get("EYAS_KILL_SEED", "38"))  # the kill points' generator; set it to try other points
NPROC = 2  # gloo ranks of the trainer
NUM_SAMPLES = 60
LIMIT_S = 120.0  # a bound against hanging, not a measure of speed
TIMING = {"elapsed_s", "tokens_per_s", "data_wait_s", "data_stall_fraction"}
SIDES = str(REPO / "tests" / "stream_sides.py")
WAITING = re.compile(r"rank \d: waiting for shard (\d{5}) \(full verification, (\d+) s so far\): (.*)")


@pytest.fixture(scope="module")
def run(tmp_path_factory, random_target_dir, s3_endpoint):
    """The run both sides share: the tiny random target's config (small shards, a small draft, a checkpoint every
    2 steps, the shards read through a cache of 4 shards), its tokenized table and vocab, and its shard plan."""
    root = tmp_path_factory.mktemp("stream-kills")
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    train = base.train.model_copy(update=dict(
        num_processes=NPROC, global_batch_size=4, shuffle_window_shards=2, num_epochs=2, lr=1e-2, num_warmup_steps=1,
        num_ttt_steps=2, save_every_steps=2, num_checkpoints_kept=2, cache_bytes=4 << 16, prefetch_steps=1))  # fmt: skip
    config = base.model_copy(update={
        "workdir": str(root),
        "target": base.target.model_copy(update={"model_path": str(random_target_dir)}),
        "dataset": base.dataset.model_copy(update={"draft_vocab_size": 256}),
        "extract": base.extract.model_copy(update={"shard_bytes": 1 << 16, "batch_size": 8, "num_workers": 1}),
        "draft": DraftConfig(num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                             max_position_embeddings=64),
        "train": train,
    })  # fmt: skip
    rng = random.Random(5)
    samples = [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 16))] for _ in range(NUM_SAMPLES)]
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, samples)
    build_vocab(config)
    _, plan = describe_extraction(config.extract, facts_of(config, "s3://plan/shards", s3_endpoint))
    order = stream_order(plan, config.train, num_samples=NUM_SAMPLES)
    return {"config": config, "plan": plan, "order": order, "root": root, "endpoint": s3_endpoint}


def facts_of(config, url: str, endpoint: str):
    return facts_for(target_path=config.target.model_path, tokenized_path=config.paths.tokenized, storage_url=url,
                     s3_endpoint_url=endpoint)  # fmt: skip


class Side:
    """One start of a side (a process group of its own, its output in a file)."""

    def __init__(self, cmd: list[str], log: Path, job: Path):
        self.log, self.job = log, job
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip

    def text(self) -> str:
        return self.log.read_text()

    def kill(self) -> None:
        kill_together(self)

    def finish(self) -> str:
        code = self.proc.wait(timeout=LIMIT_S)
        assert code == 0, f"{self.log}: exit {code}\n{self.text()[-4000:]}"
        return self.text()


def kill_together(*sides: Side) -> None:
    """SIGKILL each side's whole process group, one right after the other; return once no process of these starts
    (torchrun's workers, which sit in sessions of their own and die with their launcher) is left."""
    for side in sides:
        os.killpg(side.proc.pid, signal.SIGKILL)
    for side in sides:
        assert side.proc.wait(timeout=LIMIT_S) == -signal.SIGKILL, f"{side.log} ended before the kill"
        wait_until(lambda: not processes_naming(side.job), f"the processes of {side.job} to end")  # noqa: B023


def processes_naming(path: Path) -> list[int]:
    """PIDs of live processes whose command line names `path`."""
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc_dir / "cmdline").read_bytes()
        except OSError:  # the process ended while we looked
            continue
        if str(path).encode() in cmdline:
            pids.append(int(proc_dir.name))
    return pids


def wait_until(condition, what: str) -> None:
    end = time.monotonic() + LIMIT_S
    while not condition():
        assert time.monotonic() < end, f"{what}: not within {LIMIT_S} s"
        time.sleep(0.1)


class Case:
    """One streamed run's two sides over a prefix of the S3 server: each start of either side is a Side."""

    def __init__(self, run: dict, name: str, bucket: str):
        self.run, self.name, self.dir = run, name, run["root"] / name
        self.dir.mkdir()
        self.url = f"s3://{bucket}/{name}/shards"
        where = {"storage_url": self.url, "s3_endpoint_url": run["endpoint"]}
        config = run["config"].model_copy(update={"extract": run["config"].extract.model_copy(update=where)})
        self.config = type(config).model_validate(config.model_dump())  # checked as a producer will load it
        self.store = open_storage(self.url, endpoint_url=run["endpoint"])
        facts = facts_of(config, self.url, run["endpoint"])
        job = train_job(config, facts, output_dir=self.dir / "train")
        plan = [PlannedShard(sample_start=p.sample_start, sample_end=p.sample_end, num_tokens=p.num_tokens)
                for p in run["plan"]]  # fmt: skip
        self.job = self.dir / "job.json"
        self.job.write_text(job.model_copy(update={"stream": StreamSource(verify_mode="full", plan=plan)})
                            .model_dump_json())  # fmt: skip
        self.gate = self.dir / "go"
        self.starts = {"producer": 0, "trainer": 0}
        self.sides: list[Side] = []

    def producer(self, *, hold_after: int | None = None) -> Side:
        side = {"config": json.loads(self.config.model_dump_json()), "target": self.config.target.model_path,
                "tokenized": str(self.config.paths.tokenized), "storage_url": self.url,
                "endpoint": self.run["endpoint"],
                "hold": None if hold_after is None else {"after": hold_after, "until": str(self.gate)}}  # fmt: skip
        path = self.dir / "producer.json"
        path.write_text(json.dumps(side))
        return self._start([sys.executable, SIDES, "producer", str(path)], "producer", path)

    def trainer(self) -> Side:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}", SIDES,
               "trainer", str(self.job)]  # fmt: skip
        return self._start(cmd, "trainer", self.job)

    def _start(self, cmd: list[str], side: str, job: Path) -> Side:
        self.starts[side] += 1
        self.sides.append(Side(cmd, self.dir / f"{side}-{self.starts[side]}.log", job))
        return self.sides[-1]

    def close(self) -> None:
        """Kill what still runs (a test that failed half way leaves a held producer or a waiting trainer)."""
        live = [side for side in self.sides if side.proc.poll() is None]
        if live:
            kill_together(*live)

    def verified(self) -> set[int]:
        return {int(n.split("shard-")[1][:5]) for n in read_verdicts(self.store)}

    def release(self) -> None:
        self.gate.write_text("go")


def metric_records(side: Side) -> int:
    return sum(line.startswith(METRIC_PREFIX) for line in side.text().splitlines())


def resumed_from(newest: Path | None, said: str) -> str:
    """The restarted trainer resumed from `newest` (the newest complete checkpoint at the kill), or started
    afresh when there was none; -> the table's words."""
    if newest is None:
        assert "resumed from" not in said
        return "step 1 (no complete checkpoint yet)"
    assert f"resumed from {newest} " in said
    return newest.name


def steps_before_hold(order, hold: int) -> int:
    """The steps a trainer can take while only the first `hold` shards of the order are there."""
    return min(order.first_step.get(k, 10**9) for k in order.shards[hold:]) - 1


@pytest.fixture
def new_case(run, s3_bucket_module):
    """Case(run, name, the module's bucket); what still runs of its sides when the test ends is killed."""
    made: list[Case] = []

    def make(name: str) -> Case:
        made.append(Case(run, name, s3_bucket_module))
        return made[-1]

    yield make
    for case in made:
        case.close()


@pytest.fixture(scope="module")
def uninterrupted(run, s3_bucket_module):
    """Both sides started together and run to the end: the streamed run every case must end as."""
    case = Case(run, "uninterrupted", s3_bucket_module)
    try:
        producer, trainer = case.producer(), case.trainer()
        producer.finish()
        trainer.finish()
    finally:
        case.close()
    return {"metrics": without_timing(read_metrics(case.dir / "train" / METRICS_FILE)),
            "weights": weights(case.dir / "train"), "manifest": read_manifest(case.store)}  # fmt: skip


@pytest.fixture(scope="module")
def s3_bucket_module(s3_endpoint):
    """A bucket of the S3 server for this module's cases (a prefix each)."""
    import uuid

    import boto3

    name = f"stream-kills-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def kill_table(request):
    """Rows of the kill table, printed when the module ends."""
    rows: list[dict] = []
    yield rows
    if not rows:
        return
    heads = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in heads]
    lines = [f"kill table (SEED={SEED}, {NPROC} trainer ranks, the shards on the S3 server)"]
    lines += [
        "  ".join(str(r[h]).ljust(w) for h, w in zip(heads, widths, strict=True))
        for r in [dict(zip(heads, heads, strict=True)), *rows]
    ]
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print("\n" + "\n".join(lines), flush=True)


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def weights(out: Path) -> dict[str, torch.Tensor]:
    final = latest_complete(out)
    return {f"{f.name}:{k}": v for f in sorted(final.glob("*.safetensors")) for k, v in load_file(f).items()}


def ends_as_uninterrupted(case: Case, uninterrupted: dict, producer_logs: list[str]) -> str:
    """The case's end is the uninterrupted run's (records, weights, manifest; one verdict per committed shard,
    each shard checked at most once over all the producer's starts); -> "yes" for the table."""
    records = without_timing(read_metrics(case.dir / "train" / METRICS_FILE))
    assert [r["step"] for r in records] == list(range(1, len(uninterrupted["metrics"]) + 1))
    assert records == uninterrupted["metrics"]  # the same sample ids, losses and learning rates at every step
    got, reference = weights(case.dir / "train"), uninterrupted["weights"]
    assert got.keys() == reference.keys() and [k for k in got if not torch.equal(got[k], reference[k])] == []
    rows = read_manifest(case.store)
    assert rows == uninterrupted["manifest"]  # every planned shard committed, with the uninterrupted run's bytes
    assert read_verdicts(case.store) == {verdict_name(r.shard_index, r.checksum, "full") for r in rows}
    checked = [int(m) for log in producer_logs for m in re.findall(r"^shard (\d{5}) verified on arrival", log, re.M)]
    assert sorted(checked) == sorted(set(checked))  # none verified twice
    return "yes"


def test_a_killed_producer_makes_the_trainer_wait_and_say_so_until_it_is_started_again(
    run, uninterrupted, new_case, kill_table
):
    """The producer falls behind after k + 1 shards and is killed after k verdicts (k random)."""
    rng, num_shards = random.Random(SEED), len(run["plan"])
    k = rng.randint(1, num_shards - 3)
    case = new_case("producer-killed")
    producer, trainer = case.producer(hold_after=k + 1), case.trainer()
    wait_until(lambda: len(case.verified()) >= k, f"{k} verdicts")
    time.sleep(rng.uniform(0, 0.05))
    producer.kill()
    first_log, at_kill, committed = producer.text(), case.verified(), done_shard_indices(case.store)
    assert len(at_kill) < num_shards and len(committed) < num_shards, "the producer finished before it was killed"
    said_before = len(trainer.text())

    def still_waiting() -> list[re.Match]:
        """What the trainer said since the kill of a wait of 1 s or more for a shard without a verdict."""
        said = WAITING.finditer(trainer.text()[said_before:])
        return [m for m in said if int(m.group(1)) not in at_kill and int(m.group(2)) >= 1]

    wait_until(lambda: still_waiting(), "the trainer saying it still waits for a shard the producer left")
    assert trainer.proc.poll() is None, f"the trainer ended while the producer was down:\n{trainer.text()[-3000:]}"
    waited, steps_then = still_waiting()[-1], metric_records(trainer)
    second_log, _ = case.producer().finish(), trainer.finish()
    summary = json.loads(second_log.splitlines()[-1])
    assert summary["shards_skipped"] == len(committed) and summary["shards_written"] == num_shards - len(committed)
    assert summary["workers"][0]["shard_indices"] == [k for k in run["order"].shards if k not in committed]
    assert {int(m) for m in re.findall(r"^shard (\d{5}) verified on arrival", second_log, re.M)} == (
        set(range(num_shards)) - at_kill
    )  # the restart verified what had no verdict, and nothing else
    kill_table.append({
        "case": "producer", "killed": f"producer after {len(at_kill)}/{num_shards} verdicts (k={k})",
        "meanwhile": f"trainer at step {steps_then}, said it waits for shard {waited.group(1)} "
                     f"({waited.group(3)}, {waited.group(2)} s so far)",
        "resumed": f"producer kept {len(committed)} committed shards, extracted {summary['shards_written']}; "
                   f"trainer never stopped",
        "identical": ends_as_uninterrupted(case, uninterrupted, [first_log, second_log]),
    })  # fmt: skip


def test_a_killed_trainer_leaves_the_producer_running_and_resumes_from_its_newest_checkpoint(
    run, uninterrupted, new_case, kill_table
):
    """The producer falls behind after h shards (h random); the trainer is killed after m metric records (m random
    among the steps those shards allow), then started again while the producer goes on."""
    rng, order, num_shards = random.Random(SEED + 1), run["order"], len(run["plan"])
    hold = rng.choice([h for h in range(num_shards) if steps_before_hold(order, h) >= 4])
    m = rng.randint(3, steps_before_hold(order, hold))  # after step 2's checkpoint
    case = new_case("trainer-killed")
    producer, trainer = case.producer(hold_after=hold), case.trainer()
    wait_until(lambda: metric_records(trainer) >= m, f"{m} metric records")
    time.sleep(rng.uniform(0, 0.05))
    trainer.kill()
    records, at_kill, newest = metric_records(trainer), case.verified(), latest_complete(case.dir / "train")
    assert producer.proc.poll() is None and len(at_kill) < num_shards  # the producer is mid-run
    case.release()
    second = case.trainer()
    producer_log, said = producer.finish(), second.finish()
    assert len(case.verified()) == num_shards > len(at_kill)  # it went on committing and verifying
    kill_table.append({
        "case": "trainer", "killed": f"trainer after {records} metric records (m={m})",
        "meanwhile": f"producer running, {len(at_kill)}/{num_shards} verified at the kill, all after",
        "resumed": f"trainer from {resumed_from(newest, said)}",
        "identical": ends_as_uninterrupted(case, uninterrupted, [producer_log]),
    })  # fmt: skip


def test_both_sides_killed_together_resume_together(run, uninterrupted, new_case, kill_table):
    """The producer falls behind after h shards (h random); both are killed at once after m metric records (m
    random among the steps those shards allow), then both started again."""
    rng, order, num_shards = random.Random(SEED + 2), run["order"], len(run["plan"])
    hold = rng.choice([h for h in range(num_shards) if steps_before_hold(order, h) >= 3])
    m = rng.randint(1, steps_before_hold(order, hold))
    case = new_case("both-killed")
    producer, trainer = case.producer(hold_after=hold), case.trainer()
    wait_until(lambda: metric_records(trainer) >= m, f"{m} metric records")
    time.sleep(rng.uniform(0, 0.05))
    kill_together(producer, trainer)
    first_log, records, newest = producer.text(), metric_records(trainer), latest_complete(case.dir / "train")
    at_kill, committed = case.verified(), done_shard_indices(case.store)
    assert len(committed) < num_shards
    producer, trainer = case.producer(), case.trainer()
    second_log, said = producer.finish(), trainer.finish()
    summary = json.loads(second_log.splitlines()[-1])
    assert summary["shards_skipped"] == len(committed) and summary["shards_written"] == num_shards - len(committed)
    assert summary["workers"][0]["shard_indices"] == [k for k in run["order"].shards if k not in committed]
    kill_table.append({
        "case": "both", "killed": f"trainer after {records} metric records (m={m}), producer after "
                                  f"{len(at_kill)}/{num_shards} verdicts",
        "meanwhile": "-",
        "resumed": f"producer kept {len(committed)} committed shards, extracted {summary['shards_written']}; "
                   f"trainer from {resumed_from(newest, said)}",
        "identical": ends_as_uninterrupted(case, uninterrupted, [first_log, second_log]),
    })  # fmt: skip
