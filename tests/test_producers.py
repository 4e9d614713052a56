"""Drafters written by other tools (tests/producer_fixtures.py): eyas names the producer, reads what each really
writes, converts speculators' drafts for SGLang bit for bit with speculators' own logits, and refuses draft
options an SGLang version does not serve, naming the first version that does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from draft_fixtures import write_checkpoint
from producer_fixtures import (
    OPTION_FIXTURES,
    PUBLISHED,
    SPECULATORS_VERSIONS,
    speculators_fixtures,
    speculators_forward,
    write_published,
    write_target,
)
from safetensors.torch import load_file, save_file

from eyas.draft import DraftArch
from eyas.draft_keys import DRAFT_OPTIONS
from eyas.export.configs import TargetRef
from eyas.export.convert import export_checkpoint
from eyas.export.drafter_dir import ExportError
from eyas.export.inspect import inspect_drafter
from eyas.export.reader import load_exported_draft, read_drafter
from eyas.export.remap import remap_checkpoint
from eyas.export.serving import SGLANG_OPTION_SINCE
from eyas_cli.main import main

SGLANG_KEYS = sorted(
    [f"midlayer.{k}" for k in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    + [f"midlayer.self_attn.{p}_proj" for p in "qkvo"]
    + [f"midlayer.mlp.{p}_proj" for p in ("gate", "up", "down")]
    + ["fc", "norm", "lm_head"]
)
SGLANG_KEYS = sorted([f"{k}.weight" for k in SGLANG_KEYS] + ["d2t", "t2d"])
SGLANG_SERVED = {name: options for name, options in OPTION_FIXTURES.items() if "norm_before_residual" not in options}


@pytest.fixture(scope="module", params=SPECULATORS_VERSIONS)
def spec(request):
    return request.param, speculators_fixtures(request.param)


def speculators_logits_match(draft, reference_file) -> None:
    """eyas's unroll of `draft` on the reference inputs gives speculators' logits at every TTT step."""
    ref = load_file(reference_file)
    hidden, ids = ref["hidden_states"], ref["input_ids"]
    steps = sum(1 for k in ref if k.startswith("logits_step"))
    # eyas's unroll pairs token t+1 with aux row t; speculators pairs token t with aux row t.
    tokens = torch.cat([torch.zeros(1, 1, dtype=ids.dtype), ids], dim=1)
    aux = torch.cat([hidden, torch.zeros(1, 1, hidden.shape[-1])], dim=1)
    with torch.no_grad():
        for k, logits in draft.unroll(tokens, aux, steps):
            span = ids.shape[1] - k  # the positions whose inputs are tokens, not padding
            torch.testing.assert_close(logits[:, :span], ref[f"logits_step{k}"][:, :span], rtol=1e-5, atol=1e-5)


def embedding(src) -> torch.Tensor:
    return load_file(src / "model.safetensors")["embed_tokens.weight"].float()


def drop_d2t(root) -> None:
    if (root / "pytorch_model.bin").is_file():
        tensors = torch.load(root / "pytorch_model.bin", weights_only=True)
        tensors.pop("d2t")
        torch.save(tensors, root / "pytorch_model.bin")
    else:
        tensors = load_file(root / "model.safetensors")
        tensors.pop("d2t")
        save_file(tensors, str(root / "model.safetensors"))


def test_speculators_plain_draft_is_read_as_speculators_writes_it(spec, tmp_path, capsys):
    version, root = spec
    report = inspect_drafter(root / "plain")
    assert report.ok and report.format == "speculators" and report.options == ()
    assert report.producer.label == f"speculators {version} (Eagle3DraftModel: trained)"
    assert report.config["architectures"] == ["Eagle3DraftModel"] and "use_aux_hidden_state" not in report.config
    assert "target_hidden_size: null, read as hidden_size (speculators' meaning)" in report.notes
    assert main(["inspect", str(root / "plain")]) == 0
    assert f"written by speculators {version} (Eagle3DraftModel: trained)" in capsys.readouterr().out
    broken = shutil.copytree(root / "plain", tmp_path / "plain")
    drop_d2t(broken)
    assert main(["inspect", str(broken)]) == 1
    assert "  missing: d2t (expected shape [128])" in capsys.readouterr().out


def test_speculators_plain_draft_converts_to_sglang_bit_for_bit(spec, tmp_path):
    _, root = spec
    src = root / "plain"
    out = remap_checkpoint(src, tmp_path / "sglang", to="sglang")
    source, exported = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(exported) == SGLANG_KEYS
    for name, tensor in source.items():
        if name != "embed_tokens.weight":
            kept = exported[name.replace("layers.0.", "midlayer.")]
            assert kept.dtype == tensor.dtype and torch.equal(kept, tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 128 and config["tie_word_embeddings"] is False
    # speculators' [2, 4, 5] are HF hidden_states indices; SGLang adds 1 to what it is given
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["target_hidden_size"] == 64
    assert inspect_drafter(out, num_target_layers=8).ok

    old = remap_checkpoint(src, tmp_path / "sglang-0.5.12", to="sglang-0.5.12")
    layer = [k for k in load_file(old / "model.safetensors") if k.startswith(("layers.0.", "midlayer."))]
    assert len(layer) == 10 and all(k.startswith("layers.0.") for k in layer)
    speculators_logits_match(load_exported_draft(out, embedding(src)), src / "reference.safetensors")


@pytest.mark.parametrize("name", sorted(OPTION_FIXTURES))
def test_every_option_combination_runs_in_eyas_as_in_speculators(spec, name):
    _, root = spec
    src, options = root / name, OPTION_FIXTURES[name]
    report = inspect_drafter(src)
    assert report.ok and report.options == tuple(o for o in DRAFT_OPTIONS if o in options)
    speculators_logits_match(load_exported_draft(src, embedding(src)), src / "reference.safetensors")


@pytest.mark.parametrize("name", sorted(SGLANG_SERVED))
def test_draft_options_convert_for_the_sglang_versions_that_serve_them(spec, tmp_path, name):
    _, root = spec
    src, options = root / name, OPTION_FIXTURES[name]
    with pytest.raises(ExportError) as err:
        remap_checkpoint(src, tmp_path / "every", to="sglang")
    for option in options:
        assert (
            f"{option}: served by SGLang from {SGLANG_OPTION_SINCE[option]}; this export is for SGLang >= 0.5.10"
            in (str(err.value))
        )
    first = max((SGLANG_OPTION_SINCE[o] for o in options), key=lambda v: tuple(map(int, v.split("."))))
    before = {"0.5.12": "0.5.11", "0.5.17": "0.5.16"}[first]
    with pytest.raises(ExportError, match=rf"served by SGLang from {first}; this export is for SGLang >= {before}"):
        remap_checkpoint(src, tmp_path / "before", to="sglang", sglang_version=before)
    out = remap_checkpoint(src, tmp_path / "sglang", to="sglang", sglang_version=first)
    config = json.loads((out / "config.json").read_text())
    assert {o: config.get(o, False) for o in DRAFT_OPTIONS} == {o: o in options for o in DRAFT_OPTIONS}
    names = set(load_file(out / "model.safetensors"))
    assert ("input_norm.weight" in names) == ("norm_before_fc" in options)
    assert ({"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= names) == ("fc_norm" in options)
    assert json.loads((out / "eyas_export.json").read_text())["sglang_version"] == first
    report = inspect_drafter(out, engine=f"sglang>={'0.5.17' if first == '0.5.17' else '0.5.12'}")
    assert report.ok, report.problems
    assert not inspect_drafter(out, engine="sglang<=0.5.11").ok
    speculators_logits_match(load_exported_draft(out, embedding(src)), src / "reference.safetensors")


@pytest.mark.parametrize("name", sorted(set(OPTION_FIXTURES) - set(SGLANG_SERVED)))
def test_norm_before_residual_is_served_by_no_sglang_version(spec, tmp_path, name):
    _, root = spec
    src, options = root / name, OPTION_FIXTURES[name]
    with pytest.raises(ExportError, match="norm_before_residual: no SGLang version runs it"):
        remap_checkpoint(src, tmp_path / "sglang", to="sglang", sglang_version="0.5.23")
    if options != ("norm_before_residual",):
        with pytest.raises(ExportError, match=r"vllm does not run it"):
            remap_checkpoint(src, tmp_path / "vllm", to="vllm")
        return
    vllm = remap_checkpoint(src, tmp_path / "vllm", to="vllm")
    assert json.loads((vllm / "config.json").read_text())["norm_before_residual"] is True
    speculators_logits_match(load_exported_draft(vllm, embedding(src)), src / "reference.safetensors")


def test_speculators_training_defaults_are_refused_for_sglang(spec, tmp_path):
    _, root = spec
    report = inspect_drafter(root / "cli_defaults")
    assert report.options == ("norm_before_fc", "norm_before_residual", "norm_output") and not report.ok
    assert report.problems[0].startswith("sliding_window=2048: the draft layer attends to a window")
    with pytest.raises(ExportError, match="sliding_window=2048"):
        remap_checkpoint(root / "cli_defaults", tmp_path / "sglang", to="sglang", sglang_version="0.5.23")


def test_full_vocab_and_final_state_layer_ids(spec, tmp_path):
    _, root = spec
    full = inspect_drafter(root / "full_vocab")
    assert full.ok and "d2t/t2d: absent, the draft vocab is the whole target vocab (identity mapping)" in full.notes
    out = remap_checkpoint(root / "full_vocab", tmp_path / "full", to="sglang")
    exported = load_file(out / "model.safetensors")
    assert torch.equal(exported["d2t"], torch.zeros(512, dtype=torch.int64)) and bool(exported["t2d"].all())
    speculators_logits_match(
        load_exported_draft(out, embedding(root / "full_vocab")), root / "full_vocab" / "reference.safetensors"
    )

    # [1, 4, 8] of an 8-layer verifier: 8 is the final state, which speculators captures and SGLang cannot
    assert inspect_drafter(root / "layer_ids_1_4_8", num_target_layers=8).ok
    with pytest.raises(ExportError, match=r"\[8\] fall outside 1..7, what sglang can capture of a 8-layer target"):
        remap_checkpoint(root / "layer_ids_1_4_8", tmp_path / "ids", to="sglang", num_target_layers=8)


@pytest.mark.parametrize("version", SPECULATORS_VERSIONS)
def test_an_eyas_speculators_export_runs_in_speculators_with_eyas_logits(version, tmp_path):
    verifier = speculators_fixtures(version) / "verifier"
    arch = DraftArch(
        hidden_size=64,
        num_aux=3,
        target_vocab_size=512,
        draft_vocab_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        fc_norm=True,
        norm_output=True,
    )

    def perturb(state):
        g = torch.Generator().manual_seed(7)
        for k in state:
            if k.startswith("fc_norm."):
                state[k] = 1 + 0.1 * torch.randn(state[k].shape, generator=g)

    ckpt = write_checkpoint(tmp_path / "step-00000010", arch=arch, state_edit=perturb)
    out = export_checkpoint(ckpt, tmp_path / "spec", to="speculators", target=TargetRef.read(verifier))
    assert inspect_drafter(out).producer.name == "eyas"
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 12, 192, generator=g),
        "input_ids": torch.randint(0, 512, (1, 12), generator=g),
        "document_ids": torch.zeros(1, 12, dtype=torch.long),
        "position_ids": 1 + torch.arange(12)[None],
    }
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    logits = load_file(
        speculators_forward(version, out, tmp_path / "inputs.safetensors", tmp_path / "logits.safetensors")
    )
    save_file({**inputs, **logits}, str(tmp_path / "reference.safetensors"))
    _, source = read_drafter(ckpt)
    speculators_logits_match(
        load_exported_draft(out, source.state["embed_tokens.weight"]), tmp_path / "reference.safetensors"
    )


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_drafters_are_read_as_their_producers_write_them(name, tmp_path, capsys):
    entry = PUBLISHED[name]
    root = write_published(name, tmp_path / name)
    target = write_target(entry["target"], tmp_path / "target")
    report = inspect_drafter(root, target=target)
    ambiguous = name == "specforge-qwen3-30b-a3b-eagle3.1"
    assert report.ok is not ambiguous, report.problems
    assert main(["inspect", str(root), "--target", str(target)]) == int(ambiguous)
    out = capsys.readouterr().out
    label = {"specforge": "SpecForge", "eagle-official": "EAGLE official", "speculators": "speculators"}
    assert f"written by {label[report.producer.name]}" in out
    drop_d2t(root)
    assert main(["inspect", str(root), "--target", str(target)]) == 1
    assert "  missing: d2t (expected shape [128])" in capsys.readouterr().out


def test_specforge_eagle31_norm_output_is_refused_with_both_meanings(tmp_path):
    root = write_published("specforge-qwen3-30b-a3b-eagle3.1", tmp_path / "draft")
    report = inspect_drafter(root)
    assert report.options == ("fc_norm", "norm_output")
    assert report.problems == [
        "norm_output: true in a config eyas did not export: SpecForge writes it for its final norm before lm_head "
        "(true: the standard head, the pre-norm state fed back to the next step), SGLang >= 0.5.12 reads it as "
        "feeding the normed state back; the file does not say which was meant. If SpecForge trained it with "
        "norm_output true, delete the key (SGLang then runs the head SpecForge trained); false means no final "
        "norm, which no engine eyas knows runs"
    ]
    config = json.loads((root / "config.json").read_text())
    del config["norm_output"]
    (root / "config.json").write_text(json.dumps(config))
    fixed = inspect_drafter(root, engine="sglang>=0.5.12")
    assert fixed.ok and fixed.options == ("fc_norm",)
    assert remap_checkpoint(root, tmp_path / "out", to="sglang", sglang_version="0.5.12", num_target_layers=48)


def test_eagle_official_pytorch_bin_converts_for_sglang(tmp_path):
    root = write_published("eagle-official-llama3.1-8b", tmp_path / "eagle")
    target = write_target("llama-3.1-8b", tmp_path / "target")
    assert inspect_drafter(root, target=target).engines["sglang<=0.5.11"] is True
    out = remap_checkpoint(root, tmp_path / "sglang", to="sglang", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 15, 28]  # canonical [2, 16, 29]
    source = torch.load(root / "pytorch_model.bin", weights_only=True)
    exported = load_file(out / "model.safetensors")
    assert sorted(exported) == SGLANG_KEYS
    assert exported["fc.weight"].dtype == torch.float16
    assert all(exported[k].dtype == v.dtype and torch.equal(exported[k], v) for k, v in source.items())


@pytest.mark.parametrize("name", ["aq-medai-kimi-k2", "specforge-deepseek-v3"])
def test_deepseek_family_drafts_keep_sglang_conditional_numbering(name, tmp_path):
    root = write_published(name, tmp_path / "draft")
    target = write_target(PUBLISHED[name]["target"], tmp_path / "target")
    _, ckpt = read_drafter(root, target_architectures=["DeepseekV3ForCausalLM"])
    assert ckpt.aux_layer_ids == [2, 30, 58]  # SGLang captures [1, 29, 57] + 1 and [2, 30, 58] as given
    vllm = remap_checkpoint(root, tmp_path / "vllm", to="vllm", target=target)
    assert json.loads((vllm / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    back = remap_checkpoint(vllm, tmp_path / "sglang", to="sglang", target=target)
    written = json.loads((back / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert written == [1, 29, 57] and inspect_drafter(back, target=target).ok
    assert "for a DeepSeek or Kimi target pass the target (--target)" in " ".join(inspect_drafter(root).notes)
