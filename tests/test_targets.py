"""A target's facts from config.json and weight headers, without remote code: the tiny Llama, and config-only
targets shaped like DeepSeek-V3 and Kimi-K2.5 (a multimodal wrapper around a DeepSeek-V3-style text model),
carried through the stages that read them: the extraction command (checked by SGLang's own code), the export
config, the benchmark's lint and `eyas engine-command`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from draft_fixtures import write_checkpoint
from sglang_conformance import resolved_server_info
from target_fixtures import write_target

from eyas.bench.sglang import lint_launch_command
from eyas.config import SGLangExtractConfig, load_run_config
from eyas.engines.sglang import SglangLaunch, build_launch_command
from eyas.export.configs import TargetRef
from eyas.export.convert import export_checkpoint
from eyas.extract.backends.sglang import build_extract_command, lint_server_info
from eyas.target import TargetError, TargetFacts, load_target
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
