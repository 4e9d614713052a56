"""The trainer never trains on a damaged or half-written checkpoint: one flipped byte in the newest complete
checkpoint's model, optimizer, scheduler or RNG file is found by its checksum, the checkpoint is set aside, and the
run resumes from the older one (the log naming both) to the weights of an uninterrupted run, bit for bit; a SIGKILL
at any instant of a save leaves the previous checkpoint to resume from. The trainer's in-process path (one rank)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_fixtures import run_trainer, tiny_job, write_tiny_run
from safetensors.torch import load_file

from eyas.train.__main__ import main
from eyas.train.checkpoint import FINAL_FILE, latest_complete, list_checkpoints, train_state
from eyas.train.checkpoint_verify import CheckpointError
from eyas.train.metrics import METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


def write_job(run: dict, out: Path) -> Path:
    job = tiny_job(run, out, num_epochs=2, max_steps=STEPS, save_every_steps=2, num_checkpoints_kept=3)
    path = out.parent / f"{out.name}.json"
    path.write_text(job.model_dump_json())
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run of STEPS steps, checkpoints at 2, 4 and 6."""
    root = tmp_path_factory.mktemp("damage")
    run = write_tiny_run(root / "run", num_samples=32)
    assert main(["--config", str(write_job(run, root / "reference"))]) == 0
    final = load_file(root / "reference" / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors")
    return {"run": run, "out": root / "reference", "final": final}


def stopped_after_step_4(reference: dict, out: Path) -> Path:
    """The reference run as a kill after its step-4 checkpoint leaves it; returns the job file."""
    shutil.copytree(reference["out"], out)
    shutil.rmtree(out / "checkpoints" / f"step-{STEPS:08d}")
    (out / FINAL_FILE).unlink()
    return write_job(reference["run"], out)


def assert_trained_like_the_reference(reference: dict, out: Path) -> None:
    final = load_file(latest_complete(out) / "model.safetensors")
    assert latest_complete(out).name == f"step-{STEPS:08d}"
    assert sorted(k for k in final if not torch.equal(final[k], reference["final"][k])) == []
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt"])
def test_a_flipped_byte_is_set_aside_and_the_older_checkpoint_resumed(reference, tmp_path, capsys, name):
    job = stopped_after_step_4(reference, tmp_path / "out")
    damaged = tmp_path / "out" / "checkpoints" / "step-00000004"
    data = bytearray((damaged / name).read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensors' bytes: a loader would take it without a word
    (damaged / name).write_bytes(bytes(data))
    capsys.readouterr()

    assert main(["--config", str(job)]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "is damaged" in line)
    assert line.startswith(f"[eyas.train] checkpoint step-00000004 is damaged: {name} has checksum xxh3-128:")
    assert line.endswith(
        "set aside as checkpoints/step-00000004.damaged (DAMAGED.json says why); resuming from step-00000002 "
        "instead, the newest older complete checkpoint that verifies"
    )
    assert f"resumed from {tmp_path / 'out' / 'checkpoints' / 'step-00000002'} at step 2 " in out
    assert_trained_like_the_reference(reference, tmp_path / "out")
    aside = tmp_path / "out" / "checkpoints" / "step-00000004.damaged"
    assert (aside / name).read_bytes() == bytes(data)  # kept as found, for inspection
    record = json.loads((aside / "DAMAGED.json").read_text())
    assert record["checkpoint"] == "step-00000004" and f"{name} has checksum" in record["reason"]
    assert [r["checkpoint"] for r in train_state(tmp_path / "out").set_aside] == ["step-00000004"]
    assert [step for step, _, done in list_checkpoints(tmp_path / "out") if done] == [2, 4, 6]


def test_every_checkpoint_damaged_stops_the_run_naming_them(reference, tmp_path, capsys):
    job = stopped_after_step_4(reference, tmp_path / "out")
    for step in (2, 4):
        (tmp_path / "out" / "checkpoints" / f"step-{step:08d}" / "model.safetensors").write_bytes(b"zeroed")
    with pytest.raises(CheckpointError, match=r"every complete checkpoint is damaged \(step-00000004, step-00000002\)"):
        main(["--config", str(job)])
    out = capsys.readouterr().out
    assert "checkpoint step-00000004 is damaged: model.safetensors has 6 bytes" in out
    assert "no complete checkpoint verifies" in out
    assert latest_complete(tmp_path / "out") is None  # both set aside: a re-run starts from step 0


KILLER = """
import os, signal, sys
from pathlib import Path
import eyas.fsio, eyas.train.checkpoint as checkpoint
point, job = sys.argv[1], sys.argv[2]
def kill_at(name, real, is_step_4):
    def wrapped(*args):
        if is_step_4(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)
    return wrapped
STEP_4 = "step-00000004"
if point == "files_written":  # every file in the temporary dir, before the rename
    checkpoint.replace_dir = kill_at(point, checkpoint.replace_dir, lambda temp, final: final.name == STEP_4)
elif point == "renamed":  # the step dir in place, no COMPLETE yet
    checkpoint.write_marker = kill_at(point, checkpoint.write_marker, lambda d, record: d.name == STEP_4)
elif point == "marker_written":  # COMPLETE's temporary written, not yet renamed
    eyas.fsio.commit_temp = kill_at(
        point, eyas.fsio.commit_temp, lambda tmp, path: path.name == "COMPLETE" and path.parent.name == STEP_4
    )
from eyas.train.__main__ import main
main(["--config", job])
"""


@pytest.mark.parametrize("point", ["files_written", "renamed", "marker_written"])
def test_sigkill_during_a_save_resumes_from_the_previous_checkpoint(reference, tmp_path, capsys, point):
    job = write_job(reference["run"], tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, point, str(job)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert latest_complete(tmp_path / "out").name == "step-00000002"
    root = tmp_path / "out" / "checkpoints"
    left = sorted(p.name for p in root.iterdir())
    if point == "files_written":
        assert left[1:] == ["step-00000002"] and left[0].startswith(".step-00000004.tmp-"), left
    else:  # the dir in place without its marker (at most the marker's temporary): never loaded
        assert left == ["step-00000002", "step-00000004"]
        inside = sorted(p.name for p in (root / "step-00000004").iterdir())
        assert "COMPLETE" not in inside and (point == "renamed") == (not any(".COMPLETE.tmp-" in n for n in inside))
    capsys.readouterr()

    assert main(["--config", str(job)]) == 0
    assert f"resumed from {tmp_path / 'out' / 'checkpoints' / 'step-00000002'} at step 2 " in capsys.readouterr().out
    assert_trained_like_the_reference(reference, tmp_path / "out")
    assert not [p for p in (tmp_path / "out" / "checkpoints").rglob("*") if ".tmp-" in p.name]


def test_two_ranks_resume_from_the_checkpoint_rank_0_verified(tmp_path):
    """Under torchrun (2 ranks, gloo) rank 0 chooses and every rank loads its choice: a corrupted optimizer.pt (a
    NaN in training before checksums) is set aside, and the run ends on the uninterrupted run's weights."""
    run = write_tiny_run(tmp_path / "run", num_samples=32)
    run_trainer(write_job(run, tmp_path / "reference"), nproc=2)
    reference = {"run": run, "out": tmp_path / "reference"}
    reference["final"] = load_file(latest_complete(tmp_path / "reference") / "model.safetensors")
    job = stopped_after_step_4(reference, tmp_path / "out")
    optimizer = tmp_path / "out" / "checkpoints" / "step-00000004" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes([0xFF] * 8)  # a NaN-like run inside a moment tensor
    optimizer.write_bytes(bytes(data))

    stdout, metrics = run_trainer(job, nproc=2)
    assert "[eyas.train] checkpoint step-00000004 is damaged: optimizer.pt has checksum" in stdout
    assert f"resumed from {tmp_path / 'out' / 'checkpoints' / 'step-00000002'} at step 2 " in stdout
    assert [m["step"] for m in metrics] == [3, 4, 5, 6]
    assert_trained_like_the_reference(reference, tmp_path / "out")


def test_the_export_stage_exports_the_older_checkpoint_and_says_why(reference, tmp_path, capsys):
    from run_fixtures import small_run_config

    from eyas.export.convert import export_run

    shutil.copytree(reference["out"], tmp_path / "run" / "train")
    newest = tmp_path / "run" / "train" / "checkpoints" / f"step-{STEPS:08d}"
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 0x40
    (newest / "model.safetensors").write_bytes(bytes(data))
    config = small_run_config(tmp_path / "run", reference["run"]["target"], export={"checkpoint": "last"})
    out = export_run(config)
    said = capsys.readouterr().out
    assert "checkpoint step-00000006 is damaged: model.safetensors has checksum" in said
    assert "exporting step-00000004 instead, the newest older complete checkpoint that verifies" in said
    provenance = json.loads((out / "eyas_export.json").read_text())
    assert provenance["source_checkpoint"] == str(newest.with_name("step-00000004"))
