"""eyas.train.checkpoint: durable step dirs, the newest complete one, rotation, strict loading, and every file checked
against the checksums of the COMPLETE record before it is loaded (eyas.train.checkpoint_verify)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from draft_fixtures import SMALL_ARCH as ARCH
from draft_fixtures import make_training, save, take_step
from safetensors.torch import load_file, save_file

from eyas.checksum import checksum_file
from eyas.draft import DraftArch, Eagle3Draft
from eyas.train.checkpoint import (
    CheckpointError,
    latest_complete,
    load_draft,
    load_training_state,
    read_checkpoint,
    update_best,
)
from eyas.train.checkpoint_verify import CheckpointDamagedError, completion_record, write_marker

FILES = ["arch.json", "model.safetensors", "optimizer.pt", "rng.pt", "scheduler.pt", "trainer_state.json"]


def flip_byte(path, at: int = -20) -> None:
    """One byte of the file inverted in place, as a disk or a stray write does it (same size)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_model(path, state) -> None:
    """model.safetensors replaced and the COMPLETE record written again: a checkpoint whose checksums hold, written
    whole with this state (what the key-set checks behind them must catch)."""
    save_file(state, path / "model.safetensors")
    write_marker(path, completion_record(path, int(path.name.removeprefix("step-"))))


def test_save_writes_a_complete_step_dir(tmp_path):
    path = save(tmp_path, 12)
    assert path == tmp_path / "checkpoints" / "step-00000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE",
        "arch.json",
        "model.safetensors",
        "optimizer.pt",
        "rng.pt",
        "scheduler.pt",
        "trainer_state.json",
    ]
    assert json.loads((path / "arch.json").read_text()) == {
        "arch": ARCH.to_dict(),
        "aux_layer_ids": [2, 5, 8],
        "layer_id_convention": "hf_hidden_states",
        "target_fingerprint": "abc123",
    }
    assert json.loads((path / "trainer_state.json").read_text()) == {
        "step": 12,
        "samples_consumed": 96,
        "epoch": 0,
        "world_size": 2,
        "global_batch_size": 8,
        "loss": 1.5,
    }
    assert set(load_file(path / "model.safetensors")) == set(Eagle3Draft(ARCH).state_dict())
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    assert json.loads((path / "COMPLETE").read_text()) == {
        "step": 12,
        "files": {f: {"checksum": checksum_file(path / f), "bytes": (path / f).stat().st_size} for f in FILES},
    }


def test_latest_complete_is_none_without_checkpoints(tmp_path):
    assert latest_complete(tmp_path) is None


def test_latest_complete_ignores_incomplete_and_temporary_dirs(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 4)
    root = tmp_path / "checkpoints"
    (root / "step-00000006").mkdir()  # crashed after the rename, before COMPLETE
    (root / "step-00000006" / "model.safetensors").write_bytes(b"partial")
    (root / ".tmp-step-00000008-123").mkdir()  # crashed while writing
    (root / ".tmp-step-00000008-123" / "COMPLETE").write_text("8\n")
    (root / "step-10-notes").mkdir()  # not a step dir
    assert latest_complete(tmp_path) == root / "step-00000004"


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / ".tmp-step-00000001-99").mkdir()
    (root / "step-00000002").mkdir()  # incomplete and older than what gets saved: garbage
    for step in (1, 3, 4, 5):
        save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]


def test_save_replaces_an_incomplete_dir_of_the_same_step(tmp_path):
    stale = tmp_path / "checkpoints" / "step-00000003"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a crash")
    path = save(tmp_path, 3)
    assert not (path / "junk").exists() and (path / "COMPLETE").is_file()


def test_load_draft_returns_the_saved_weights_and_meta(tmp_path):
    training = make_training(seed=7)
    path = save(tmp_path, 1, training)
    draft, meta = load_draft(path)
    for key, value in training[0].state_dict().items():
        assert torch.equal(draft.state_dict()[key], value), key
    assert not draft.embed_tokens.weight.requires_grad and draft.fc.weight.requires_grad
    assert meta["arch"] == ARCH and meta["aux_layer_ids"] == [2, 5, 8]
    assert meta["target_fingerprint"] == "abc123" and meta["trainer_state"]["step"] == 1


def test_load_draft_refuses_a_missing_key_and_lists_it(tmp_path):
    path = save(tmp_path, 1)
    state = load_file(path / "model.safetensors")
    del state["fc.weight"]
    rewrite_model(path, state)
    with pytest.raises(CheckpointError) as err:
        load_draft(path)
    assert str(err.value).startswith(
        f"checkpoint {path / 'model.safetensors'} (eyas format): key set differs from the expected one\n"
        "  missing: fc.weight (expected shape [16, 48])\n"
        "  (1 missing, 0 unexpected, 0 shape mismatches)"
    )


def test_load_draft_lists_every_missing_and_unexpected_key_sorted(tmp_path):
    path = save(tmp_path, 1)
    state = load_file(path / "model.safetensors")
    del state["norm.weight"], state["d2t"]
    state["layers.0.mlp.up_proj.weight"] = state.pop("midlayer.mlp.up_proj.weight")
    rewrite_model(path, state)
    with pytest.raises(CheckpointError) as err:
        load_draft(path)
    lines = str(err.value).splitlines()[1:5]
    assert lines == [
        "  missing: d2t (expected shape [20])",
        "  missing: midlayer.mlp.up_proj.weight (expected shape [32, 16])",
        "  missing: norm.weight (expected shape [16])",
        "  unexpected: layers.0.mlp.up_proj.weight (shape [32, 16])",
    ]


def test_load_draft_refuses_a_wrong_shape(tmp_path):
    path = save(tmp_path, 1)
    state = load_file(path / "model.safetensors")
    state["lm_head.weight"] = torch.zeros(21, 16)
    rewrite_model(path, state)
    with pytest.raises(
        CheckpointError, match=re.escape("  shape mismatch: lm_head.weight: found [21, 16], expected [20, 16]")
    ):
        load_draft(path)


def test_load_draft_refuses_an_incomplete_checkpoint(tmp_path):
    path = save(tmp_path, 1)
    (path / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="no COMPLETE marker; it was not written completely"):
        load_draft(path)


def test_load_training_state_restores_optimizer_scheduler_and_rng(tmp_path):
    training = make_training()
    take_step(*training)
    torch.manual_seed(123)
    path = save(tmp_path, 1, training)
    expected_next = torch.rand(3)
    draft, optimizer, scheduler = make_training(seed=1)
    torch.manual_seed(0)
    state = load_training_state(path, draft=draft, optimizer=optimizer, scheduler=scheduler)
    assert state["samples_consumed"] == 8 and state["world_size"] == 2
    assert torch.equal(draft.fc.weight, training[0].fc.weight)
    assert scheduler.last_epoch == 1 and scheduler.get_last_lr() == training[2].get_last_lr()
    saved_exp_avg = training[1].state_dict()["state"][0]["exp_avg"]
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved_exp_avg)
    assert torch.equal(torch.rand(3), expected_next)


def test_load_training_state_refuses_another_arch(tmp_path):
    path = save(tmp_path, 1)
    other = DraftArch(**{**ARCH.to_dict(), "intermediate_size": 64})
    draft = Eagle3Draft(other)
    optimizer = torch.optim.AdamW(draft.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(CheckpointError, match="resume with the same draft config or use a new output_dir"):
        load_training_state(path, draft=draft, optimizer=optimizer, scheduler=scheduler)


def load_into_fresh_training(path) -> dict:
    draft, optimizer, scheduler = make_training(seed=1)
    return load_training_state(path, draft=draft, optimizer=optimizer, scheduler=scheduler)


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_is_named_and_nothing_is_loaded(tmp_path, name):
    path = save(tmp_path, 1)
    recorded = json.loads((path / "COMPLETE").read_text())["files"][name]["checksum"]
    flip_byte(path / name)
    found = checksum_file(path / name)
    with pytest.raises(CheckpointDamagedError) as err:
        load_into_fresh_training(path)
    assert str(err.value) == (
        f"checkpoint {path}: {name} has checksum {found[:25]}..., its COMPLETE record says {recorded[:25]}...; the "
        "file changed after the checkpoint was completed (a disk fault, a partial copy, an edit): its state is not "
        "loaded"
    )
    assert err.value.file == name and err.value.checkpoint_dir == path


@pytest.mark.parametrize("reader", [load_draft, read_checkpoint])
def test_the_draft_readers_check_the_weights_checksum(tmp_path, reader):
    path = save(tmp_path, 1)
    flip_byte(path / "model.safetensors")
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"checkpoint {path}: model.safetensors has checksum")):
        reader(path)


def test_a_truncated_or_missing_file_is_named(tmp_path):
    path = save(tmp_path, 1)
    size = (path / "optimizer.pt").stat().st_size
    (path / "optimizer.pt").write_bytes((path / "optimizer.pt").read_bytes()[:-10])
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"optimizer.pt has {size - 10} bytes, its COMPLETE ")):
        load_into_fresh_training(path)
    (path / "rng.pt").unlink()
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"{path}: optimizer.pt has")):  # name order
        load_into_fresh_training(path)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"{path}: optimizer.pt is missing (COMPLETE records")):
        load_into_fresh_training(path)


@pytest.mark.parametrize(
    ("marker", "problem"),
    [
        ('{"step": 1, "files": {', "COMPLETE is not the JSON record eyas writes"),
        ('{"step": 1}', 'COMPLETE lacks "files" with a "checksum" and "bytes" per file'),
        ('{"step": 1, "files": {}}', "arch.json is not in its COMPLETE record"),
    ],
)
def test_a_foreign_or_edited_completion_record_is_damage(tmp_path, marker, problem):
    path = save(tmp_path, 1)
    (path / "COMPLETE").write_text(marker)
    with pytest.raises(CheckpointDamagedError, match=re.escape(f"checkpoint {path}: {problem}")):
        load_into_fresh_training(path)


@pytest.mark.parametrize("marker", ["1\n", ""])
def test_a_checkpoint_from_before_checksums_loads_unverified_and_says_so(tmp_path, marker):
    path = save(tmp_path, 1)
    (path / "COMPLETE").write_text(marker)  # what eyas wrote before checkpoints carried checksums
    said = []
    draft, optimizer, scheduler = make_training(seed=1)
    state = load_training_state(path, draft=draft, optimizer=optimizer, scheduler=scheduler, log=said.append)
    assert state["step"] == 1
    assert said == [
        f"checkpoint {path}: its COMPLETE marker holds no checksums (written before eyas checkpoints carried them); "
        "its files are loaded unverified"
    ]


def test_update_best_deletes_a_marker_whose_checkpoint_is_gone(tmp_path):
    path = save(tmp_path, 2, trainer_state={"eval": {"tau_estimate": 2.0}})
    save(tmp_path, 4)
    assert update_best(tmp_path)["checkpoint"] == "step-00000002"
    path.rename(path.with_name("step-00000002.damaged"))  # set aside: no evaluated checkpoint is left
    assert update_best(tmp_path) is None
    assert not (tmp_path / "checkpoints" / "BEST").exists()
