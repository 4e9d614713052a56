"""The catalog: one test per checkpoint/config silent failure in ARCHITECTURE's "Facts from the field".

Each builds the broken drafter from a clean export and asserts the exact message `eyas inspect`
(headers and JSON only) gives for it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from draft_fixtures import write_checkpoint
from safetensors.torch import load_file, save_file

from eyas.export.convert import export_checkpoint
from eyas.export.drafter_dir import ExportError
from eyas.export.inspect import inspect_drafter
from eyas.export.remap import remap_checkpoint
from eyas_cli.main import main


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    return export_checkpoint(write_checkpoint(root / "step-00000010"), root / "sglang", to="sglang")


@pytest.fixture
def export(clean, tmp_path):
    return shutil.copytree(clean, tmp_path / "export")


def edit_tensors(out, edit):
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))


def edit_config(out, edit):
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))


def why_lines(report):
    return [line for p in report.problems for line in p.splitlines() if line.startswith("  why: ")]


def test_layers_0_keys_are_dropped_by_sglang_0_5_11(export, capsys):
    edit_tensors(export, lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t)}))
    report = inspect_drafter(export, engine="sglang<=0.5.11")
    assert why_lines(report) == [
        "  why: SGLang <= 0.5.11 silently drops layers.0.* and runs the midlayer with random weights: "
        "rename them to midlayer.* (eyas remap --to sglang)",
        "  why: midlayer tensors are missing: the engine keeps their random init without a word "
        "(SGLang never reports unfilled parameters): re-export from the training checkpoint",
    ]
    assert main(["inspect", str(export), "--engine", "sglang<=0.5.11"]) == 1
    assert "loads completely in sglang<=0.5.11: NO" in capsys.readouterr().out


def test_missing_d2t_with_a_smaller_draft_vocab(export):
    edit_tensors(export, lambda t: t.pop("d2t"))
    report = inspect_drafter(export)
    assert "  missing: d2t (expected shape [512])" in report.problems[0].splitlines()
    assert why_lines(report) == [
        "  why: without d2t the draft's token ids are not mapped to target ids when draft_vocab_size < vocab_size "
        "(acceptance about 1.1): export d2t (offsets) with the weights"
    ]


def test_d2t_holding_absolute_ids(export):
    edit_tensors(export, lambda t: t.update(d2t=t["d2t"] + torch.arange(512)))
    assert inspect_drafter(export).problems == [
        "d2t holds absolute target ids, expected offsets (target_id = i + d2t[i]); "
        "store d2t = target_ids - arange(draft_vocab_size)"
    ]


def test_t2d_count_differs_from_draft_vocab_size(export):
    def extra(t):
        t["t2d"][int(torch.nonzero(~t["t2d"])[0])] = True

    edit_tensors(export, extra)
    assert inspect_drafter(export).problems == [
        "t2d marks 513 target ids, d2t has 512, expected draft_vocab_size=512; the vocab mapping does not belong "
        "to this draft: rebuild it with the same draft_vocab_size"
    ]


@pytest.mark.parametrize("state", ["absent", "null"])
def test_missing_or_null_draft_vocab_size(export, state):
    edit_config(export, lambda c: c.pop("draft_vocab_size") if state == "absent" else c.update(draft_vocab_size=None))
    assert inspect_drafter(export).problems == [
        f"draft_vocab_size: {state}; SGLang then replaces the trained lm_head with the target's and the draft "
        "predicts over the full vocab: write draft_vocab_size explicitly (eyas remap)"
    ]
    with pytest.raises(ExportError, match=rf"\(sglang format\): draft_vocab_size: {state}; SGLang then replaces"):
        remap_checkpoint(export, export.parent / "out", to="vllm")


def test_tie_word_embeddings_true(export):
    edit_config(export, lambda c: c.update(tie_word_embeddings=True))
    assert inspect_drafter(export).problems == [
        "tie_word_embeddings is True, expected false: the engine would tie the draft's lm_head to the embedding "
        "and discard the trained head; re-export"
    ]


def test_embed_tokens_saved_where_the_engine_replaces_it(export):
    edit_tensors(export, lambda t: t.update({"embed_tokens.weight": torch.zeros(2048, 64)}))
    report = inspect_drafter(export)
    assert "  unexpected: embed_tokens.weight (shape [2048, 64])" in report.problems[0].splitlines()
    assert why_lines(report) == [
        "  why: the engine replaces the draft's embed_tokens with the target's (SGLang always): a trained "
        "embedding would be discarded, a frozen copy is dead weight: drop it (eyas remap)"
    ]


def test_layer_ids_in_the_wrong_convention_against_the_provenance(export):
    edit_config(export, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert inspect_drafter(export).problems == [
        "aux layer ids [2, 4, 5] (sglang_llama), expected [1, 3, 4]: eyas_export.json records canonical ids "
        "[2, 4, 5], which are [1, 3, 4] in sglang_llama; the config was written in another convention (SGLang "
        "Llama/Qwen eagle_config ids: SGLang captures the input of layer id+1): re-export with eyas remap"
    ]


def test_layer_ids_in_the_wrong_convention_against_the_target_layer_count(export):
    (export / "eyas_export.json").unlink()
    edit_config(export, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 7]))
    assert inspect_drafter(export, num_target_layers=8).problems == [
        "aux layer ids (canonical [3, 5, 8]): [8] fall outside 1..7, what sglang can capture of a 8-layer target "
        "(N = the final state only for speculators): the ids are in another convention or for another target, or "
        "the destination cannot serve them"
    ]
    edit_config(export, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert inspect_drafter(export, num_target_layers=8).problems == [
        "aux layer ids [2, 4, 5] (sglang_llama) equal the canonical default [2, 4, 5] of a 8-layer target, but "
        "sglang_llama expects [1, 3, 4] for those layers: canonical ids were written without conversion; "
        "re-export with eyas remap"
    ]


def test_norm_options_the_engine_ignores(export):
    edit_config(export, lambda c: c.update(norm_before_residual=True))
    assert inspect_drafter(export).problems == [
        "norm_before_residual: no SGLang version runs it (checked 0.5.10-0.5.23); SGLang would run the draft "
        "without it, a layer it was not trained with: serve it with vLLM or speculators, or retrain without it"
    ]
    with pytest.raises(ExportError, match=r"norm_before_residual: no SGLang version runs it"):
        remap_checkpoint(export, export.parent / "out", to="speculators")


def test_missing_midlayer_tensors_keep_their_random_init(export):
    edit_tensors(export, lambda t: t.pop("midlayer.mlp.down_proj.weight"))
    report = inspect_drafter(export)
    assert report.problems[0].splitlines()[1] == "  missing: midlayer.mlp.down_proj.weight (expected shape [64, 128])"
    assert why_lines(report) == [
        "  why: midlayer tensors are missing: the engine keeps their random init without a word "
        "(SGLang never reports unfilled parameters): re-export from the training checkpoint"
    ]


def test_use_aux_hidden_state_false(export):
    edit_config(export, lambda c: c["eagle_config"].update(use_aux_hidden_state=False))
    assert inspect_drafter(export).problems == [
        "use_aux_hidden_state: false, expected true: SGLang does not capture the aux hidden states when it is "
        "false and the draft's fc sees the wrong features: re-export"
    ]


def test_speculators_config_without_norm_before_residual(clean, tmp_path):
    src = clean.parent / "step-00000010"
    out = export_checkpoint(src, tmp_path / "spec", to="speculators")
    edit_config(out, lambda c: c.pop("norm_before_residual"))
    assert inspect_drafter(out).problems == [
        "norm_before_residual: absent; vLLM reads an absent norm_before_residual of a speculators config as true: "
        "write norm_before_residual: false explicitly (eyas remap --to speculators)"
    ]


def test_inspect_does_not_import_torch(clean):
    import subprocess
    import sys

    code = (
        "import sys; from eyas.export.inspect import inspect_drafter; "
        f"r = inspect_drafter({str(clean)!r}); assert r.ok, r.problems; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
