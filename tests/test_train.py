"""eyas.train: real `torchrun --nproc_per_node=2 -m eyas.train` runs (gloo) on a tiny synthetic run,
resume from the newest complete checkpoint (also on another world size), and the pieces around them."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from run_fixtures import AUX_LAYER_IDS, run_trainer, tiny_job, write_tiny_run

from eyas.objective import ttt_loss
from eyas.shards.manifest import read_manifest
from eyas.train.__main__ import main
from eyas.train.checkpoint import latest_complete, load_draft
from eyas.train.data import batch_at, collate, total_steps
from eyas.train.metrics import METRIC_PREFIX
from eyas.train.setup import build_setup
from eyas.train.step import make_scheduler

REPO = Path(__file__).resolve().parents[1]
NUM_SAMPLES, BATCH, STEPS = 32, 8, 6
METRIC_KEYS = {
    "step",
    "epoch",
    "samples_consumed",
    "loss",
    "loss_k",
    "acc_k",
    "lr",
    "grad_norm",
    "num_tokens",
    "elapsed_s",
    "sample_ids",
    "tokens_per_s",
    "padding_waste",
    "micro_batches",
    "data_wait_s",
    "data_stall_fraction",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("train-run"), num_samples=NUM_SAMPLES)


@pytest.fixture(scope="module")
def two_rank_run(tiny_run, tmp_path_factory) -> dict:
    """6 steps on 2 gloo ranks, checkpoints every 2 steps (3 kept)."""
    out = tmp_path_factory.mktemp("two-rank") / "out"
    job = tiny_job(
        tiny_run,
        out,
        num_epochs=3,
        max_steps=STEPS,
        global_batch_size=BATCH,
        save_every_steps=2,
        num_checkpoints_kept=3,
    )
    job_path = out.parent / "job.json"
    job_path.write_text(job.model_dump_json())
    stdout, metrics = run_trainer(job_path, nproc=2)
    return {"job": job, "job_path": job_path, "out": out, "stdout": stdout, "metrics": metrics}


def test_two_rank_training_lowers_the_loss(two_rank_run):
    losses = [m["loss"] for m in two_rank_run["metrics"]]
    assert [m["step"] for m in two_rank_run["metrics"]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_two_ranks_hash_each_shard_once_between_them(two_rank_run, tiny_run):
    """verify_reads (on by default) under torchrun: the ranks of the launch share one node record, so the shard
    set is hashed once in all (every sample is read in 6 steps of 8 over 32 samples), not once per rank."""
    rows = read_manifest(Path(two_rank_run["job"].shards_dir))
    lines = re.findall(r"rank (\d): read checks: (\d+) shards \((\d+) bytes.*?(\d+) trusted", two_rank_run["stdout"])
    assert sorted(int(line[0]) for line in lines) == [0, 1], two_rank_run["stdout"]
    assert sum(int(line[1]) for line in lines) == len(rows) > 1
    assert sum(int(line[2]) for line in lines) == sum(row.num_bytes for row in rows)
    assert sum(int(line[3]) for line in lines) >= 1  # a shard one rank hashed, the other took from the record


def test_metrics_lines_follow_the_global_sample_order(two_rank_run):
    lines = (two_rank_run["out"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == two_rank_run["metrics"]
    for m in two_rank_run["metrics"]:
        assert set(m) == METRIC_KEYS
        assert len(m["loss_k"]) == len(m["acc_k"]) == 3
        assert m["samples_consumed"] == m["step"] * BATCH
        assert (m["epoch"], m["sample_ids"]) == batch_at((m["step"] - 1) * BATCH, NUM_SAMPLES, BATCH, seed=0)
    assert [m["epoch"] for m in two_rank_run["metrics"]] == [0, 0, 0, 0, 1, 1]


def test_training_writes_complete_checkpoints_and_final_json(two_rank_run, tiny_run):
    out = two_rank_run["out"]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000004", "step-00000006"]
    assert all((out / "checkpoints" / name / "COMPLETE").is_file() for name in names)
    final = json.loads((out / "final.json").read_text())
    assert final == {
        "checkpoint": str(out / "checkpoints" / "step-00000006"),
        "step": STEPS,
        "final_loss": two_rank_run["metrics"][-1]["loss"],
        "best": None,  # no held-out split: no BEST marker
    }
    draft, meta = load_draft(final["checkpoint"])
    assert meta["aux_layer_ids"] == AUX_LAYER_IDS and meta["trainer_state"]["world_size"] == 2
    assert meta["trainer_state"]["samples_consumed"] == STEPS * BATCH
    assert torch.equal(draft.d2t, torch.arange(32)) and int(draft.t2d.sum()) == 32


def test_rerun_resumes_on_one_process_with_the_same_sample_order(two_rank_run, tmp_path):
    # Simulate a crash while step 6 was being saved: its COMPLETE marker never got written.
    out = tmp_path / "out"
    shutil.copytree(two_rank_run["out"], out)
    (out / "checkpoints" / "step-00000006" / "COMPLETE").unlink()
    (out / "final.json").unlink()
    job_path = tmp_path / "job.json"
    job_path.write_text(two_rank_run["job"].model_copy(update={"output_dir": str(out)}).model_dump_json())
    stdout, metrics = run_trainer(job_path, nproc=None)
    assert re.search(
        r"resumed from \S+step-00000004 at step 4 \(32 samples consumed, saved with world size 2, "
        r"now 1; saved under ddp, now ddp\)",
        stdout,
    ), stdout
    assert [m["step"] for m in metrics] == [5, 6]
    before = {m["step"]: m["sample_ids"] for m in two_rank_run["metrics"]}
    assert [m["sample_ids"] for m in metrics] == [before[5], before[6]]
    assert latest_complete(out) == out / "checkpoints" / "step-00000006"
    assert json.loads((out / "final.json").read_text())["step"] == STEPS


def test_rerun_of_a_finished_run_trains_nothing(two_rank_run, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(two_rank_run["out"], out)
    job_path = tmp_path / "job.json"
    job_path.write_text(two_rank_run["job"].model_copy(update={"output_dir": str(out)}).model_dump_json())
    assert main(["--config", str(job_path)]) == 0  # in-process, one rank, no torchrun environment
    assert METRIC_PREFIX not in capsys.readouterr().out
    final = json.loads((out / "final.json").read_text())
    assert final["step"] == STEPS and final["final_loss"] == two_rank_run["metrics"][-1]["loss"]


def test_shards_from_other_layers_are_refused(tiny_run, tmp_path):
    job = tiny_job(tiny_run, tmp_path / "out").model_copy(update={"aux_layer_ids": [1, 2, 4]})
    with pytest.raises(ValueError, match=re.escape("(target_fingerprint, aux_layer_ids, hidden_size, num_aux)")):
        build_setup(job)


def test_lr_warms_up_linearly_then_decays_by_cosine():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer, num_warmup_steps=2, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    expected = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(4)]
    assert lrs == pytest.approx(expected)


def test_total_steps_counts_full_batches_per_epoch_capped_by_max_steps(tiny_run, tmp_path):
    train = tiny_job(tiny_run, tmp_path, num_epochs=3, global_batch_size=5).train
    assert total_steps(32, train) == 18
    assert total_steps(32, train.model_copy(update={"max_steps": 7})) == 7
    assert total_steps(32, train.model_copy(update={"max_steps": 100})) == 18


def test_padding_past_the_ttt_unroll_changes_no_loss(tiny_run, tmp_path):
    setup = build_setup(tiny_job(tiny_run, tmp_path))
    samples = [setup.samples.load_sample(i) for i in (0, 1)]
    losses = [
        ttt_loss(setup.draft, collate(samples, 64, min_len=width), setup.head_rows, 3, 0.8)[0].item()
        for width in (0, 40)
    ]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # ttt_loss needs more columns than unroll steps: a 4-token batch trains once padded to 8 for 7 steps.
    total, *_ = ttt_loss(setup.draft, collate(samples, 4, min_len=8), setup.head_rows, 7, 0.8)
    assert math.isfinite(total.item())
