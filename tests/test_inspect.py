"""`eyas inspect`: the audit reads headers and config only and names every problem."""

import json

from safetensors.torch import load_file, save_file
from test_export import write_checkpoint

from eyas.export import export_sglang
from eyas.inspect import inspect_drafter
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
    report = inspect_drafter(out)
    assert not report.ok
    assert "midlayer.self_attn.q_proj.weight" in report.problems[0]
    assert "layers.0.self_attn.q_proj.weight" in report.problems[0]
    assert main(["inspect", str(out)]) == 1


def test_tied_embeddings_are_reported(tmp_path):
    out = export_sglang(write_checkpoint(tmp_path / "step-00000010"), tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    report = inspect_drafter(out)
    assert report.problems == [
        "tie_word_embeddings is True, expected false: the engine would tie the draft's lm_head to the "
        "embedding and discard the trained head; re-export"
    ]
