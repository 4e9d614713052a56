"""The low-tau diagnosis: every known cause injected into a healthy setup is named by its check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from draft_fixtures import AUX_IDS, train_and_export, write_shards
from safetensors.torch import load_file, save_file

from eyas.bench.diagnose import diagnose
from eyas.bench.reference import load_target_float64
from eyas.target import target_fingerprint


@pytest.fixture(scope="module")
def healthy(random_target_dir, tmp_path_factory):
    """(target, export, shards) of a draft fitted briefly to its shards (step-0 accuracy about 0.17, random: 0.0)."""
    root = tmp_path_factory.mktemp("diagnose")
    model = load_target_float64(random_target_dir)
    fingerprint = target_fingerprint(random_target_dir)
    write_shards(root / "shards", model, fingerprint)
    export = train_and_export(root, model, root / "shards", fingerprint, num_steps=25)
    return random_target_dir, export, root / "shards"


@pytest.fixture
def setup(healthy, tmp_path):
    target, export, shards = healthy
    shutil.copytree(export, tmp_path / "export")
    shutil.copytree(shards, tmp_path / "shards")
    return target, tmp_path / "export", tmp_path / "shards"


def run(setup, tau=1.0, **kw):
    target, export, shards = setup
    report = diagnose(
        export_dir=export, shards_dir=shards, target_path=target, tau=tau, steps=2, min_accuracy=0.1, **kw
    )
    return report, {c.name: c for c in report.checks}


def edit_config(export: Path, edit) -> None:
    config = json.loads((export / "config.json").read_text())
    edit(config)
    (export / "config.json").write_text(json.dumps(config))


def edit_weights(export: Path, edit) -> None:
    tensors = load_file(export / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(export / "model.safetensors"))


def test_healthy_draft_with_tau_one_points_at_the_serving_side(setup):
    report, checks = run(setup, tau=1.02)
    assert [c.name for c in report.failed] == []
    assert checks["launch_flags"].passed is None
    assert "the serving side is wrong" in report.conclusion, checks["teacher_forced_accuracy"].detail
    assert "| teacher_forced_accuracy | passed |" in report.to_markdown()


def test_h_wide_shards_are_named(setup, random_target_dir, tmp_path):
    target, export, shards = setup
    shutil.rmtree(shards)
    write_shards(shards, load_target_float64(random_target_dir), "fp", narrow=True)
    report, checks = run(setup)
    assert not checks["shard_widths"].passed
    assert (
        "aux_hidden_states width 64, last_hidden_states 64; expected 192 (3 layers x 64)"
        in checks["shard_widths"].detail
    )
    assert "the draft bypasses fc" in checks["shard_widths"].detail
    assert report.conclusion.startswith("failed checks: shard_widths")


def test_a_dropped_key_is_named(setup):
    edit_weights(setup[1], lambda t: t.pop("midlayer.mlp.up_proj.weight"))
    _, checks = run(setup)
    assert not checks["export_key_set"].passed
    assert "missing: midlayer.mlp.up_proj.weight" in checks["export_key_set"].detail


def test_a_missing_d2t_is_named(setup):
    edit_weights(setup[1], lambda t: t.pop("d2t"))
    _, checks = run(setup)
    assert not checks["d2t_offsets"].passed and "no d2t/t2d" in checks["d2t_offsets"].detail


def test_absolute_d2t_ids_are_named(setup):
    edit_weights(setup[1], lambda t: t.update(d2t=t["t2d"].nonzero().flatten()))
    _, checks = run(setup)
    assert not checks["d2t_offsets"].passed
    assert "d2t holds absolute target ids, expected offsets" in checks["d2t_offsets"].detail


def test_an_implicit_draft_vocab_size_is_named(setup):
    edit_config(setup[1], lambda c: c.pop("draft_vocab_size"))
    report, checks = run(setup)
    assert not checks["draft_vocab_size_explicit"].passed
    assert "SGLang swaps the trained lm_head" in checks["draft_vocab_size_explicit"].detail
    assert "draft_vocab_size_explicit" in report.conclusion


def test_layer_ids_in_the_wrong_convention_are_named(setup):
    edit_config(setup[1], lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=AUX_IDS))
    _, checks = run(setup)
    assert not checks["layer_id_convention"].passed
    assert (
        "[2, 4, 5] (sglang_llama) = hidden_states [3, 5, 6], shards extracted at [2, 4, 5]"
        in checks["layer_id_convention"].detail
    )


def test_eagle_instead_of_eagle3_is_named(setup):
    argv = ["python", "-m", "sglang.launch_server", "--model-path", "t", "--speculative-algorithm", "EAGLE"]
    argv += ["--speculative-draft-model-path", str(setup[1]), "--speculative-num-steps", "3"]
    argv += ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    report, checks = run(setup, launch_argv=argv)
    assert not checks["launch_flags"].passed
    assert "--speculative-algorithm EAGLE, expected EAGLE3" in checks["launch_flags"].detail
    assert report.conclusion == "failed checks: launch_flags; fix these first"


def test_an_untrained_draft_is_named_weak(healthy, random_target_dir, tmp_path):
    target, _, shards = healthy
    model = load_target_float64(random_target_dir)
    export = train_and_export(tmp_path, model, shards, target_fingerprint(random_target_dir), num_steps=0)
    report, checks = run((target, export, shards), tau=1.0)
    assert not checks["teacher_forced_accuracy"].passed
    assert "the draft is weak" in checks["teacher_forced_accuracy"].detail
    assert report.conclusion.startswith("every file check passed but the draft is weak")
