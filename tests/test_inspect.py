"""`eyas inspect`: the audit reads headers and config, and every float weight for NaN/inf, and names every problem;
`--target T` refuses a drafter that does not fit T; without it, layer ids are read in the numbering eyas's export
recorded."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from draft_fixtures import write_checkpoint
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file, save_file

from eyas.export.configs import TargetRef
from eyas.export.convert import export_sglang
from eyas.export.finite import nonfinite_problems
from eyas.export.inspect import inspect_drafter
from eyas.export.reader import read_drafter
from eyas_cli.main import main

KIMI_WRAPPER = "KimiK25ForConditionalGeneration"


def write_target(out: Path, *, layers: int = 8, hidden: int = 64, vocab: int = 2048, kimi: bool = False) -> Path:
    """A target as inspect reads it: config.json (a Llama's, or the Kimi-K2.5 wrapper's with its text model in
    text_config) and a weight file holding only the input embedding (under the wrapper's prefix for Kimi)."""
    out.mkdir(parents=True)
    text = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers}
    text.update(hidden_size=hidden, vocab_size=vocab)
    embed = "model.embed_tokens.weight"
    if kimi:
        text.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
        config, embed = (
            {"architectures": [KIMI_WRAPPER], "model_type": "kimi_k25", "text_config": text},
            f"language_model.{embed}",
        )
    (out / "config.json").write_text(json.dumps(config if kimi else text))
    save_numpy({embed: np.zeros((vocab, hidden), np.float16)}, str(out / "model.safetensors"))
    return out


def test_clean_export_has_no_problems(tmp_path, capsys):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    report = inspect_drafter(out)
    assert report.format == "sglang" and report.ok
    assert report.shapes["fc.weight"] == (64, 192)
    assert main(["inspect", str(out)]) == 0
    assert "no problems found" in capsys.readouterr().out


def test_training_checkpoint_is_recognised(tmp_path):
    report = inspect_drafter(write_checkpoint(tmp_path / "step-00000010"))
    assert report.format == "eyas" and report.ok


def test_layers_0_keys_are_reported_for_sglang(tmp_path, capsys):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    tensors = load_file(out / "model.safetensors")
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"))
    assert inspect_drafter(out).problems == [
        "eyas_export.json says format 'sglang', the files read as 'sglang-0.5.12': they were edited after the "
        "export; re-export (eyas remap) rather than editing keys or config by hand"
    ]
    (out / "eyas_export.json").unlink()  # as if written by another tool
    report = inspect_drafter(out, engine="sglang<=0.5.11")
    assert report.format == "sglang-0.5.12" and not report.ok
    assert report.engines == {
        "sglang<=0.5.11": False,
        "sglang>=0.5.12": True,
        "sglang>=0.5.17": True,
        "vllm": True,
        "speculators>=0.9": False,
    }
    assert "midlayer.self_attn.q_proj.weight" in report.problems[0]
    assert "layers.0.self_attn.q_proj.weight" in report.problems[0]
    assert main(["inspect", str(out)]) == 0
    assert main(["inspect", str(out), "--engine", "sglang<=0.5.11"]) == 1


def test_tied_embeddings_are_reported(tmp_path):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    report = inspect_drafter(out)
    assert report.problems == [
        "tie_word_embeddings is True, expected false: the engine would tie the draft's lm_head to the "
        "embedding and discard the trained head; re-export"
    ]


def test_report_lists_keys_config_and_engines(tmp_path, capsys):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    assert main(["inspect", str(out), "--engine", "sglang<=0.5.11"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == f"{out}: format sglang, 15 tensors, written by eyas 0.1.0 (export, eyas_export.json)"
    assert "  draft options: none (plain EAGLE-3)" in text
    assert "  config.draft_vocab_size = 512" in text
    assert (
        '  config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": true}' in text
    )
    assert "  loads completely in sglang<=0.5.11: yes" in text
    assert "  loads completely in speculators>=0.9: NO" in text


def test_an_eyas_checkpoint_without_arch_fields_is_a_problem(tmp_path):
    ckpt = write_checkpoint(tmp_path / "step-00000010")
    meta = json.loads((ckpt / "arch.json").read_text())
    del meta["arch"]["head_dim"]
    (ckpt / "arch.json").write_text(json.dumps(meta))
    assert inspect_drafter(ckpt).problems == [
        f"{ckpt}/arch.json: arch lacks ['head_dim']; expected every DraftArch field: re-save it from training"
    ]


def test_target_with_another_hidden_size_is_refused_naming_both(tmp_path, tiny_target_dir, capsys):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    report = inspect_drafter(out, target=tiny_target_dir)
    assert report.problems == [
        f"hidden_size 64 (the drafter's; fc takes 3 x 64), expected 128, the hidden size of target {tiny_target_dir}: "
        "train a drafter for this target, or pass the target the drafter was trained for (--target)"
    ]
    assert main(["inspect", str(out), "--target", str(tiny_target_dir)]) == 1
    assert "  - hidden_size 64 (the drafter's; fc takes 3 x 64), expected 128" in capsys.readouterr().out


def test_target_with_another_vocab_or_too_few_layers_is_refused(tmp_path):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    assert inspect_drafter(out, target=write_target(tmp_path / "same")).ok  # the drafter's own shape: no problem
    target = write_target(tmp_path / "other", layers=5, vocab=4096)
    layers, vocab = inspect_drafter(out, target=target).problems
    assert vocab == (
        f"target vocab 2048 (the drafter's vocab_size, the length of its t2d), expected 4096, the rows of the input "
        f"embedding model.embed_tokens.weight of target {target}: train a drafter for this target, or pass the "
        "target the drafter was trained for (--target)"
    )
    assert layers.startswith("aux layer ids (canonical [2, 4, 5]): [5] fall outside 1..4, what sglang can capture")


def test_export_records_the_numbering_and_inspect_reads_ids_in_it(tmp_path):
    kimi = write_target(tmp_path / "kimi", kimi=True)
    ckpt = write_checkpoint(tmp_path / "step-00000010", aux_ids=[3, 4, 5])
    out = export_sglang(ckpt, tmp_path / "export", target=TargetRef.read(kimi))
    provenance = json.loads((out / "eyas_export.json").read_text())
    assert provenance["config_layer_id_convention"] == "sglang_deepseek"
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        3,
        4,
        5,
    ]
    report = inspect_drafter(out)  # no --target: Kimi's numbering, from eyas_export.json, not Llama's ([4, 5, 6])
    assert report.ok, report.problems
    assert "layer ids read in sglang_deepseek numbering, which eyas_export.json records the export wrote them in" in (
        " ".join(report.notes)
    )
    assert inspect_drafter(out, target=kimi).ok
    # read back without the target (eyas remap SRC DST): the same ids, not Llama's numbering less one
    assert read_drafter(out)[1].aux_layer_ids == [3, 4, 5]


def test_drafter_exported_for_another_family_s_numbering_is_refused_with_the_re_export(tmp_path):
    kimi = write_target(tmp_path / "kimi", kimi=True)
    ckpt = write_checkpoint(tmp_path / "step-00000010", aux_ids=[3, 4, 5])
    out = export_sglang(ckpt, tmp_path / "export", target=TargetRef.read(kimi))
    llama = write_target(tmp_path / "llama")
    assert inspect_drafter(out, target=llama).problems == [
        f"aux layer ids [3, 4, 5] (sglang_llama, the numbering of target {llama}), expected [2, 3, 4]: the export wrote "
        "canonical ids [3, 4, 5] in sglang_deepseek numbering (eyas_export.json), for a target of another family, "
        "and SGLang would capture other layers of this one than the draft was trained on: re-export for this target "
        f"(eyas remap {ckpt.resolve()} DST --to sglang --target {llama})"
    ]


def poison(state: dict) -> None:
    """A diverged training's weights: a NaN in fc, +inf and -inf in the lm_head."""
    state["fc.weight"][5, 7] = float("nan")
    state["lm_head.weight"][0, 1] = float("inf")
    state["lm_head.weight"][3, 2] = float("-inf")


NONFINITE_FIX = (
    "expected finite weights: the training diverged before this checkpoint was saved, or the file was damaged "
    "after writing; export an earlier checkpoint (eyas remap CHECKPOINT DST --to FORMAT), or retrain with a lower "
    "train.lr"
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_drafter_holding_nan_or_inf_is_refused_naming_each_tensor_and_where(tmp_path, capsys, dtype):
    ckpt = write_checkpoint(tmp_path / "step-00000010", state_edit=poison)
    out = export_sglang(ckpt, tmp_path / "export", dtype=dtype)
    assert sorted(inspect_drafter(out).problems) == [
        f"model.safetensors: tensor fc.weight [64, 192] holds non-finite values (1 NaN, 0 inf of 12,288; the first "
        f"at [5, 7]); {NONFINITE_FIX}",
        f"model.safetensors: tensor lm_head.weight [512, 64] holds non-finite values (0 NaN, 2 inf of 32,768; the "
        f"first at [0, 1]); {NONFINITE_FIX}",
    ]
    assert len(inspect_drafter(ckpt).problems) == 2  # the training checkpoint itself, in the eyas format
    assert main(["inspect", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "no problems found" not in printed
    assert "  - model.safetensors: tensor fc.weight [64, 192] holds non-finite values (1 NaN" in printed


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn]
)
def test_every_float_dtype_is_read_a_chunk_at_a_time(tmp_path, dtype):
    """Values spread over many 64-byte chunks: each is found, counted once, and the first one's place named;
    e4m3fn has no inf (torch casts an inf to it as +-448, a finite value); the integer tensor beside them is not read as floats."""
    values = torch.linspace(-2, 2, 1000).reshape(10, 100)
    values[0, 10], values[4, 99], values[9, 99] = float("nan"), float("nan"), float("-inf")
    path = tmp_path / "model.safetensors"
    save_file({"w": values.to(dtype), "ids": torch.full((64,), -1, dtype=torch.int64)}, str(path))
    nan, inf = (2, 0) if dtype == torch.float8_e4m3fn else (2, 1)
    assert nonfinite_problems(path, chunk_bytes=64) == [
        f"model.safetensors: tensor w [10, 100] holds non-finite values ({nan} NaN, {inf} inf of 1,000; the first "
        f"at [0, 10]); {NONFINITE_FIX}"
    ]
    save_file({"w": torch.linspace(-2, 2, 1000).to(dtype)}, str(path))
    assert nonfinite_problems(path, chunk_bytes=64) == []


def test_a_pytorch_model_bin_is_read_for_nan_without_torch_load(tmp_path):
    """EAGLE official's drafts ship a pytorch_model.bin: its storages are read from the archive, views included."""
    base = torch.zeros(6, 8, dtype=torch.float16)
    base[4, 6], base[3, 3] = float("nan"), float("inf")  # [3, 3] lies between the view's elements, not in it
    tensors = {"fc.weight": base, "view": base[2:, ::2], "clean": torch.ones(3, dtype=torch.bfloat16)}
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    assert nonfinite_problems(tmp_path / "pytorch_model.bin", chunk_bytes=16) == [
        f"pytorch_model.bin: tensor fc.weight [6, 8] holds non-finite values (1 NaN, 1 inf of 48; the first at "
        f"[3, 3]); {NONFINITE_FIX}",
        f"pytorch_model.bin: tensor view [4, 4] holds non-finite values (1 NaN, 0 inf of 16; the first at [2, 3]); "
        f"{NONFINITE_FIX}",
    ]
