"""eyas.train.checkpoint_fallback: which checkpoint a resume or an export takes when one is damaged (set aside, the
BEST marker moved off it, a log line naming the damaged file and the checkpoint taken instead)."""

from __future__ import annotations

import json
import re

import pytest
from draft_fixtures import save

from eyas.train.checkpoint import latest_complete, list_checkpoints, read_best, rotate_checkpoints, train_state
from eyas.train.checkpoint_fallback import AllCheckpointsDamagedError, export_choice, resume_checkpoint
from eyas.train.checkpoint_verify import set_aside


def damage(path, name: str = "model.safetensors") -> None:
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))


def evaluated(tmp_path, taus: dict[int, float]) -> dict:
    return {
        step: save(tmp_path, step, keep_last=9, trainer_state={"eval": {"tau_estimate": tau}})
        for step, tau in taus.items()
    }


def test_resume_takes_the_newest_checkpoint_that_verifies_and_says_which_and_why(tmp_path):
    saved = {step: save(tmp_path, step) for step in (2, 4, 6)}
    damage(saved[6], "rng.pt")
    damage(saved[4], "scheduler.pt")
    said = []
    assert resume_checkpoint(tmp_path, log=said.append) == saved[2]
    assert [re.sub(r"xxh3-128:\w+\.\.\.", "X", line) for line in said] == [
        "checkpoint step-00000006 is damaged: rng.pt has checksum X, its COMPLETE record says X; set aside as "
        "checkpoints/step-00000006.damaged (DAMAGED.json says why); resuming from step-00000002 instead, the "
        "newest older complete checkpoint that verifies",
        "checkpoint step-00000004 is damaged: scheduler.pt has checksum X, its COMPLETE record says X; set aside as "
        "checkpoints/step-00000004.damaged (DAMAGED.json says why); resuming from step-00000002 instead, the "
        "newest older complete checkpoint that verifies",
    ]
    assert [step for step, _, _ in list_checkpoints(tmp_path)] == [2]  # the damaged ones are no step dirs now
    assert [r["checkpoint"] for r in train_state(tmp_path).set_aside] == ["step-00000004", "step-00000006"]
    assert resume_checkpoint(tmp_path, log=said.append) == saved[2] and len(said) == 2  # found once, said once


def test_rotation_leaves_a_set_aside_checkpoint_alone(tmp_path):
    saved = {step: save(tmp_path, step, keep_last=9) for step in (2, 4)}
    assert set_aside(saved[4], "first").name == "step-00000004.damaged"
    save(tmp_path, 4, keep_last=9)  # trained again, damaged again
    assert set_aside(saved[4], "second").name == "step-00000004.damaged-2"
    for step in (6, 8, 10):
        save(tmp_path, step, keep_last=1)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004.damaged", "step-00000004.damaged-2", "step-00000010"]
    assert [r["reason"] for r in train_state(tmp_path).set_aside] == ["first", "second"]
    assert rotate_checkpoints(tmp_path, keep_last=1) == []


def test_every_checkpoint_damaged_is_an_error_naming_them_then_a_fresh_start(tmp_path):
    for step in (2, 4):
        damage(save(tmp_path, step), "optimizer.pt")
    said = []
    with pytest.raises(
        AllCheckpointsDamagedError,
        match=re.escape("every complete checkpoint is damaged (step-00000004, step-00000002)"),
    ):
        resume_checkpoint(tmp_path, log=said.append)
    assert all(line.endswith("; no complete checkpoint verifies") for line in said) and len(said) == 2
    assert resume_checkpoint(tmp_path, log=said.append) is None  # what the re-run the error advises sees


def test_a_checkpoint_from_before_checksums_is_taken_and_said_to_be_unverified(tmp_path):
    path = save(tmp_path, 2)
    (path / "COMPLETE").write_text("2\n")
    said = []
    assert resume_checkpoint(tmp_path, log=said.append) == path
    assert said == [
        f"checkpoint {path}: its COMPLETE marker holds no checksums (written before eyas checkpoints carried them); "
        "its files are loaded unverified"
    ]


def test_a_damaged_best_is_never_exported_the_next_best_is_and_best_moves(tmp_path):
    saved = evaluated(tmp_path, {2: 1.5, 4: 1.9, 6: 2.4, 8: 1.7})
    assert read_best(tmp_path)["checkpoint"] == "step-00000006"
    damage(saved[6])
    said = []
    assert export_choice(tmp_path, "best", log=said.append) == saved[4]
    assert len(said) == 1 and said[0].startswith("checkpoint step-00000006 is damaged: model.safetensors has")
    assert said[0].endswith(
        "exporting step-00000004 instead, the best evaluated checkpoint that verifies (BEST names it now)"
    )
    assert read_best(tmp_path) == {"checkpoint": "step-00000004", "step": 4, "tau_estimate": 1.9}


def test_a_damaged_best_without_another_evaluated_checkpoint_exports_the_newest(tmp_path):
    saved = evaluated(tmp_path, {2: 2.0})
    newest = save(tmp_path, 4)  # not evaluated
    damage(saved[2], "arch.json")
    said = []
    assert export_choice(tmp_path, "best", log=said.append) == newest
    assert said[0].endswith("exporting step-00000004 instead, the newest complete checkpoint that verifies (none "
                            "evaluated is left)")  # fmt: skip
    assert read_best(tmp_path) is None


def test_export_checks_the_files_it_reads_only(tmp_path):
    older, newest = save(tmp_path, 2), save(tmp_path, 4)
    damage(newest, "optimizer.pt")  # the exported weights do not come from it: a resume sets it aside
    said = []
    assert export_choice(tmp_path, "last", log=said.append) == newest and said == []
    damage(newest, "trainer_state.json")
    assert export_choice(tmp_path, "last", log=said.append) == older
    assert said[0].endswith("exporting step-00000002 instead, the newest older complete checkpoint that verifies")
    assert latest_complete(tmp_path) == older
    with pytest.raises(ValueError, match=re.escape("export.checkpoint='first': expected 'best' or 'last'")):
        export_choice(tmp_path, "first", log=said.append)


def test_the_damage_record_says_why(tmp_path):
    path = save(tmp_path, 2)
    save(tmp_path, 4)
    damage(tmp_path / "checkpoints" / "step-00000004")
    resume_checkpoint(tmp_path, log=lambda line: None)
    record = json.loads((tmp_path / "checkpoints" / "step-00000004.damaged" / "DAMAGED.json").read_text())
    assert record["checkpoint"] == "step-00000004" and record["set_aside_at"]
    assert record["reason"].startswith(f"checkpoint {path.parent / 'step-00000004'}: model.safetensors has checksum")
