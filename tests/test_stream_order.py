"""The order a trainer first needs its shards (eyas.train.stream_order), held against what real trainer runs read
(one process, and torchrun with 2 gloo ranks), and the extraction coordinator committing shards in that order.

Cost, one core of this (shared) machine, the order's own first, then the held-out split and the epoch's order
that the trainer computes as well: 37,000 samples in 5,482 shards, windows of 8, 1% held out: 0.03 + 0.05 s;
600,000 samples in 87,607 shards, windows of 8, 1% held out: 0.6 to 1.0 + 1.1 to 1.7 s.
"""

from __future__ import annotations

import random

import pytest
from run_fixtures import extract, run_trainer, tiny_job, write_tiny_run, write_tokenized

from eyas.config import ExtractConfig, TrainConfig
from eyas.extract.plan import assign_shards, check_shard_order, describe_extraction
from eyas.facts import facts_for
from eyas.shards.format import ShardPlan, plan_shards
from eyas.shards.manifest import done_shard_indices, read_manifest
from eyas.shards.reader import ShardSamples
from eyas.train.data import TrainSplit, held_out_ids
from eyas.train.setup import sample_windows
from eyas.train.stream_order import plan_windows, stream_order

NUM_SAMPLES, PER_SHARD = 40, 2  # 20 shards: some hold only held-out samples, some are first read in epoch 2
TRAIN = dict(global_batch_size=8, eval_fraction=0.25, num_epochs=2, save_every_steps=2, prefetch_steps=0)
CFG = ExtractConfig(shard_bytes=1 << 16, batch_size=8)  # ~63 tokens of H=64 float32 per shard
ORDERED = TrainConfig(global_batch_size=4, shuffle_window_shards=2, eval_fraction=0.2)


def manifest_plan(shards_dir) -> list[ShardPlan]:
    """The plan a finished shard set was extracted by, from its manifest rows."""
    return [ShardPlan(r.shard_index, r.sample_start, r.sample_end, r.num_tokens) for r in read_manifest(shards_dir)]


def first_reads(metrics: list[dict], plan: list[ShardPlan], eval_fraction: float) -> tuple[list[int], dict]:
    """The shards a run read, in the order of its records: each step's global batch (sample_ids, in order), then
    at its first evaluation the held-out samples; the shards it never read last, ascending; and their steps."""
    shard_of = {i: p.index for p in plan for i in range(p.sample_start, p.sample_end)}
    held_out = held_out_ids(plan[-1].sample_end, eval_fraction)
    order, step_of, evaluated = [], {}, False
    for record in metrics:
        reads = record["sample_ids"] + (held_out if "eval" in record and not evaluated else [])
        evaluated = evaluated or "eval" in record
        for shard in (shard_of[i] for i in reads):
            if shard not in step_of:
                order.append(shard)
                step_of[shard] = record["step"]
    return order + [p.index for p in plan if p.index not in step_of], step_of


def tokenized_table(path):
    rng = random.Random(1)
    return write_tokenized(path, [[rng.randrange(1, 2048) for _ in range(rng.randint(4, 16))] for _ in range(40)])


@pytest.fixture(scope="module")
def extracted_in_order(tmp_path_factory, random_target_dir):
    """A real extraction (hf backend, one worker) in the order of ORDERED over its plan: (shards, plan, the rows
    found new in storage at each report, one report after each recorded row)."""
    root = tmp_path_factory.mktemp("extracted-in-order")
    tokenized, shards = tokenized_table(root / "tokenized.parquet"), root / "shards"
    _, plan = describe_extraction(CFG, facts_for(target_path=random_target_dir, tokenized_path=tokenized,
                                                 shards_dir=shards))  # fmt: skip
    committed: list[list[int]] = []

    def seen(_snapshot: dict) -> None:
        new = done_shard_indices(shards) - {shard for found in committed for shard in found}
        if new:
            committed.append(sorted(new))

    summary = extract(tokenized, shards, random_target_dir, CFG, shard_order=stream_order(plan, ORDERED).shards,
                      progress=seen)  # fmt: skip
    assert summary.shards_written == len(plan) > 4
    return shards, plan, committed


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return write_tiny_run(tmp_path_factory.mktemp("stream-order"), num_samples=NUM_SAMPLES, per_shard=PER_SHARD)


def trained(tiny_run, out, nproc, **train) -> list[dict]:
    job = tiny_job(tiny_run, out, **{**TRAIN, **train})
    (out / "job.json").parent.mkdir(parents=True)
    (out / "job.json").write_text(job.model_dump_json())
    return run_trainer(out / "job.json", nproc)[1]


def test_uniform_order_is_the_order_one_process_first_reads_its_shards(tiny_run, tmp_path):
    plan = manifest_plan(tiny_run["shards"])
    metrics = trained(tiny_run, tmp_path / "run", None)
    order = stream_order(plan, TrainConfig(**TRAIN))
    read, steps = first_reads(metrics, plan, TRAIN["eval_fraction"])
    assert list(order.shards) == read and order.first_step == steps
    assert sorted(order.shards) == list(range(len(plan)))
    held_out = set(held_out_ids(NUM_SAMPLES, TRAIN["eval_fraction"]))
    held_out_only = [p.index for p in plan if set(range(p.sample_start, p.sample_end)) <= held_out]
    assert held_out_only and {order.first_step[s] for s in held_out_only} == {2}  # the first evaluation's step
    assert max(order.first_step.values()) > 3  # a shard first read in the second epoch (3 steps each)


def test_windowed_order_is_what_one_and_two_ranks_first_read(tiny_run, tmp_path):
    plan = manifest_plan(tiny_run["shards"])
    one = trained(tiny_run, tmp_path / "one", None, shuffle_window_shards=3)
    two = trained(tiny_run, tmp_path / "two", 2, shuffle_window_shards=3)
    assert [m["sample_ids"] for m in two] == [m["sample_ids"] for m in one]
    order = stream_order(plan, TrainConfig(**TRAIN, shuffle_window_shards=3))
    for metrics in (one, two):
        assert (list(order.shards), order.first_step) == first_reads(metrics, plan, TRAIN["eval_fraction"])
    uniform = stream_order(plan, TrainConfig(**TRAIN))
    assert order.shards != uniform.shards  # the windows change the order


def test_windows_from_the_plan_equal_the_trainers_from_the_manifest(extracted_in_order):
    shards, plan, _ = extracted_in_order
    samples = ShardSamples(shards)
    for size, fraction in ((3, 0.25), (2, 0.0), (0, 0.1)):
        job = tiny_job({"target": "t", "shards": "s", "vocab": "v"}, shards.parent / "out", shuffle_window_shards=size,
                       eval_fraction=fraction, global_batch_size=4)  # fmt: skip
        from_manifest = TrainSplit.of(len(samples), fraction).windows(sample_windows(samples, job))
        assert plan_windows(plan, job.train) == from_manifest
        assert stream_order(plan, job.train) == stream_order(manifest_plan(shards), job.train)


def test_shards_no_step_reads_come_last_in_index_order():
    lengths = [random.Random(2).randint(1, 9) for _ in range(200)]
    plan = plan_shards(lengths, 1, 20)
    order = stream_order(plan, TrainConfig(global_batch_size=8, max_steps=3, seed=5), num_samples=150)
    read = list(order.shards[: len(order.first_step)])
    assert set(order.first_step.values()) == {1, 2, 3} and [order.first_step[s] for s in read] == sorted(
        order.first_step[s] for s in read
    )
    rest = list(order.shards[len(order.first_step) :])
    assert rest == sorted(rest) and set(rest) >= {p.index for p in plan if p.sample_start >= 150}
    assert order.needed_by(2) == [s for s in read if order.first_step[s] <= 2] and order.needed_by(0) == []


def test_a_plan_that_is_not_whole_is_refused():
    plan = [ShardPlan(0, 0, 4, 40), ShardPlan(1, 5, 9, 40)]
    with pytest.raises(ValueError, match=r"entry 1 is shard 1 over samples 5\.\.9, expected shard 1 starting at "
                       r"sample 4; pass the plan of eyas.extract.plan.describe_extraction whole"):  # fmt: skip
        stream_order(plan, TrainConfig(global_batch_size=2))
    with pytest.raises(ValueError, match=r"1 shards hold 4 samples, the run trains over 6; lower max_samples"):
        stream_order(plan[:1], TrainConfig(global_batch_size=2), num_samples=6)


def test_workers_are_dealt_the_order_round_robin():
    order = [7, 2, 9, 0, 5, 1, 8, 3, 6, 4]
    todo = [0, 1, 2, 3, 4, 6, 7, 8, 9]  # shard 5 is done
    assert assign_shards(todo, 3, order=order) == [[7, 0, 3], [2, 1, 6], [9, 8, 4]]
    assert assign_shards(todo, 3) == [[0, 3, 7], [1, 4, 8], [2, 6, 9]]  # no order: the plan's
    with pytest.raises(ValueError, match=r"1 shards to extract are not in it \(\[00004\]\)"):
        assign_shards(todo, 2, order=order[:-1])
    with pytest.raises(ValueError, match=r"11 entries, expected each of the plan's 10 shards \(0\.\.9\) once; "
                       r"missing \[00004\]; listed twice \[00007\]; not in the plan \[00010\]; compute the order"):  # fmt: skip
        check_shard_order(order[:-1] + [7, 10], 10)


def test_one_worker_commits_the_manifest_rows_in_the_trainers_order(extracted_in_order):
    shards, plan, committed = extracted_in_order
    order = stream_order(plan, ORDERED)
    assert committed == [[shard] for shard in order.shards] and order.shards != tuple(range(len(plan)))


def test_an_order_that_misses_a_shard_is_refused_before_anything_is_written(tmp_path, random_target_dir):
    tokenized = tokenized_table(tmp_path / "tokenized.parquet")
    facts = facts_for(target_path=random_target_dir, tokenized_path=tokenized, shards_dir=tmp_path / "shards")
    n = len(describe_extraction(CFG, facts)[1])
    with pytest.raises(ValueError, match=rf"{n - 1} entries, expected each of the plan's {n} shards \(0\.\.{n - 1}\) "
                       rf"once; missing \[{n - 1:05d}\]; compute the order over this plan"):  # fmt: skip
        extract(tokenized, tmp_path / "shards", random_target_dir, CFG, shard_order=list(range(n - 1)))
    assert not (tmp_path / "shards" / "manifest.parquet").exists()
