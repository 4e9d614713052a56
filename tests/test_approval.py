"""Approval records and overrides (eyas.gate.approval), without Prefect."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from eyas.config import load_run_config
from eyas.gate.approval import apply_overrides, ignored_overrides, read_approval, write_approval


@pytest.fixture
def config(tmp_path, tiny_target_dir):
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    return base.model_copy(update={"workdir": str(tmp_path / "run")})


def record_for(config, **fields) -> dict:
    from eyas.gate.approval import gate_fingerprint

    return {
        "approve": True,
        "reviewer": "ada",
        "note": "",
        "overrides": {},
        "decided_at": "now",
        "config_fingerprint": gate_fingerprint(config),
        **fields,
    }


def test_overrides_change_only_the_training_section(config):
    approved = apply_overrides(config, {"num_epochs": 2, "lr": 0.01})
    assert (approved.train.num_epochs, approved.train.lr) == (2, 0.01)
    assert approved.model_dump(exclude={"train"}) == config.model_dump(exclude={"train"})


def test_override_outside_the_allowed_fields_is_an_error(config):
    with pytest.raises(ValueError, match=r"overrides \['global_batch_size'\] are not allowed at the gate"):
        apply_overrides(config, {"global_batch_size": 4})


def test_override_is_validated_like_the_config(config):
    with pytest.raises(ValidationError, match="num_epochs"):
        apply_overrides(config, {"num_epochs": 0})


def test_lr_override_is_ignored_when_training_resumes_from_a_checkpoint(config):
    assert ignored_overrides(config, {"lr": 0.01}, num_samples=64) == []
    checkpoint = config.paths.train_dir / "checkpoints" / "step-00000010"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    [problem] = ignored_overrides(config, {"lr": 0.01}, num_samples=64)
    assert problem.startswith(f"train.lr=0.01 would be ignored: training resumes from {checkpoint}")


def test_epochs_override_is_ignored_when_max_steps_ends_the_run(config):
    capped = config.model_copy(update={"train": config.train.model_copy(update={"max_steps": 5})})
    [problem] = ignored_overrides(capped, {"num_epochs": 40}, num_samples=640)
    assert "train.num_epochs=40 would be ignored: train.max_steps=5 ends the run at 5 steps either way" in problem
    assert ignored_overrides(config, {"num_epochs": 40}, num_samples=640) == []


def test_recorded_approval_holds_only_for_the_same_configuration(config):
    assert read_approval(config) is None
    write_approval(config, record_for(config, overrides={"num_epochs": 2}))
    assert read_approval(config)["overrides"] == {"num_epochs": 2}
    changed = config.model_copy(update={"draft": config.draft.model_copy(update={"intermediate_size": 256})})
    assert read_approval(changed) is None
    unrelated = config.model_copy(update={"bench": config.bench.model_copy(update={"num_prompts": 3})})
    assert read_approval(unrelated) is not None


def test_rejection_record_is_not_an_approval(config):
    (config.paths.root).mkdir(parents=True)
    (config.paths.root / "approval.json").write_text(json.dumps(record_for(config, approve=False)))
    assert read_approval(config) is None
