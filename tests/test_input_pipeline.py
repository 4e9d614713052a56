"""eyas.train.input_pipeline: the trainer's input built ahead in a thread trains to the same weights, bit for bit, as
reading each step in the loop; its batches are today's (samples decoded, then collated); a damaged shard stops the
run at the step that reads it with the reader's message; every exit stops the thread; the wait is recorded."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from run_fixtures import tiny_job, write_tiny_run
from safetensors.torch import load_file
from test_data import _damage

import eyas.train.trainer as trainer_module
from eyas.shards.encoding import ShardEncoding
from eyas.shards.reader import ShardDataError, ShardSamples
from eyas.train.data import batch_at, collate
from eyas.train.input_pipeline import HostStep, InputPipeline, read_micro_batches, to_device
from eyas.train.metrics import METRICS_FILE, read_metrics
from eyas.train.parallel import Dist
from eyas.train.trainer import Trainer

CPU = torch.device("cpu")
FLOAT8 = ShardEncoding(aux_dtype="float8_e4m3", dtype="bfloat16")
TIMING = {"elapsed_s", "tokens_per_s", "data_wait_s", "data_stall_fraction"}


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def float8_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("float8-run"), num_samples=30, per_shard=8, encoding=FLOAT8)


def pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "eyas-input-pipeline"]


def train_in_process(run: dict, out, **train) -> Trainer:
    defaults = dict(num_processes=1, num_epochs=2, eval_fraction=0.2, save_every_steps=3)
    trainer = Trainer(tiny_job(run, out, **{**defaults, **train}), Dist(rank=0, world=1, device=CPU))
    trainer.run()
    return trainer


def checkpoint_tensors(out) -> dict[str, torch.Tensor]:
    final = sorted((out / "checkpoints").glob("step-*"))[-1]
    return {f"{f.name}:{k}": v for f in sorted(final.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_prefetching_trains_to_the_weights_of_reading_in_the_loop_bit_for_bit(float8_run, tmp_path, one_process_group):
    """float8 aux decoded after collation, steps built two ahead in a thread, held-out evaluations in between."""
    train_in_process(float8_run, tmp_path / "in-loop", prefetch_steps=0)
    train_in_process(float8_run, tmp_path / "ahead", prefetch_steps=2)
    reference, prefetched = checkpoint_tensors(tmp_path / "in-loop"), checkpoint_tensors(tmp_path / "ahead")
    assert reference.keys() == prefetched.keys() and any(k.startswith("model.safetensors:") for k in reference)
    assert [k for k in reference if not torch.equal(reference[k], prefetched[k])] == []
    records = [read_metrics(tmp_path / name / METRICS_FILE) for name in ("in-loop", "ahead")]
    assert len(records[0]) == 6 and any("eval" in r for r in records[0])
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in records[1]] == [
        {k: v for k, v in r.items() if k not in TIMING} for r in records[0]
    ]
    for record in records[0] + records[1]:
        assert record["data_wait_s"] >= 0 and 0 <= record["data_stall_fraction"] <= 1


@pytest.mark.parametrize("encoding", [FLOAT8, ShardEncoding(aux_dtype="bfloat16", dtype="bfloat16")])
def test_batches_are_the_decoded_samples_collated(tmp_path, encoding):
    """What the loop trained on before: each sample decoded to float32 as read, then padded; now read as stored
    straight into the batch's rows and decoded where the batch lies. Every element the same, samples cut to max_len
    (12) or padded to min_len (14) alike."""
    run = write_tiny_run(tmp_path / "run", num_samples=6, per_shard=4, encoding=encoding)
    samples = ShardSamples(run["shards"])
    for ids, max_len, min_len in (([5, 0, 3], 64, 20), ([1, 4], 12, 0), ([2], 64, 14)):
        before = collate([samples.load_sample(i) for i in ids], max_len, min_len=min_len)
        (stored,) = read_micro_batches(samples, ids, max_len=max_len, min_len=min_len, micro_batch_tokens=0,
                                       pin_memory=False)  # fmt: skip
        assert ("aux_scales" in stored) == (encoding == FLOAT8)
        now = to_device(stored, CPU, samples.meta.encoding, num_aux=samples.meta.num_aux)
        assert now.keys() == before.keys()
        assert [k for k in before if before[k].dtype != now[k].dtype or not torch.equal(before[k], now[k])] == []


def fake_steps(built: list[int], fail_at: int | None = None, seconds: float = 0.0):
    def build(position: int) -> HostStep:
        time.sleep(seconds)
        if position == fail_at:
            raise ShardDataError(f"shard shard-00009.safetensors: the step after {position} cannot be read")
        built.append(position)
        return HostStep(position, 0, [position], [{"input_ids": torch.tensor([[position]])}])

    return build


@pytest.mark.parametrize("depth", [1, 2])
def test_the_thread_walks_the_loops_positions_from_the_resumed_one_at_most_depth_plus_one_ahead(depth):
    built: list[int] = []
    pipeline = InputPipeline(fake_steps(built), range(16, 64, 8), depth=depth, device=CPU, encoding=FLOAT8, num_aux=3)
    try:
        for taken, position in enumerate(range(16, 64, 8), 1):
            step = pipeline.next(position)
            assert step.ids == [position] and step.micro_batches[0]["input_ids"].item() == position
            time.sleep(0.05)  # the thread fills its queue
            assert len(built) <= taken + depth + 1
        assert built == list(range(16, 64, 8))
        with pytest.raises(RuntimeError, match="past the last position"):
            pipeline.next(64)
    finally:
        pipeline.close()
    assert pipeline_threads() == []


def test_a_build_error_is_raised_at_its_step_with_its_message_after_the_steps_before_it():
    built: list[int] = []
    pipeline = InputPipeline(fake_steps(built, fail_at=16), range(0, 40, 8), depth=2, device=CPU, encoding=FLOAT8,
                             num_aux=3)  # fmt: skip
    try:
        assert [pipeline.next(p).ids for p in (0, 8)] == [[0], [8]]
        with pytest.raises(ShardDataError, match=r"^shard shard-00009.safetensors: the step after 16 cannot be read$"):
            pipeline.next(16)
    finally:
        pipeline.close()
    assert built == [0, 8] and pipeline_threads() == []


def test_stop_ends_a_thread_blocked_on_a_full_queue():
    pipeline = InputPipeline(fake_steps([]), range(0, 800, 8), depth=1, device=CPU, encoding=FLOAT8, num_aux=3)
    pipeline.next(0)
    time.sleep(0.1)  # one step queued, one built and waiting for room
    pipeline.close()
    assert pipeline_threads() == []


def test_the_wait_for_a_slow_build_is_measured():
    pipeline = InputPipeline(fake_steps([], seconds=0.2), [0], depth=0, device=CPU, encoding=FLOAT8, num_aux=3)
    assert pipeline.next(0).wait_s >= 0.2


def test_a_damaged_shard_stops_the_run_at_the_step_that_reads_it(tmp_path, one_process_group):
    """Built ahead, the failing read is raised when the loop reaches its step: the steps before train and are
    recorded, that one does not, and the thread is gone."""
    run = write_tiny_run(tmp_path / "run", num_samples=30, per_shard=3)
    _damage(run["shards"] / "shard-00007.safetensors")  # samples 21-23: first read by the third step
    steps = [batch_at(8 * s, 30, 8, 0)[1] for s in range(3)]
    first_bad = next(s for s, ids in enumerate(steps) if any(21 <= i < 24 for i in ids))
    assert first_bad == 2
    with pytest.raises(ShardDataError, match=r"^shard shard-00007.safetensors: checksum xxh3-128:[0-9a-f]+\.\.\., the"):
        train_in_process(run, tmp_path / "out", prefetch_steps=2, verify_reads=True, num_epochs=1, eval_fraction=0)
    assert [r["step"] for r in read_metrics(tmp_path / "out" / METRICS_FILE)] == list(range(1, first_bad + 1))
    assert pipeline_threads() == []


def test_an_interrupted_run_stops_the_thread(float8_run, tmp_path, one_process_group, monkeypatch):
    calls = []
    real_step = trainer_module.train_step

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_in_process(float8_run, tmp_path / "out", prefetch_steps=2)
    assert pipeline_threads() == []
