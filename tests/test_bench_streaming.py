"""bench/streaming.py: its quick mode runs a real producer and a real trainer process each pinned to one core, both
extract-then-train and streamed, and reports its figures only for runs that end with equal weights; a streamed run
that trained on other samples, or to other weights, is refused with what differs. Timings are never asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from run_fixtures import REPO, tiny_job, write_tiny_run
from safetensors.torch import load_file, save_file

from eyas.train.checkpoint import latest_complete
from eyas.train.parallel import Dist
from eyas.train.trainer import Trainer

sys.path.insert(0, str(REPO / "bench"))
import streaming  # noqa: E402

FIGURES = ("first_step_s", "streamed_vs_sequential", "peak_disk_bytes", "disk_bound_bytes", "wait_fraction")
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


@pytest.mark.skipif(not TWO_CORES, reason="the bench pins its producer and its trainer to a core each")
def test_quick_run_reports_its_figures_for_runs_that_end_with_equal_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "streaming.py"), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [key for key in FIGURES if key not in figures] == []
    assert figures["weights_equal"] is True and figures["num_tensors_equal"] > 0
    # the cache never holds more than its bound; the sampler saw it hold a shard
    assert 0 < figures["peak_disk_bytes"] <= figures["disk_bound_bytes"]
    assert figures["num_steps"] > 0 and figures["num_shards"] > 1
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torch")] == []


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer's output dir after two steps of a tiny synthetic run on one in-process rank."""
    root = tmp_path_factory.mktemp("trained")
    job = tiny_job(write_tiny_run(root, num_samples=16, per_shard=8), root / "out", num_processes=1, max_steps=2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        Trainer(job, Dist(rank=0, world=1, device=torch.device("cpu"))).run()
    finally:
        dist.destroy_process_group()
    return root / "out"


def test_equal_checkpoints_are_counted_tensor_by_tensor(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "copy")
    final = latest_complete(trained)
    count = sum(len(load_file(f)) for f in final.glob("*.safetensors"))
    assert streaming.equal_tensors(trained, tmp_path / "copy") == count > 0


def test_a_tensor_off_by_one_bit_is_refused_by_name(trained, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(trained, other)
    model = next(f for f in sorted(latest_complete(other).glob("*.safetensors")) if "fc.weight" in load_file(f))
    tensors = load_file(model)
    tensors["fc.weight"].view(-1).view(torch.int32)[0] ^= 1
    save_file(tensors, model)
    with pytest.raises(streaming.WeightsDiffer) as err:
        streaming.equal_tensors(trained, other)
    assert str(err.value).startswith(
        f"final weights of {other} differ from {trained}: 1 tensors differ (['{model.name}:fc.weight']), 0 are in "
        f"one checkpoint only ([]), "
    )
    assert "expected every tensor equal (torch.equal)" in str(err.value) and "no figure is reported" in str(err.value)


def test_other_samples_at_a_step_are_refused_before_the_weights_are_compared(tmp_path):
    sequential = {"sample_ids": [[0, 1], [2, 3], [4, 5]]}
    streamed = {"sample_ids": [[0, 1], [3, 2], [4, 5]]}
    with pytest.raises(streaming.WeightsDiffer) as err:
        streaming.check_same_training(tmp_path / "a", tmp_path / "b", sequential, streamed)
    assert str(err.value) == (
        f"{tmp_path / 'b'}: the streamed trainer read other samples than the sequential one (3 and 3 steps; "
        f"differing at steps [2]); expected the same order over the same plan: check train.seed and the stream's plan"
    )


def test_a_side_that_fails_ends_the_other_and_is_named_with_its_log(tmp_path):
    core = min(os.sched_getaffinity(0))
    failing = streaming.Child("the producer", [sys.executable, "-c", "print('no target'); raise SystemExit(3)"],
                              core, tmp_path / "producer.log")  # fmt: skip
    waiting = streaming.Child("the trainer", [sys.executable, "-c", "import time; time.sleep(600)"], core,
                              tmp_path / "train.log", follow=True)  # fmt: skip
    with pytest.raises(RuntimeError) as err:
        streaming.wait_all(failing, waiting)
    assert str(err.value) == f"the producer: exited 3; its log {tmp_path / 'producer.log'} ends:\nno target\n"
    assert waiting.proc.returncode == -9  # ended by the bench, not left waiting for a producer that is gone
