"""`eyas remap`: conversion between formats through the eyas form, strictly checked, bit-identical."""

from __future__ import annotations

import json

import pytest
import torch
from draft_fixtures import ARCH, AUX_IDS, write_checkpoint
from safetensors.torch import load_file, save_file

from eyas.export.convert import export_checkpoint
from eyas.export.drafter_dir import ExportError
from eyas.export.inspect import inspect_drafter
from eyas.export.keys import FORMATS, KeyCheckError, expected_shapes
from eyas.export.reader import load_exported_draft, read_drafter
from eyas.export.remap import remap_checkpoint
from eyas.train.checkpoint import read_checkpoint
from eyas_cli.main import main

EAGLE_IDS = [2, 4, 5]  # the EAGLE default [2, N//2, N-3] of an 8-layer target


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("remap") / "step-00000010", aux_ids=EAGLE_IDS)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_eyas_to_format_and_back_is_bit_identical(ckpt, tmp_path, fmt):
    source = read_checkpoint(ckpt)
    out = remap_checkpoint(ckpt, tmp_path / fmt, to=fmt)
    assert {k: tuple(v.shape) for k, v in load_file(out / "model.safetensors").items()} == expected_shapes(fmt, ARCH)
    back = remap_checkpoint(out, tmp_path / "back", to="eyas", embed_from=ckpt / "model.safetensors")
    restored = read_checkpoint(back)
    assert restored.arch == source.arch and restored.aux_layer_ids == AUX_IDS
    assert restored.state.keys() == source.state.keys()
    for k, v in source.state.items():
        assert v.dtype == restored.state[k].dtype and torch.equal(v, restored.state[k]), k
    assert inspect_drafter(out, num_target_layers=8).problems == []


@pytest.mark.parametrize("fmt", sorted(set(FORMATS) - {"eyas"}))
def test_every_export_loads_into_the_reference_engine(ckpt, tmp_path, fmt):
    source = read_checkpoint(ckpt)
    out = export_checkpoint(ckpt, tmp_path / fmt, to=fmt)
    draft = load_exported_draft(out, source.state["embed_tokens.weight"])
    assert draft.aux_layer_ids == EAGLE_IDS
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in source.state.items())


def test_format_to_format_goes_through_eyas(ckpt, tmp_path):
    spec = remap_checkpoint(ckpt, tmp_path / "spec", to="speculators")
    sglang = remap_checkpoint(spec, tmp_path / "sglang", to="sglang")
    direct = export_checkpoint(ckpt, tmp_path / "direct", to="sglang")
    a, b = load_file(sglang / "model.safetensors"), load_file(direct / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((sglang / "config.json").read_text()) == json.loads((direct / "config.json").read_text())


def test_remap_to_eyas_without_an_embedding_names_the_fix(ckpt, tmp_path):
    out = export_checkpoint(ckpt, tmp_path / "sglang", to="sglang")
    with pytest.raises(ExportError) as err:
        remap_checkpoint(out, tmp_path / "eyas", to="eyas")
    assert str(err.value) == (
        f"checkpoint {out}: no embed_tokens.weight, expected one for format 'eyas' (it stores the embedding); "
        "the source format dropped it: pass embed_from (eyas remap --embed-from TARGET_WEIGHTS.safetensors)"
    )


def test_remap_takes_the_embedding_of_a_wrapped_target_from_its_file_or_its_directory(ckpt, tmp_path):
    """Kimi-K2.5 keeps its text model under `language_model.`, its embedding in one of many shards beside the
    vision tower's tensors: --embed-from takes that shard, or the target's directory (the shard found there)."""
    source = read_checkpoint(ckpt)
    out = export_checkpoint(ckpt, tmp_path / "sglang", to="sglang")
    target = tmp_path / "kimi"
    target.mkdir()
    embed = source.state["embed_tokens.weight"]
    save_file({"vision_tower.encoder.blocks.0.norm0.weight": torch.ones(8)}, target / "model-00001-of-00002.safetensors")
    save_file({"language_model.model.embed_tokens.weight": embed, "language_model.model.layers.3.embed_tokens.weight":
               torch.zeros_like(embed)}, target / "model-00002-of-00002.safetensors")  # fmt: skip
    for embed_from in (target / "model-00002-of-00002.safetensors", target):
        back = remap_checkpoint(out, tmp_path / "back", to="eyas", embed_from=embed_from)
        assert torch.equal(read_checkpoint(back).state["embed_tokens.weight"], embed), embed_from
    with pytest.raises(ExportError) as err:
        remap_checkpoint(out, tmp_path / "x", to="eyas", embed_from=tmp_path / "sglang")
    assert str(err.value) == (
        f"embed_from {tmp_path / 'sglang'}: a directory whose *.safetensors hold no *embed_tokens.weight; expected "
        "the target's model directory or the weights file that holds its input embedding"
    )


def test_remap_from_eagle_needs_the_target_layer_count(ckpt, tmp_path):
    out = export_checkpoint(ckpt, tmp_path / "eagle", to="eagle")
    (out / "eyas_export.json").unlink()
    with pytest.raises(ExportError, match=r"eagle format, whose layer ids are fixed in the target's code"):
        remap_checkpoint(out, tmp_path / "sglang", to="sglang")
    sglang = remap_checkpoint(out, tmp_path / "sglang", to="sglang", num_target_layers=8)
    ids = json.loads((sglang / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, 3, 4]


def test_eagle_export_refuses_non_default_layer_ids(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", aux_ids=[1, 4, 5])
    with pytest.raises(ExportError) as err:
        export_checkpoint(ckpt, tmp_path / "eagle", to="eagle")
    assert str(err.value) == (
        f"checkpoint {ckpt}: aux_layer_ids=[1, 4, 5] (hf_hidden_states): the eagle format cannot carry them; "
        "EAGLE official captures the fixed layers [2, N//2, N-3] of an N-layer target; train with the default ids "
        "or export to sglang, vllm or speculators"
    )


def test_remap_refuses_a_source_with_a_wrong_key_set(ckpt, tmp_path):
    out = export_checkpoint(ckpt, tmp_path / "vllm", to="vllm")
    tensors = load_file(out / "model.safetensors")
    tensors["extra.weight"] = tensors.pop("norm.weight")
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(KeyCheckError) as err:
        remap_checkpoint(out, tmp_path / "x", to="sglang")
    assert str(err.value).splitlines()[:3] == [
        f"{out}/model.safetensors (vllm format): key set differs from the expected one",
        "  missing: norm.weight (expected shape [64])",
        "  unexpected: extra.weight (shape [64])",
    ]


def test_remap_cli_converts_and_reports(ckpt, tmp_path, capsys):
    assert main(["remap", str(ckpt), str(tmp_path / "spec"), "--to", "speculators", "--dtype", "bfloat16"]) == 0
    assert load_file(tmp_path / "spec" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    assert "(speculators); key set and shapes checked" in capsys.readouterr().out
    assert main(["remap", str(tmp_path / "spec"), str(tmp_path / "sglang"), "--to", "sglang"]) == 0
    assert main(["remap", str(tmp_path / "sglang"), str(tmp_path / "e"), "--to", "eyas"]) == 2
    assert "no embed_tokens.weight, expected one for format 'eyas'" in capsys.readouterr().err
    assert main(["remap", str(ckpt), str(tmp_path / "t"), "--to", "tgi"]) == 2


def test_read_drafter_detects_every_format(ckpt, tmp_path):
    for fmt in sorted(FORMATS):
        out = remap_checkpoint(ckpt, tmp_path / fmt, to=fmt)
        assert read_drafter(out, num_target_layers=8)[0].format == fmt
