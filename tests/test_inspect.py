"""`eyas inspect`: the audit reads headers and config only and names every problem."""

import json

from draft_fixtures import write_checkpoint
from safetensors.torch import load_file, save_file

from eyas.export.convert import export_sglang
from eyas.export.inspect import inspect_drafter
from eyas_cli.main import main


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
