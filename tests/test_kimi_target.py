"""A Kimi-K2.5-shaped target on the CPU: the committed tiny Kimi target (scripts/build_tiny_kimi_target.py: the
`kimi_k25` wrapper's config.json, a DeepSeek-V3-style MLA + MoE text model under `language_model.`, a few vision
tensors, no modeling code) runs through transformers' own classes in every stage that loads the target, and
the whole demo pipeline runs on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eyas.bench.acceptance import BENCH_NUM_THREADS, torch_threads
from eyas.bench.reference import check_lossless, greedy_decode, load_target_float64, reference_decode
from eyas.extract.backends.hf import HFBackend
from eyas.target import TargetError, TargetFacts, load_embed_and_lm_head, load_target, load_target_model

REPO = Path(__file__).resolve().parents[1]
TINY_KIMI = REPO / "fixtures" / "tiny-kimi-target"
AUX = [2, 4, 5]  # the EAGLE-3 default [2, N//2, N-3] of its 8 layers
PREFIX = "language_model."


@pytest.fixture(scope="module")
def kimi() -> Path:
    assert (TINY_KIMI / "model.safetensors").is_file(), "run scripts/build_tiny_kimi_target.py first"
    return TINY_KIMI


def test_the_tiny_kimi_target_has_the_wrappers_config_and_weight_names(kimi):
    config = json.loads((kimi / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert config["auto_map"]["AutoConfig"] == "configuration_kimi_k25.KimiK25Config"
    text = config["text_config"]
    assert text["model_type"] == "kimi_k2" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert {"q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "first_k_dense_replace", "n_group", "topk_group"} <= text.keys()  # fmt: skip
    assert config["vision_config"]["model_type"] == "kimi_k25_vision"
    names = set(load_file(kimi / "model.safetensors"))
    assert {n.split(".")[0] for n in names} == {"language_model", "vision_tower", "mm_projector"}
    assert f"{PREFIX}model.layers.1.mlp.experts.7.down_proj.weight" in names  # one tensor per expert
    assert f"{PREFIX}model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names  # MLA
    assert not list(kimi.glob("*.py"))  # no modeling code: transformers' own classes run it
    facts = TargetFacts.read(kimi).summary()
    assert (facts["num_layers"], facts["hidden_size"], facts["vocab_size"], facts["remote_code"]) == (8, 128, 2048, {})
    assert facts["layer_numbering"]["sglang_deepseek"] == [1, 3, 4]


def test_the_committed_fixture_is_what_the_build_script_writes(kimi):
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "scripts"))  # the script imports build_tiny_target beside it
    try:
        spec = importlib.util.spec_from_file_location(
            "build_tiny_kimi_target", REPO / "scripts" / "build_tiny_kimi_target.py"
        )
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert json.loads((kimi / "config.json").read_text()) == script.CONFIG
    build = json.loads((kimi / "build.json").read_text())
    assert build["heldout_perplexity"] < build["vocab_size"] / 10  # trained: far better than chance
    shapes = {k: list(v.shape) for k, v in load_file(kimi / "model.safetensors").items() if not k.startswith(PREFIX)}
    assert shapes == script.VISION_TENSORS


def test_the_text_model_runs_through_transformers_deepseek_v3_class_with_every_weight_in_place(kimi, tmp_path):
    model = load_target_model(kimi, trust_remote_code=True)  # the directory has no code to run
    assert type(model).__module__ == "transformers.models.deepseek_v3.modeling_deepseek_v3"
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and model.config.num_hidden_layers == 8
    # saved back (transformers undoes its renaming and its fused experts), the model's weights are the
    # checkpoint's text tensors: every `language_model.` tensor found its parameter, and no other was taken
    model.save_pretrained(tmp_path / "saved", safe_serialization=True)
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    checkpoint = load_file(kimi / "model.safetensors")
    assert saved.keys() == {k for k in checkpoint if k.startswith(PREFIX)}
    assert all(torch.equal(saved[k], checkpoint[k].float()) for k in saved)
    embed, lm_head = load_embed_and_lm_head(kimi)
    assert torch.equal(embed, checkpoint[f"{PREFIX}model.embed_tokens.weight"]) and not torch.equal(embed, lm_head)
    assert torch.equal(lm_head, checkpoint[f"{PREFIX}lm_head.weight"])


def _edited_copy(kimi: Path, out: Path, edit) -> Path:
    shutil.copytree(kimi, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_text_weight_the_model_does_not_take_or_a_parameter_without_weight_is_refused(kimi, tmp_path):
    extra = _edited_copy(
        kimi, tmp_path / "extra", lambda t: t.update({f"{PREFIX}model.layers.0.extra.weight": torch.ones(2)})
    )
    with pytest.raises(TargetError) as err:
        load_target_model(extra)
    assert f"target {extra}: its text model DeepseekV3ForCausalLM under 'language_model.' does not match" in str(
        err.value
    )
    assert "1 weights under 'language_model.' the text model does not take: language_model.model.layers.0.extra" in str(
        err.value
    )
    missing = _edited_copy(kimi, tmp_path / "missing", lambda t: t.pop(f"{PREFIX}model.norm.weight"))
    with pytest.raises(TargetError, match="1 parameters of the text model found no weight: model.norm.weight"):
        load_target_model(missing)
    expert = f"{PREFIX}model.layers.1.mlp.experts.0.up_proj.weight"
    shape = _edited_copy(kimi, tmp_path / "shape", lambda t: t.update({expert: torch.ones(3, 3)}))
    with pytest.raises(TargetError) as err:
        load_target_model(shape)
    assert "transformers refuses the weights under 'language_model.' for its text model DeepseekV3ForCausalLM (" in (
        str(err.value)
    )
    assert "Error: MergeModulelist on tensors destined for model.layers.1.mlp.experts.gate_up_proj" in str(err.value)


def test_the_hf_backend_and_hf_regeneration_load_the_text_model(kimi):
    backend = HFBackend(str(kimi), target_dtype="float32", aux_layer_ids=AUX, hidden_size=128, device="cpu",
                        trust_remote_code=True)  # fmt: skip
    ids = torch.tensor([5, 17, 300, 2, 9, 11])
    [(aux, last)] = backend.features([ids])
    target = load_target(kimi, trust_remote_code=True)  # what hf regeneration loads: model and tokenizer
    out = target.model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    assert torch.equal(aux, torch.cat([out.hidden_states[i][0] for i in AUX], dim=-1))
    assert torch.equal(last, out.hidden_states[-1][0]) and aux.shape == (6, 3 * 128)
    assert target.eos_token_id == 0 and target.tokenizer.decode(target.tokenizer("def f():")["input_ids"]) == "def f():"


class SpoiledOracle:
    """Proposes the target's own greedy tokens, one of them spoiled per round (round r spoils r % (steps + 1))."""

    def __init__(self, model):
        self.model, self.rounds = model, 0

    def propose(self, seq, aux, steps):
        assert aux.shape == (len(seq) - 1, 3 * 128)
        tokens = greedy_decode(self.model, seq, steps, None)
        spoil, self.rounds = self.rounds % (steps + 1), self.rounds + 1
        if spoil < steps:
            tokens[spoil] = (tokens[spoil] + 1) % 2048
        return tokens


def test_the_reference_engine_is_exact_on_the_mla_and_moe_target(kimi):
    """Verification feeds several tokens and crops the MLA cache back; the experts run eagerly in float64."""
    model = load_target_float64(kimi, trust_remote_code=True)
    assert model.dtype == torch.float64 and model.config._experts_implementation == "eager"
    prompt = [11, 400, 37, 95, 1200, 7]
    with torch_threads(BENCH_NUM_THREADS):  # as the benchmark runs it (tiny ops are slower on more threads)
        r = reference_decode(model, SpoiledOracle(model), prompt, aux_layer_ids=AUX, steps=3, max_new_tokens=11,
                             eos_token_id=None)  # fmt: skip
        check_lossless(r.tokens, greedy_decode(model, prompt, 11, None), prompt="kimi")  # one token per forward
    assert r.accepted_per_step == [0, 1, 2, 3] and r.emitted_per_step == [1, 2, 3, 4]


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_the_demo_pipeline_runs_on_the_tiny_kimi_target(prefect_server, kimi, tmp_path):
    """The pipeline flow against a real Prefect server, the gate answered through the API, on the Kimi-shaped
    target with target.trust_remote_code set (as the Kimi preset sets it): hf regeneration, hf extraction,
    verification, the smoke run, training, the export in SGLang's Kimi numbering, inspect, the reference
    benchmark (lossless) and the diagnosis's teacher-forced check, on a small dataset and few steps."""
    from run_fixtures import small_run_config
    from test_pipeline import run_pipeline_answering

    from eyas.bench.diagnose import teacher_forced_accuracy
    from eyas.export.inspect import inspect_drafter
    from eyas.shards.shard_set import read_run_meta
    from eyas.storage import LocalStorage

    heldout = str(kimi / "heldout_prompts.jsonl")
    config = small_run_config(
        tmp_path / "run", kimi, target={"trust_remote_code": True}, dataset={"num_samples": 24},
        smoke={"num_samples": 4, "num_steps": 40}, train={"num_epochs": 2}, export={"sglang_version": "0.5.23"},
        bench={"prompts_path": heldout, "num_prompts": 4, "max_new_tokens": 24, "min_tau": 1.0},
    )  # fmt: skip
    state, answered = run_pipeline_answering(config, approve=True)
    assert answered and state.is_completed(), state.message
    paths = config.paths
    report = json.loads((paths.dataset_dir / "report.json").read_text())
    assert report["generator"] == "hf" and report["num_samples"] == 24 and report["num_loss_tokens"] > 0
    run = read_run_meta(LocalStorage(paths.shards_dir))
    assert (run.aux_layer_ids, run.hidden_size, run.backend) == (AUX, 128, "hf")
    export = paths.export_dir / "sglang"
    eagle = json.loads((export / "config.json").read_text())["eagle_config"]
    assert eagle["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang's Kimi (DeepSeek) numbering of AUX
    provenance = json.loads((export / "eyas_export.json").read_text())
    assert provenance["config_layer_id_convention"] == "sglang_deepseek" and provenance["aux_layer_ids"] == AUX
    assert inspect_drafter(export, target=kimi).problems == []
    result = json.loads((paths.bench_dir / "benchmark.json").read_text())
    assert result["lossless"] is True and result["num_prompts"] == 4 and result["tau_mean"] >= 1.0
    accuracy = teacher_forced_accuracy(export, LocalStorage(paths.shards_dir), kimi, num_samples=2, steps=3)
    assert len(accuracy) == 3 and all(0.0 <= a <= 1.0 for a in accuracy)
