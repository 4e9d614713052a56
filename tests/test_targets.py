"""A target's facts from config.json and weight headers, without remote code: the tiny Llama, and config-only
targets shaped like DeepSeek-V3 and Kimi-K2.5 (a multimodal wrapper around a DeepSeek-V3-style text model),
carried through the stages that read them: the extraction command (checked by SGLang's own code), the export
config, the benchmark's lint and `eyas engine-command`; a config.json that does not describe its weights (one
checkpoint file or shards under model.safetensors.index.json) is refused before any stage reads its facts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from draft_fixtures import write_checkpoint
from sglang_conformance import resolved_server_info
from target_fixtures import CONFIGS, write_header_only, write_target

from eyas.bench.sglang import lint_launch_command
from eyas.config import SGLangExtractConfig, load_run_config
from eyas.engines.sglang import SglangLaunch, build_launch_command
from eyas.export.configs import TargetRef
from eyas.export.convert import export_checkpoint
from eyas.extract.backends.sglang import build_extract_command, lint_server_info
from eyas.target import TargetError, TargetFacts, load_target
from eyas.target_check import config_shape_problem
from eyas_cli.engine_command import engine_command

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return write_target(tmp_path_factory.mktemp("targets") / "kimi-k2.5", "kimi-k2.5")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_target(tmp_path_factory.mktemp("targets") / "deepseek-v3", "deepseek-v3")


def test_kimi_facts_come_from_the_text_config_and_the_wrappers_weight_names(kimi):
    facts = TargetFacts.read(kimi)
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size) == (61, 7168, 163840)
    assert facts.architectures == ["KimiK25ForConditionalGeneration"]
    assert facts.text_architectures == ["DeepseekV3ForCausalLM"] and facts.tie_word_embeddings is False
    # transformers ships kimi_k25 (its class reads the kimi_k2 text config as deepseek_v3): only the tokenizer's
    # own class needs code from the directory
    assert facts.remote_code == {"AutoTokenizer": "tokenization_kimi.TikTokenTokenizer"}
    summary = facts.summary()
    assert summary["default_aux_layer_ids"] == [2, 30, 58]
    assert summary["layer_numbering"] == {"hf_hidden_states": [2, 30, 58], "sglang_deepseek": [1, 29, 57],
                                          "vllm": [2, 30, 58]}  # fmt: skip


def test_deepseek_v3_needs_no_remote_code_and_its_mtp_embedding_is_not_taken(deepseek):
    facts = TargetFacts.read(deepseek)
    assert (facts.num_layers, facts.hidden_size, facts.vocab_size) == (61, 7168, 129280)
    assert facts.remote_code == {}  # transformers ships deepseek_v3: auto_map is not needed
    assert facts.summary()["sglang_layer_numbering"] == "sglang_deepseek"


def test_the_tiny_target_is_a_llama(tiny_target_dir):
    summary = TargetFacts.read(tiny_target_dir).summary()
    assert summary["layer_numbering"]["sglang_llama"] == [1, 3, 4] and summary["remote_code"] == {}


def test_a_target_sglang_cannot_serve_with_eagle3_still_has_its_facts(tiny_target_dir, tmp_path):
    # the hf backend extracts any transformers model; `eyas target` says why SGLang would refuse it instead of failing
    target = tmp_path / "gpt2-like"
    target.mkdir()
    for f in tiny_target_dir.iterdir():
        if f.is_file():
            (target / f.name).symlink_to(f)
    config = json.loads((tiny_target_dir / "config.json").read_text())
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    summary = TargetFacts.read(target).summary()
    assert summary["sglang_layer_numbering"] is None and "GPT2LMHeadModel" in summary["sglang_refuses"]
    assert summary["layer_numbering"] == {"hf_hidden_states": [2, 4, 5], "vllm": [2, 4, 5]}
    text = subprocess.run([sys.executable, "-m", "eyas_cli.main", "target", str(target)], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "SGLang: " in text and "GPT2LMHeadModel" in text


def test_eyas_target_prints_the_facts(kimi):
    done = subprocess.run([sys.executable, "-m", "eyas_cli.main", "target", str(kimi), "--json"], cwd=REPO,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(done.stdout) == TargetFacts.read(kimi).summary()
    text = subprocess.run([sys.executable, "-m", "eyas_cli.main", "target", str(kimi)], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "KimiK25ForConditionalGeneration (text model DeepseekV3ForCausalLM)" in text
    assert "needs its own code to load (target.trust_remote_code: true)" in text


def test_loading_a_target_whose_tokenizer_needs_remote_code_needs_the_explicit_field(kimi):
    with pytest.raises(TargetError) as err:
        load_target(kimi)
    message = str(err.value)
    assert "its tokenizer_class 'TikTokenTokenizer' is not one transformers ships" in message
    assert "AutoTokenizer -> tokenization_kimi.TikTokenTokenizer" in message
    assert "files tokenization_kimi.py" in message and "kimi_k25" not in message
    assert "expected target.trust_remote_code: true in the run config" in message


def test_loading_a_model_type_transformers_does_not_ship_needs_the_explicit_field(tmp_path):
    config = {"architectures": ["MyLMForCausalLM"], "model_type": "my_lm", "hidden_size": 64, "num_hidden_layers": 4,
              "auto_map": {"AutoConfig": "configuration_my_lm.MyLMConfig",
                           "AutoModelForCausalLM": "modeling_my_lm.MyLMForCausalLM"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TargetError) as err:
        load_target(tmp_path)
    message = str(err.value)
    assert "model_type 'my_lm' is not one transformers ships" in message
    assert "files configuration_my_lm.py, modeling_my_lm.py" in message
    assert "expected target.trust_remote_code: true in the run config" in message


def test_kimi_extraction_command_is_accepted_by_sglang_with_the_deepseek_numbering(sglang_kit, kimi):
    argv = build_extract_command(SGLangExtractConfig(tp_size=8), target_path=str(kimi), aux_layer_ids=[2, 30, 58],
                                 capture_dir="/shared/capture")  # fmt: skip
    assert argv[argv.index("--return-aux-hidden-state-layer-ids") + 1 :][:3] == ["1", "29", "57"]
    info = resolved_server_info(argv)
    assert info["return_aux_hidden_state_layer_ids"] == [1, 29, 57] and info["tp_size"] == 8
    assert lint_server_info(info, [1, 29, 57], "sglang_deepseek") == []


def test_kimi_export_config_and_benchmark_lint_use_the_deepseek_numbering(kimi, tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt")  # the small test draft, trained at canonical [2, 4, 5]
    export = export_checkpoint(ckpt, tmp_path / "sglang", to="sglang", target=TargetRef.read(kimi))
    config = json.loads((export / "config.json").read_text())
    # [2, 4, 5] in SGLang's DeepSeek/Kimi numbering: the first id becomes 1, SGLang adds 1 to each
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    launch = SglangLaunch(target_path=str(kimi), draft_path=str(export))
    assert lint_launch_command(build_launch_command(launch), shard_aux_layer_ids=[2, 4, 5]) == []
    # shards at [3, 5, 6] are [2, 4, 5] in Llama numbering, but SGLang reads a Kimi draft's [2, 4, 5] as given
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (export / "config.json").write_text(json.dumps(config))
    [problem] = lint_launch_command(build_launch_command(launch), shard_aux_layer_ids=[3, 5, 6])
    assert (
        "[2, 4, 5] (sglang_deepseek) captures hidden_states [2, 4, 5], but the shards were extracted at [3, 5, 6]"
        in (problem)
    )


def test_engine_command_for_a_kimi_run(sglang_kit, kimi, tmp_path):
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    target = config.target.model_copy(update={"model_path": str(kimi), "aux_layer_ids": None})
    config = config.model_copy(update={"workdir": str(tmp_path / "run"), "target": target})
    argv = engine_command(config, "extract")
    assert resolved_server_info(argv)["return_aux_hidden_state_layer_ids"] == [1, 29, 57]


def test_the_kimi_preset_starts_servers_sglang_accepts(sglang_kit, kimi, tmp_path):
    """deployments/kimi-k25-8gpu.json with its target replaced by the Kimi-shaped fixture: the regeneration,
    extraction, benchmark and baseline servers it would start, through SGLang's own argument code."""
    from kimi_remote_code import with_remote_config
    from producer_fixtures import PUBLISHED

    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    kimi = with_remote_config(kimi, tmp_path / "kimi")  # --trust-remote-code: SGLang loads its configuration code
    target = config.target.model_copy(update={"model_path": str(kimi)})
    config = config.model_copy(update={"workdir": str(tmp_path / "run"), "target": target})
    export = config.paths.export_dir / "sglang"
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps(PUBLISHED["aq-medai-kimi-k2"]["config"]))
    infos = {s: resolved_server_info(engine_command(config, s)) for s in ("generate", "extract", "bench", "baseline")}
    assert {s: info["tp_size"] for s, info in infos.items()} == dict.fromkeys(infos, 8)
    assert infos["extract"]["return_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert infos["bench"]["speculative_algorithm"] == "EAGLE3" and infos["generate"]["speculative_algorithm"] is None
    assert config.target.trust_remote_code and config.dataset.generation.generator == "sglang"


def test_kimi_facts_reach_extraction_planning_verification_and_status(kimi, tmp_path):
    from run_fixtures import write_tokenized

    from eyas.extract.plan import describe_extraction
    from eyas.facts import resolve_facts
    from eyas.status.report import run_status
    from eyas.verify.shard_set import expected_shard_meta

    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    config = config.model_copy(
        update={"workdir": str(tmp_path / "run"), "target": config.target.model_copy(update={"model_path": str(kimi)})}
    )
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, [[1, 2, 3, 4]] * 3)
    facts = resolve_facts(config)
    assert (facts.num_aux, facts.hidden_size, facts.target.num_layers, facts.aux_layer_ids) == (
        3,
        7168,
        61,
        [2, 30, 58],
    )
    run, plan = describe_extraction(config.extract, facts, target_dtype="bfloat16")
    assert (run.hidden_size, run.num_aux, run.target_fingerprint) == (7168, 3, facts.target.fingerprint)
    assert expected_shard_meta(facts, "bfloat16").hidden_size == 7168
    stages = {s.stage: s for s in run_status(config).stages}
    assert stages["extract"].state != "unreadable" and "dataset" in stages


def with_config(source, out, edit) -> "__import__('pathlib').Path":
    """A copy of the target `source` whose config.json `edit(config)` changed (the weights as they were)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_kimi_config_whose_hidden_size_is_not_the_weights_is_refused_naming_field_weights_and_fix(tmp_path, capsys):
    from eyas_cli.main import main

    tiny_kimi = REPO / "fixtures" / "tiny-kimi-target"
    wrong = with_config(tiny_kimi, tmp_path / "kimi", lambda c: c["text_config"].update(hidden_size=256))
    expected = (
        f"target {wrong}: config.json does not describe its weights (text_config.hidden_size 256, the weights 128): "
        "language_model.model.embed_tokens.weight in model.safetensors is [2048, 128], config.json gives [2048, 256] "
        "= [vocab_size, hidden_size]; language_model.lm_head.weight in model.safetensors is [2048, 128], config.json "
        "gives [2048, 256] = [vocab_size, hidden_size]; language_model.model.norm.weight in model.safetensors is "
        "[128], config.json gives [256] = [hidden_size]; language_model.model.layers.0.input_layernorm.weight in "
        "model.safetensors is [128], config.json gives [256] = [hidden_size]; and 7 more; expected the config.json "
        "published with these weights: set text_config.hidden_size to 128, or use the weights this config is for"
    )
    with pytest.raises(TargetError) as err:
        TargetFacts.read(wrong)
    assert str(err.value) == expected
    assert main(["target", str(wrong)]) == 2
    assert capsys.readouterr().err == f"eyas target: {expected}\n"
    assert TargetFacts.read(tiny_kimi).hidden_size == 128  # the committed fixture itself is consistent


def test_a_head_count_the_weights_disagree_with_names_the_fields_of_the_projection(tiny_target_dir, tmp_path):
    wrong = with_config(tiny_target_dir, tmp_path / "llama", lambda c: c.update(num_key_value_heads=4))
    with pytest.raises(TargetError) as err:
        TargetFacts.read(wrong)
    assert str(err.value) == (
        f"target {wrong}: config.json does not describe its weights: model.layers.0.self_attn.k_proj.weight in "
        "model.safetensors is [64, 128], config.json gives [128, 128] = [num_key_value_heads * head_dim = 4 * 32, "
        "hidden_size]; model.layers.0.self_attn.v_proj.weight in model.safetensors is [64, 128], config.json gives "
        "[128, 128] = [num_key_value_heads * head_dim = 4 * 32, hidden_size]; expected the config.json published "
        "with these weights: check num_key_value_heads, head_dim, or use the weights this config is for"
    )


# Kimi-K2.5's text model at its real shape, as three shards: layer 0 (MLA attention, dense MLP) with the
# embedding, the lm_head and final norm, and the vision tower.
LAYER0 = "language_model.model.layers.0."
KIMI_SHARDS = {
    "model-00001-of-00003.safetensors": [
        ("language_model.model.embed_tokens.weight", "BF16", [163840, 7168]),
        *[(LAYER0 + n, "BF16", [7168]) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")],
        (LAYER0 + "self_attn.q_a_proj.weight", "BF16", [1536, 7168]),
        (LAYER0 + "self_attn.q_a_layernorm.weight", "BF16", [1536]),
        (LAYER0 + "self_attn.q_b_proj.weight", "BF16", [128 * 192, 1536]),
        (LAYER0 + "self_attn.kv_a_proj_with_mqa.weight", "BF16", [512 + 64, 7168]),
        (LAYER0 + "self_attn.kv_a_layernorm.weight", "BF16", [512]),
        (LAYER0 + "self_attn.kv_b_proj.weight", "BF16", [128 * 256, 512]),
        (LAYER0 + "self_attn.o_proj.weight", "BF16", [7168, 128 * 128]),
        *[(LAYER0 + f"mlp.{n}_proj.weight", "BF16", [18432, 7168]) for n in ("gate", "up")],
        (LAYER0 + "mlp.down_proj.weight", "BF16", [7168, 18432]),
    ],
    "model-00002-of-00003.safetensors": [
        ("language_model.lm_head.weight", "BF16", [163840, 7168]),
        ("language_model.model.norm.weight", "BF16", [7168]),
    ],
    "model-00003-of-00003.safetensors": [("vision_tower.encoder.blocks.0.norm0.weight", "BF16", [1152])],
}


def write_sharded_kimi(out):
    """The shards above with their index; the vision shard is not a safetensors file at all (nothing reads it)."""
    out.mkdir()
    weight_map = {name: file for file, tensors in KIMI_SHARDS.items() for name, _, _ in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for file, tensors in KIMI_SHARDS.items():
        write_header_only(out / file, tensors)
    (out / "model-00003-of-00003.safetensors").write_bytes(b"not read: it holds none of the checked tensors")
    return out


def test_a_sharded_kimi_is_checked_through_its_index_reading_only_the_shards_that_hold_the_tensors(tmp_path):
    root = write_sharded_kimi(tmp_path / "kimi")
    config = json.loads(json.dumps(CONFIGS["kimi-k2.5"]))
    assert config_shape_problem(root, config, "language_model.") is None
    config["text_config"]["kv_lora_rank"] = 256
    assert config_shape_problem(root, config, "language_model.") == (
        f"target {root}: config.json does not describe its weights (text_config.kv_lora_rank 256, the weights 512): "
        f"{LAYER0}self_attn.kv_a_proj_with_mqa.weight in model-00001-of-00003.safetensors is [576, 7168], config.json "
        "gives [320, 7168] = [kv_lora_rank + qk_rope_head_dim = 256 + 64, hidden_size]; "
        f"{LAYER0}self_attn.kv_a_layernorm.weight in model-00001-of-00003.safetensors is [512], config.json gives "
        f"[256] = [kv_lora_rank]; {LAYER0}self_attn.kv_b_proj.weight in model-00001-of-00003.safetensors is "
        "[32768, 512], config.json gives [32768, 256] = [num_attention_heads * (qk_nope_head_dim + v_head_dim) = "
        "128 * (128 + 128), kv_lora_rank]; expected the config.json published with these weights: set "
        "text_config.kv_lora_rank to 512, or use the weights this config is for"
    )


def test_a_shard_the_index_names_that_is_not_there_is_an_incomplete_download(tmp_path):
    root = write_sharded_kimi(tmp_path / "kimi")
    (root / "model-00002-of-00003.safetensors").unlink()
    assert config_shape_problem(root, CONFIGS["kimi-k2.5"], "language_model.") == (
        f"target {root}: model.safetensors.index.json names 3 weight files, 1 of them not there "
        "(model-00002-of-00003.safetensors); expected every file of the checkpoint: the download is incomplete, "
        "finish it"
    )
