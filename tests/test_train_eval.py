"""Acceptance while training: the held-out split, the replayed verification rounds, the BEST marker, the
export's choice of checkpoint and the TensorBoard event files, on real torchrun runs (gloo)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from draft_fixtures import save
from run_fixtures import run_trainer, tiny_job, write_tiny_run
from safetensors.torch import load_file

from eyas.train.checkpoint import (
    BEST_MARKER,
    best_checkpoint,
    latest_complete,
    read_best,
    read_trainer_state,
    rotate_checkpoints,
    update_best,
)
from eyas.train.data import ShardWindows, TrainSplit, held_out_ids, total_steps
from eyas.train.evaluate import simulate_rounds

NUM_SAMPLES, BATCH, STEPS, CHAIN = 32, 8, 6, 2


def test_the_held_out_split_depends_on_the_sample_index_alone():
    held = held_out_ids(1000, 0.05)
    assert len(held) == 50 and held == sorted(held) and held == held_out_ids(1000, 0.05)
    assert held_out_ids(1000, 0.0) == [] and len(held_out_ids(10, 0.01)) == 1  # at least one
    split = TrainSplit.of(1000, 0.05)
    assert set(split.train_ids).isdisjoint(split.eval_ids) and len(split.train_ids) + 50 == 1000
    # a held-out sample stays held out when the shard set grows: its key is its own index
    assert len(set(held) & set(held_out_ids(1100, 0.05))) > 40
    with pytest.raises(ValueError, match="holds out all 1 samples"):
        TrainSplit.of(1, 0.4)


def test_shard_windows_move_to_the_training_positions():
    split = TrainSplit.of(40, 0.25)
    windows = split.windows(ShardWindows((0, 10, 20, 30), 2))
    expected = [sum(1 for i in split.train_ids if i < s) for s in (0, 10, 20, 30)]
    assert list(windows.shard_starts) == expected and windows.size == 2


def test_total_steps_count_only_the_training_samples(tmp_path):
    job = tiny_job({"target": "t", "shards": "s", "vocab": "v"}, tmp_path, num_epochs=2, eval_fraction=0.25)
    assert total_steps(32, job.train) == 2 * (24 // 8)


def test_the_replay_walks_each_response_as_the_engine_does():
    # one response over positions 1..8 (predicting x_2..x_9; x_2 comes from the prefill)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    lengths = torch.tensor([[0, 3, 0, 0, 1, 2, 2, 0, 5]])
    # t=1: accept min(3, 2) = 2, emit x_3..x_5; t=4: accept 1, emit x_6, x_7; t=6: accept 2, but only x_8, x_9 left
    hist, emitted = simulate_rounds(lengths, mask, chain_steps=2)
    assert hist == [0, 1, 2] and emitted == 7
    # two responses in one row are replayed separately; a response of one token has no round
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 0]], dtype=torch.bool)
    hist, emitted = simulate_rounds(torch.zeros(1, 7, dtype=torch.int64), mask, chain_steps=2)
    assert hist == [2, 0, 0] and emitted == 2


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("eval-run"), num_samples=NUM_SAMPLES)


def train(run: dict, out, nproc: int | None, **train) -> list[dict]:
    fields = {
        "num_epochs": 3,
        "max_steps": STEPS,
        "global_batch_size": BATCH,
        "save_every_steps": 2,
        "num_checkpoints_kept": 1,
        **train,
    }
    job = tiny_job(run, out, **fields).model_copy(update={"chain_steps": CHAIN})
    job_path = out.parent / f"{out.name}.json"
    job_path.write_text(job.model_dump_json())
    return run_trainer(job_path, nproc)[1]


@pytest.fixture(scope="module")
def evaluated_run(tiny_run, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("evaluated") / "train"
    metrics = train(tiny_run, out, 2, eval_fraction=0.25, eval_every_steps=1)
    return {"out": out, "metrics": metrics}


def test_training_evaluates_the_held_out_split_at_every_eval_step(evaluated_run):
    held = set(held_out_ids(NUM_SAMPLES, 0.25))
    metrics = evaluated_run["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert held.isdisjoint(m["sample_ids"])  # never trained on
        e = m["eval"]
        assert len(e["acc_k"]) == len(e["loss_k"]) == 3 and len(e["accept_rate_k"]) == CHAIN
        assert 1.0 <= e["tau_estimate"] <= CHAIN + 1 and e["num_rounds"] > 0
        assert all(0 <= a <= 1 for a in e["acc_k"]) and math.isfinite(e["loss"])
        # tau = 1 + the sum of acceptance per position, up to the responses' ends cutting rounds short
        assert e["tau_estimate"] <= 1 + sum(e["accept_rate_k"]) + 1e-9
        assert m["tokens_per_s"] > 0
    assert metrics[-1]["eval"]["tau_estimate"] > metrics[0]["eval"]["tau_estimate"]  # it learns


def test_the_evaluation_is_the_same_on_one_process(evaluated_run, tiny_run, tmp_path):
    one = train(tiny_run, tmp_path / "one", None, eval_fraction=0.25, eval_every_steps=1, max_steps=1)
    first, two = one[0]["eval"], evaluated_run["metrics"][0]["eval"]
    assert (first["num_rounds"], first["num_tokens"]) == (two["num_rounds"], two["num_tokens"])
    assert first["tau_estimate"] == pytest.approx(two["tau_estimate"], abs=0.05)
    assert first["acc_k"] == pytest.approx(two["acc_k"], abs=0.05)


def test_a_held_out_split_smaller_than_the_world_is_counted_once(tiny_run, tmp_path):
    # one held-out sample, two ranks: the rank without one runs the forward FSDP2 needs and counts nothing
    assert len(held_out_ids(NUM_SAMPLES, 0.03)) == 1
    two = train(tiny_run, tmp_path / "two", 2, eval_fraction=0.03, max_steps=1)[0]["eval"]
    one = train(tiny_run, tmp_path / "one", None, eval_fraction=0.03, max_steps=1)[0]["eval"]
    assert (two["num_rounds"], two["num_tokens"]) == (one["num_rounds"], one["num_tokens"]) and one["num_rounds"] > 0
    assert two["tau_estimate"] == pytest.approx(one["tau_estimate"], abs=0.05)


def test_the_best_marker_names_the_best_checkpoint_and_survives_rotation(evaluated_run):
    out, metrics = evaluated_run["out"], evaluated_run["metrics"]
    saved = {m["step"]: m["eval"]["tau_estimate"] for m in metrics if m["step"] % 2 == 0}
    best_tau = max(saved.values())
    best_step = max(step for step, tau in saved.items() if tau == best_tau)  # a tie goes to the later step
    assert read_best(out) == {"checkpoint": f"step-{best_step:08d}", "step": best_step, "tau_estimate": best_tau}
    assert best_checkpoint(out).name == f"step-{best_step:08d}"
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == sorted({BEST_MARKER, f"step-{best_step:08d}", f"step-{STEPS:08d}"})  # keep_last 1 + best
    assert read_trainer_state(best_checkpoint(out))["eval"]["tau_estimate"] == best_tau
    assert json.loads((out / "final.json").read_text())["best"] == read_best(out)


def test_update_best_mends_a_marker_a_kill_left_behind(tmp_path):
    for step, tau in [(2, 1.5), (4, 1.9), (6, 1.7)]:
        save(tmp_path, step, keep_last=5, trainer_state={"eval": {"tau_estimate": tau}})
    marker = tmp_path / "checkpoints" / BEST_MARKER
    assert read_best(tmp_path)["step"] == 4
    marker.write_text(json.dumps({"checkpoint": "step-00000002", "step": 2, "tau_estimate": 1.5}))  # stale
    assert update_best(tmp_path)["step"] == 4 and read_best(tmp_path)["step"] == 4
    (tmp_path / "checkpoints" / ".BEST.tmp-1304").write_text("{")  # a machine died while the marker was written
    rotate_checkpoints(tmp_path, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        BEST_MARKER,
        "step-00000004",
        "step-00000006",
    ]
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000004")  # removed by hand: the marker follows what is left
    assert update_best(tmp_path)["step"] == 6
    marker.unlink()
    assert best_checkpoint(tmp_path) == latest_complete(tmp_path)  # no marker: the newest


def test_without_a_held_out_split_there_is_no_marker_and_best_is_the_newest(tiny_run, tmp_path):
    train(tiny_run, tmp_path / "plain", None, max_steps=2, tensorboard=False)
    assert read_best(tmp_path / "plain") is None and not (tmp_path / "plain" / "tb").exists()
    assert best_checkpoint(tmp_path / "plain") == latest_complete(tmp_path / "plain")
    # TensorBoard on changes nothing else: the same weights, bit for bit
    train(tiny_run, tmp_path / "logged", None, max_steps=2, tensorboard=True)
    assert list((tmp_path / "logged" / "tb").glob("events.out.tfevents.*"))
    plain, logged = (load_file(latest_complete(tmp_path / d) / "model.safetensors") for d in ("plain", "logged"))
    assert plain.keys() == logged.keys() and all(torch.equal(plain[k], logged[k]) for k in plain)


def test_export_checkpoint_best_or_last(evaluated_run, tmp_path, tiny_run):
    from run_fixtures import small_run_config

    from eyas.export.convert import export_run

    workdir = tmp_path / "run"
    shutil.copytree(evaluated_run["out"], workdir / "train")
    checkpoints = workdir / "train" / "checkpoints"
    # an earlier checkpoint that is the best (the run's own best may be its last)
    shutil.copytree(checkpoints / f"step-{STEPS:08d}", checkpoints / "step-00000002", dirs_exist_ok=True)
    (checkpoints / BEST_MARKER).write_text(json.dumps({"checkpoint": "step-00000002", "step": 2, "tau_estimate": 9.0}))
    for choice, expected in (("best", "step-00000002"), ("last", f"step-{STEPS:08d}")):
        config = small_run_config(workdir, tiny_run["target"], export={"checkpoint": choice})
        out = export_run(config)
        provenance = json.loads((out / "eyas_export.json").read_text())
        assert provenance["source_checkpoint"] == str(checkpoints / expected), (choice, provenance)


def test_tensorboard_event_files_hold_every_scalar(evaluated_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = evaluated_run["out"] / "tb"
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss", "eval/tau_estimate"}
    expected |= {"train/padding_waste", "train/micro_batches"}
    expected |= {f"train/acc_k/{k}" for k in range(3)} | {f"eval/acc_k/{k}" for k in range(3)}
    assert expected <= tags
    taus = [e.value for e in events.Scalars("eval/tau_estimate")]
    assert [e.step for e in events.Scalars("eval/tau_estimate")] == list(range(1, STEPS + 1))
    assert taus == pytest.approx([m["eval"]["tau_estimate"] for m in evaluated_run["metrics"]], rel=1e-6)


def test_tensorboard_serves_the_scalars_to_a_browser(evaluated_run, tmp_path):
    from browser import tensorboard_screenshot

    shot = tensorboard_screenshot(evaluated_run["out"] / "tb", tmp_path / "tensorboard-scalars.png")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
