"""eyas.data: the sample index over shards, the (seed, epoch) order, rank slices, collate.

`write_tiny_run` and `tiny_job` (also used by test_train.py, test_train_crash.py and test_smoke.py)
give a tiny synthetic run (eyas.synthetic) and a TrainJob over it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from run_fixtures import AUX_LAYER_IDS, SPEC, write_tiny_run

from eyas.shards.reader import ShardDataError, ShardSamples
from eyas.train.data import batch_at, collate, global_order, rank_slice

HIDDEN, NUM_AUX, VOCAB, DRAFT_VOCAB = SPEC.hidden, SPEC.num_aux, SPEC.vocab, SPEC.draft_vocab


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("tiny-run"), num_samples=25, per_shard=10)


def test_load_sample_returns_the_written_sample_from_its_shard(tiny_run):
    samples = ShardSamples(tiny_run["shards"])
    assert len(samples) == 25
    for index in (0, 9, 10, 24):
        got = samples.load_sample(index)
        want = tiny_run["samples"][index]
        assert got["sample_index"] == index
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert torch.equal(got["aux_hidden"], want["aux_hidden_states"])
        assert torch.equal(got["last_hidden"], want["last_hidden_states"])
    assert list(samples.meta.aux_layer_ids) == AUX_LAYER_IDS and samples.meta.hidden_size == HIDDEN


def test_max_samples_keeps_the_first_samples(tiny_run):
    samples = ShardSamples(tiny_run["shards"], max_samples=12)
    assert len(samples) == 12
    with pytest.raises(IndexError, match="sample 12: expected 0 <= index < 12"):
        samples.load_sample(12)


def test_manifest_gap_is_refused(tmp_path, tiny_run):
    shards = tmp_path / "shards"
    shards.mkdir()
    table = pq.read_table(tiny_run["shards"] / "manifest.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([table[0], table[2]]), shards / "manifest.parquet")
    with pytest.raises(ShardDataError, match=r"manifest.parquet: samples 10..19 are in no shard of the manifest"):
        ShardSamples(shards)


def test_global_order_depends_only_on_seed_and_epoch():
    order = global_order(100, seed=3, epoch=1)
    assert sorted(order) == list(range(100))
    assert global_order(100, seed=3, epoch=1) == order
    assert global_order(100, seed=3, epoch=2) != order
    assert global_order(100, seed=4, epoch=1) != order


def test_batch_at_walks_epochs_by_samples_consumed():
    # 10 samples, batches of 4: 2 steps per epoch, the 2-sample tail of each shuffled epoch is skipped.
    assert batch_at(0, 10, 4, seed=0) == (0, global_order(10, 0, 0)[0:4])
    assert batch_at(4, 10, 4, seed=0) == (0, global_order(10, 0, 0)[4:8])
    assert batch_at(8, 10, 4, seed=0) == (1, global_order(10, 0, 1)[0:4])


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_rank_slices_partition_the_global_batch(world):
    ids = global_order(50, seed=0, epoch=0)[:8]
    slices = [rank_slice(ids, rank, world) for rank in range(world)]
    assert [i for s in slices for i in s] == ids
    assert max(map(len, slices)) - min(map(len, slices)) <= 1


def test_rank_slice_refuses_more_ranks_than_samples():
    with pytest.raises(ValueError, match="a global batch of 2 samples cannot give each of 4 ranks a sample"):
        rank_slice([5, 6], 0, 4)


def test_collate_right_pads_and_marks_valid_tokens(tiny_run):
    samples = ShardSamples(tiny_run["shards"])
    picked = [samples.load_sample(i) for i in (0, 1, 2)]
    lengths = [int(s["input_ids"].numel()) for s in picked]
    batch = collate(picked, max_len=64)
    width = max(lengths)
    assert batch["input_ids"].shape == (3, width) and batch["input_ids"].dtype == torch.int64
    assert batch["loss_mask"].shape == (3, width) and batch["loss_mask"].dtype == torch.uint8
    assert batch["aux_hidden"].shape == (3, width, NUM_AUX * HIDDEN)
    assert batch["last_hidden"].shape == (3, width, HIDDEN)
    assert batch["valid"].dtype == torch.bool
    for row, n in enumerate(lengths):
        assert batch["valid"][row].tolist() == [True] * n + [False] * (width - n)
        assert torch.equal(batch["input_ids"][row, :n], picked[row]["input_ids"])
        assert not batch["loss_mask"][row, n:].any() and not batch["aux_hidden"][row, n:].any()


def test_collate_cuts_samples_to_max_len(tiny_run):
    samples = ShardSamples(tiny_run["shards"])
    batch = collate([samples.load_sample(0), samples.load_sample(1)], max_len=5)
    assert batch["input_ids"].shape == (2, 5) and bool(batch["valid"].all())


def test_collate_pads_to_min_len_with_invalid_masked_columns(tiny_run):
    sample = ShardSamples(tiny_run["shards"]).load_sample(0)
    batch = collate([sample], max_len=4, min_len=8)
    assert batch["input_ids"].shape == (1, 8)
    assert batch["valid"][0].tolist() == [True] * 4 + [False] * 4
    assert not batch["loss_mask"][0, 4:].any()


def _damage(path, *, truncate: bool = False) -> None:
    data = bytearray(path.read_bytes())
    if truncate:
        path.write_bytes(bytes(data[:-16]))
    else:
        data[-5] ^= 0xFF  # a byte of tensor data: the header still parses
        path.write_bytes(bytes(data))


def test_a_shard_damaged_after_verification_is_refused_by_name(tmp_path):
    run = write_tiny_run(tmp_path / "run", num_samples=25, per_shard=10)
    shards = run["shards"]
    _damage(shards / "shard-00001.safetensors")
    samples = ShardSamples(shards, verify_reads=True)  # shard 0 is fine
    samples.load_sample(3)
    with pytest.raises(
        ShardDataError, match=r"shard shard-00001.safetensors: checksum xxh3-128:[0-9a-f]+\.\.\., the manifest"
    ):
        samples.load_sample(12)
    assert ShardSamples(shards).load_sample(12)["sample_index"] == 12  # unchecked: the flip goes unnoticed
    _damage(shards / "shard-00002.safetensors", truncate=True)
    with pytest.raises(ShardDataError, match=r"shard-00002.safetensors: \d+ bytes, the manifest says \d+"):
        ShardSamples(shards).load_sample(22)  # the size is checked always


def test_the_trainer_stops_before_training_on_a_damaged_shard(tmp_path):
    import os
    import subprocess
    import sys

    from run_fixtures import REPO, tiny_job

    from eyas.train.launch import write_train_job

    run = write_tiny_run(tmp_path / "run", num_samples=25, per_shard=10)
    _damage(run["shards"] / "shard-00000.safetensors")
    job = write_train_job(tiny_job(run, tmp_path / "out"), tmp_path / "job.json")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "eyas.train", "--config", str(job)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "shard shard-00000.safetensors: checksum" in done.stdout + done.stderr
    assert not list((tmp_path / "out").glob("step-*"))  # no step was trained


def test_a_finished_training_is_not_relaunched_for_the_same_job(tmp_path):
    import json

    from draft_fixtures import write_checkpoint
    from run_fixtures import tiny_job

    from eyas.train.checkpoint import CHECKPOINTS_DIR, FINAL_FILE
    from eyas.train.launch import JOB_FILE, finished_run, write_train_job

    run = write_tiny_run(tmp_path / "run", num_samples=25, per_shard=10)
    train_dir = tmp_path / "train"
    job = tiny_job(run, train_dir)
    write_train_job(job, train_dir / JOB_FILE)
    last = write_checkpoint(train_dir / CHECKPOINTS_DIR / "step-00000012")
    (train_dir / FINAL_FILE).write_text(json.dumps({"checkpoint": str(last), "step": 12, "final_loss": 1.0}))
    assert finished_run(train_dir, job, 12)["step"] == 12
    assert finished_run(train_dir, job, 13) is None  # more steps planned: resume
    other = job.model_copy(update={"train": job.train.model_copy(update={"lr": 0.5})})
    assert finished_run(train_dir, other, 12) is None  # another job: train it
    write_checkpoint(train_dir / CHECKPOINTS_DIR / "step-00000014")
    assert finished_run(train_dir, job, 12) is None  # final.json is not the newest checkpoint's
