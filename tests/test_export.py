"""Export of a training checkpoint to SGLang's format, and loading the export back."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from draft_fixtures import ARCH, AUX_IDS, write_checkpoint
from safetensors.torch import load_file, save_file

from eyas.dataset.vocab import VocabMappingError
from eyas.draft import DraftArch, build_draft
from eyas.draft_keys import KeyCheckError
from eyas.export.convert import convert_checkpoint, export_sglang
from eyas.export.drafter_dir import ExportError, read_export_provenance
from eyas.export.keys import expected_shapes
from eyas.export.reader import load_exported_draft
from eyas.train.checkpoint import CheckpointError, read_checkpoint


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "step-00000010")


def test_export_writes_the_exact_sglang_key_set_and_config(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export")
    tensors = load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_shapes("sglang", ARCH)
    config = json.loads((out / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": 2048,
        "draft_vocab_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "target_hidden_size": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True},
    }
    assert read_export_provenance(out)["aux_layer_ids"] == AUX_IDS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "step-00000010"]


def test_round_trip_gives_identical_weights_and_outputs(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export")
    source = read_checkpoint(ckpt)
    draft = load_exported_draft(out, source.state["embed_tokens.weight"])
    assert draft.aux_layer_ids == AUX_IDS
    loaded = draft.state_dict()
    assert set(loaded) == set(source.state)
    for k, v in source.state.items():
        assert torch.equal(loaded[k], v), k
    original = build_draft(ARCH, source.state["embed_tokens.weight"], source.state["d2t"], source.state["t2d"])
    original.load_state_dict(source.state, strict=True)
    ids = torch.randint(0, 2048, (2, 9), generator=torch.Generator().manual_seed(0))
    aux = torch.randn(2, 9, 192, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for (_, a), (_, b) in zip(original.unroll(ids, aux, 3), draft.unroll(ids, aux, 3)):
            assert torch.equal(a, b)


def test_export_to_bfloat16_casts_weights_only(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export", dtype="bfloat16")
    tensors = load_file(out / "model.safetensors")
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_refuses_absolute_d2t(tmp_path):
    def absolute(state):
        state["d2t"] = state["d2t"] + torch.arange(512)

    ckpt = write_checkpoint(tmp_path / "ckpt", state_edit=absolute)
    with pytest.raises(VocabMappingError) as err:
        export_sglang(ckpt, tmp_path / "export")
    assert str(err.value) == (
        f"checkpoint {ckpt}: d2t holds absolute target ids, expected offsets (target_id = i + d2t[i]); "
        "store d2t = target_ids - arange(draft_vocab_size)"
    )
    assert not (tmp_path / "export").exists()


def test_export_refuses_t2d_count_mismatch(tmp_path):
    def extra(state):
        state["t2d"][int(torch.nonzero(~state["t2d"])[0])] = True

    ckpt = write_checkpoint(tmp_path / "ckpt", state_edit=extra)
    with pytest.raises(VocabMappingError) as err:
        export_sglang(ckpt, tmp_path / "export")
    assert str(err.value) == (
        f"checkpoint {ckpt}: t2d marks 513 target ids, d2t has 512, expected draft_vocab_size=512; the vocab "
        "mapping does "
        "not belong to this draft: rebuild it with the same draft_vocab_size"
    )


def test_export_refuses_d2t_of_another_vocabulary(tmp_path):
    def shifted(state):
        state["d2t"][5] += 1

    ckpt = write_checkpoint(tmp_path / "ckpt", state_edit=shifted)
    with pytest.raises(VocabMappingError, match=r"arange \+ d2t differs from nonzero\(t2d\) first at draft id 5 "):
        export_sglang(ckpt, tmp_path / "export")


def test_export_refuses_an_incomplete_checkpoint(ckpt, tmp_path):
    (ckpt / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: no COMPLETE marker; it was not written completely"):
        export_sglang(ckpt, tmp_path / "export")


def test_export_refuses_unexpected_checkpoint_keys(tmp_path):
    def renamed(state):
        state["layers.0.mlp.up_proj.weight"] = state.pop("midlayer.mlp.up_proj.weight")

    ckpt = write_checkpoint(tmp_path / "ckpt", state_edit=renamed)
    with pytest.raises(CheckpointError) as err:
        export_sglang(ckpt, tmp_path / "export")
    assert "  missing: midlayer.mlp.up_proj.weight (expected shape [128, 64])\n" in str(err.value)
    assert "  unexpected: layers.0.mlp.up_proj.weight (shape [128, 64])\n" in str(err.value)


def test_two_aux_layers_export_for_sglang_0_5_12_and_newer_only(tmp_path):
    arch = DraftArch(**{**ARCH.to_dict(), "num_aux": 2})
    ckpt = write_checkpoint(tmp_path / "ckpt", arch=arch, aux_ids=[2, 4])
    with pytest.raises(ExportError, match=r"num_aux=2, expected 3 for SGLang >= 0.5.10: SGLang before 0.5.12"):
        export_sglang(ckpt, tmp_path / "export")
    tensors, files = convert_checkpoint(read_checkpoint(ckpt), "sglang-0.5.12", None)
    assert tensors["fc.weight"].shape[1] == 2 * ARCH.hidden_size
    assert files["config.json"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3]
    with pytest.raises(ExportError, match=r"num_aux=2, expected 3: EAGLE official builds fc for exactly 3"):
        convert_checkpoint(read_checkpoint(ckpt), "eagle", None)


def test_export_replaces_an_earlier_export_but_not_other_directories(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export")
    (out / "stale.txt").write_text("x")
    export_sglang(ckpt, out)
    assert not (out / "stale.txt").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match=r"exists, is not empty and holds no eyas_export.json"):
        export_sglang(ckpt, other)
    assert (other / "keep.txt").exists()


KILL_BEFORE_RENAME = """
import os, signal, sys
import eyas.export.drafter_dir as d
from eyas.export.convert import export_sglang
d.replace_dir = lambda tmp, final: os.kill(os.getpid(), signal.SIGKILL)  # killed with the drafter written aside
export_sglang(sys.argv[1], sys.argv[2])
"""


def test_partial_export_of_a_killed_run_is_removed_by_the_next_one(ckpt, tmp_path, capsys):
    """A process SIGKILLed inside the export, its drafter written to the temporary but not yet renamed into
    place: the next export removes that temporary (and says so), and leaves the one of a live export alone."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "export"
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", KILL_BEFORE_RENAME, str(ckpt), str(out)], env=env, cwd=repo)
    assert killed.returncode == -signal.SIGKILL
    [partial] = tmp_path.glob(".export.tmp-*")
    assert (partial / "model.safetensors").is_file() and not out.exists()
    live = tmp_path / f".export.tmp-{os.getppid()}"  # another export still writing
    live.mkdir()
    export_sglang(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".export.tmp-" + str(os.getppid()), "export", ckpt.name]
    )
    assert f"removed {partial.name}, a partial export left by process {partial.name.split('-')[-1]}, which is gone" in (
        capsys.readouterr().out
    )


def test_load_refuses_missing_and_unexpected_keys(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export")
    tensors = load_file(out / "model.safetensors")
    tensors["layers.0.hidden_norm.weight"] = tensors.pop("midlayer.hidden_norm.weight")
    del tensors["d2t"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(KeyCheckError) as err:
        load_exported_draft(out, torch.zeros(2048, 64))
    lines = str(err.value).splitlines()
    assert lines[:4] == [
        f"{out}/model.safetensors (sglang format): key set differs from the expected one",
        "  missing: d2t (expected shape [512])",
        "  missing: midlayer.hidden_norm.weight (expected shape [64])",
        "  unexpected: layers.0.hidden_norm.weight (shape [64])",
    ]


def test_load_refuses_an_embedding_of_another_target(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export")
    with pytest.raises(ExportError, match=r"target embedding: shape \[4096, 64\], expected \[2048, 64\]"):
        load_exported_draft(out, torch.zeros(4096, 64))


def test_load_refuses_a_config_without_draft_vocab_size(ckpt, tmp_path):
    out = export_sglang(ckpt, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    del config["draft_vocab_size"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError) as err:
        load_exported_draft(out, torch.zeros(2048, 64))
    assert str(err.value) == (
        f"{out}/config.json (sglang format): draft_vocab_size: absent; SGLang then replaces the trained "
        "lm_head with the target's and the draft predicts over the full vocab: write draft_vocab_size explicitly "
        "(eyas remap)"
    )
