"""Crash safety of the trainer: a 2-process run (DDP, and FSDP2) killed with SIGKILL at a random step resumes
to weights bit-identical to an uninterrupted run's, with the same BEST marker (held-out evaluation on)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_fixtures import tiny_job, write_tiny_run
from safetensors.torch import load_file

from eyas.train.checkpoint import COMPLETE_MARKER, latest_complete, list_checkpoints, read_best
from eyas.train.metrics import METRIC_PREFIX, METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parents[1]
STEPS = 40


def torchrun(job_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "eyas.train", "--config", str(job_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def run_to_end(job_path: Path) -> str:
    proc = torchrun(job_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def kill_at_step(job_path: Path, step: int) -> None:
    """Start the run and SIGKILL the whole process group once rank 0 reports `step`."""
    proc = torchrun(job_path)
    for line in proc.stdout:
        if line.startswith(METRIC_PREFIX) and json.loads(line[len(METRIC_PREFIX) :])["step"] == step:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while workers_of(job_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers_of(job_path) == [], "eyas.train workers outlived their killed launcher"


def workers_of(job_path: Path) -> list[int]:
    """PIDs of live processes whose command line names this job file."""
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc_dir / "cmdline").read_bytes()
        except OSError:  # the process ended while we looked
            continue
        if b"eyas.train" in cmdline and str(job_path).encode() in cmdline:
            pids.append(int(proc_dir.name))
    return pids


def write_job(run: dict, out: Path, parallelism: str) -> Path:
    job = tiny_job(
        run,
        out,
        num_epochs=14,  # 24 training samples: 3 steps an epoch
        max_steps=STEPS,
        global_batch_size=8,
        save_every_steps=3,
        num_checkpoints_kept=2,
        parallelism=parallelism,
        eval_fraction=0.25,
    )
    path = out.parent / f"{out.name}.json"
    path.write_text(job.model_dump_json())
    return path


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_sigkill_at_a_random_step_resumes_bit_identical(tmp_path, parallelism):
    run = write_tiny_run(tmp_path / "run", num_samples=32)
    run_to_end(write_job(run, tmp_path / "reference", parallelism))
    reference = load_file(latest_complete(tmp_path / "reference") / "model.safetensors")

    crashed_job = write_job(run, tmp_path / "crashed", parallelism)
    kill_step = random.Random(os.getpid()).randint(4, STEPS // 2)
    kill_at_step(crashed_job, kill_step)
    survivor = latest_complete(tmp_path / "crashed")
    # the kill lands at kill_step or a few steps later (the run does not wait for this reader)
    assert survivor is not None and int(survivor.name.split("-")[1]) < STEPS
    assert not (tmp_path / "crashed" / "final.json").exists()

    out = run_to_end(crashed_job)
    assert f"resumed from {survivor}" in out
    final = latest_complete(tmp_path / "crashed")
    assert final.name == f"step-{STEPS:08d}"
    resumed = load_file(final / "model.safetensors")
    assert resumed.keys() == reference.keys()
    different = sorted(k for k in reference if not torch.equal(reference[k], resumed[k]))
    assert different == [], f"killed at step {kill_step}, resumed from {survivor.name}: {different} differ"
    steps = [r["step"] for r in read_metrics(tmp_path / "crashed" / METRICS_FILE)]
    assert steps == list(range(1, STEPS + 1))  # one record per step after the resume
    # the marker names the same checkpoint as the uninterrupted run's, and rotation kept it
    best = read_best(tmp_path / "crashed")
    assert best == read_best(tmp_path / "reference") and best is not None
    assert (tmp_path / "crashed" / "checkpoints" / best["checkpoint"] / COMPLETE_MARKER).is_file()
    evaluated = [r for r in read_metrics(tmp_path / "crashed" / METRICS_FILE) if "eval" in r]
    assert [r["step"] for r in evaluated] == list(range(3, STEPS, 3)) + [STEPS]  # every checkpoint, no other step
    assert best["tau_estimate"] == max(r["eval"]["tau_estimate"] for r in evaluated)
    kept = [step for step, _, done in list_checkpoints(tmp_path / "crashed") if done]
    assert kept[-2:] == [STEPS - 1 - (STEPS - 1) % 3, STEPS] and best["step"] in kept
