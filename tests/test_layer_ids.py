"""SGLang's numbering of aux layer ids per target class and release (eyas.layer_ids over the rules derived from
SGLang's source, eyas/sglang_layer_rules.py), and the run's checks that refuse ids SGLang cannot be given: when
the facts are resolved and before regeneration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from target_fixtures import write_target

from eyas.config import load_run_config
from eyas.facts import check_layer_ids
from eyas.layer_ids import SGLangTargetError, resolve_aux_layer_ids, sglang_convention, sglang_layer_ids

REPO = Path(__file__).resolve().parents[1]
KIMI = ["KimiK25ForConditionalGeneration"]
RULES_FILE = "eyas/sglang_layer_rules.py, derived by scripts/sglang_layer_rules.py from kits/sglang-wheels.txt"


def test_each_class_gets_the_rule_its_sglang_source_gives_it():
    assert sglang_convention(["MistralLarge3ForCausalLM"]) == "sglang_deepseek"  # inherits DeepseekV3ForCausalLM's
    assert sglang_convention(KIMI) == "sglang_deepseek"  # hands the ids to its DeepseekV3ForCausalLM language_model
    assert sglang_convention(["DeepseekV3ForCausalLM"]) == sglang_convention(["GlmMoeDsaForCausalLM"]) == (
        "sglang_deepseek"
    )
    llama_like = ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForConditionalGeneration", "GptOssForCausalLM")
    for name in llama_like:
        assert sglang_convention([name]) == "sglang_llama", name
    assert sglang_convention(KIMI, version="0.5.12") == "sglang_llama"  # before 0.5.14 DeepSeek adds 1 always
    assert sglang_convention(KIMI, version="0.5.14") == "sglang_deepseek"


def test_the_first_architecture_sglang_registers_decides_as_its_registry_does():
    assert sglang_convention(["NotAnSGLangClass", "DeepseekV3ForCausalLM"]) == "sglang_deepseek"
    assert sglang_convention(None) == sglang_convention([]) == "sglang_llama"  # a draft read without its target


def test_a_class_sglang_does_not_register_is_refused_not_guessed():
    with pytest.raises(SGLangTargetError) as err:
        sglang_convention(["MyNewModelForCausalLM"])
    assert str(err.value) == (
        "target architectures ['MyNewModelForCausalLM']: SGLang 0.5.23 registers none of them (it would run the target "
        "through its transformers fallback, which captures no aux states); the classes of SGLang 0.5.10..0.5.23 are "
        f"in {RULES_FILE}"
    )


def test_a_class_without_eagle3_capture_or_with_an_unreadable_rule_is_refused():
    with pytest.raises(SGLangTargetError) as err:
        sglang_convention(["GPT2LMHeadModel"])
    assert str(err.value).startswith(
        "target architecture GPT2LMHeadModel: SGLang 0.5.23 serves it without EAGLE-3 aux capture (the class has no "
        "set_eagle3_layers_to_capture"
    )
    with pytest.raises(SGLangTargetError) as err:
        sglang_convention(["MindSporeForCausalLM"])  # builds self.model from a class it picks at run time
    assert str(err.value) == (
        "target architecture MindSporeForCausalLM: SGLang 0.5.23 serves it, but which layers its "
        "set_eagle3_layers_to_capture captures could not be read from SGLang's source (self.model is built by an "
        "expression eyas cannot follow, and its set_eagle3_layers_to_capture is called); eyas does not guess it: "
        "teach scripts/sglang_layer_rules.py to read this class and rerun it"
    )


def test_an_unchecked_release_takes_its_neighbours_rule_only_where_they_agree():
    assert sglang_convention(KIMI, version="0.5.15") == "sglang_deepseek"  # 0.5.14 and 0.5.16 agree
    assert sglang_convention(KIMI, version="0.5.12.post1") == "sglang_llama"  # a tag counts as its release
    with pytest.raises(SGLangTargetError) as err:
        sglang_convention(KIMI, version="0.5.13")
    assert str(err.value) == (
        "SGLang 0.5.13: not a release eyas has checked, and its neighbours 0.5.12 and 0.5.14 number the aux layer ids "
        "of ['KimiK25ForConditionalGeneration'] differently (['plus_one'] vs ['plus_one_if_first_is_1']); add it to "
        "kits/sglang-wheels.txt and run `python scripts/sglang_layer_rules.py`"
    )
    with pytest.raises(SGLangTargetError, match=r"^SGLang 0\.5\.24: outside the releases eyas has checked"):
        sglang_convention(KIMI, version="0.5.24")


def test_aux_ids_must_be_ascending_as_sglang_packs_them_in_layer_order():
    with pytest.raises(ValueError) as err:
        resolve_aux_layer_ids([30, 2, 58], 61)
    assert str(err.value) == (
        "target.aux_layer_ids=[30, 2, 58]: expected ascending ids; SGLang concatenates the aux states in layer order "
        "whatever the order configured (its models collect them in the loop over the layers), so the features would "
        "not be in the order their ids name: write [2, 30, 58]"
    )


def test_ids_are_written_for_the_newest_release_and_read_alike_by_every_release_asked_for():
    assert sglang_layer_ids([2, 30, 58], KIMI, 61) == [1, 29, 57]  # 0.5.10-0.5.12 add 1 too: the same layers
    assert sglang_layer_ids([3, 30, 58], KIMI, 61, oldest_release="0.5.14") == [3, 30, 58]
    assert sglang_layer_ids([3, 16, 29], ["LlamaForCausalLM"], 32) == [2, 15, 28]
    with pytest.raises(SGLangTargetError) as err:
        sglang_layer_ids([3, 30, 58], KIMI, 61)
    assert str(err.value) == (
        "aux_layer_ids=[3, 30, 58] (hf_hidden_states) on KimiK25ForConditionalGeneration: written [3, 30, 58] for "
        "SGLang 0.5.23 (plus_one_if_first_is_1), SGLang 0.5.10 captures hidden_states [4, 31, 59] instead "
        "(KimiK25ForConditionalGeneration: plus_one); set export.sglang_version to 0.5.14 or newer, or choose ids "
        "every release reads alike (the default [2, 30, 58] is)"
    )
    with pytest.raises(SGLangTargetError, match=r"SGLang 0\.5\.12 captures hidden_states \[4, 31, 59\]"):
        sglang_layer_ids([3, 30, 58], KIMI, 61, oldest_release="0.5.13")  # unchecked: bounded by 0.5.12


def test_an_id_the_family_cannot_express_is_refused():
    with pytest.raises(SGLangTargetError) as err:
        sglang_layer_ids([1, 30, 58], ["MistralLarge3ForCausalLM"], 61)
    assert str(err.value).startswith(
        "target MistralLarge3ForCausalLM (SGLang 0.5.23, rule plus_one_if_first_is_1): aux_layer_ids=[1, 30, 58] "
        "(hf_hidden_states): cannot be written in sglang_deepseek: a first id of 1 makes the engine add 1 to every id"
    )
    assert sglang_layer_ids([1, 30, 58], ["LlamaForCausalLM"], 61) == [0, 29, 57]


def test_a_release_asked_for_that_does_not_serve_the_class_names_the_first_that_does():
    with pytest.raises(SGLangTargetError) as err:
        sglang_layer_ids([2, 20, 40], ["Glm5NextForConditionalGeneration"], 43)
    message = str(err.value)
    assert message.startswith("export.sglang_version='' asks for every SGLang release from 0.5.10: target ")
    assert message.endswith("; set export.sglang_version to 0.5.22 or newer")


# ---- the run: refused when the facts are resolved and before regeneration --------------------------------------


def run_config(tmp_path: Path, target: Path, aux_layer_ids: list[int] | None, sglang_version: str = ""):
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    target_config = base.target.model_copy(update={"model_path": str(target), "aux_layer_ids": aux_layer_ids})
    export = base.export.model_copy(update={"sglang_version": sglang_version})
    draft = base.draft.model_copy(update={"variant": "eagle3"})  # served by every release (norm_before_fc: 0.5.17)
    return base.model_copy(update={"workdir": str(tmp_path / "run"), "target": target_config, "export": export,
                                   "draft": draft})  # fmt: skip


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Config-only Kimi-K2.5 and Mistral-Large-3 (DeepSeek-V3's shape under its own class name) targets."""
    root = tmp_path_factory.mktemp("targets")
    mistral = write_target(root / "mistral-large-3", "deepseek-v3")
    config = json.loads((mistral / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "architectures": ["MistralLarge3ForCausalLM"]}))
    return {"kimi": write_target(root / "kimi-k2.5", "kimi-k2.5"), "mistral": mistral}


@pytest.mark.usefixtures("flush_prefect_logs")
def test_the_run_facts_refuse_hf_id_1_on_deepseek_family_targets(prefect_server, targets, tmp_path):
    from tasks.facts import check_run_layer_ids, resolve_run_facts  # prefect reads PREFECT_API_URL at import

    for name in ("kimi", "mistral"):
        config = run_config(tmp_path, targets[name], [1, 30, 58])
        with pytest.raises(SGLangTargetError, match=r"aux_layer_ids=\[1, 30, 58\].*a first id of 1"):
            resolve_run_facts.fn(config)  # before the facts need the tokenized table
        with pytest.raises(SGLangTargetError, match=r"a first id of 1"):
            check_run_layer_ids.fn(config)
    assert check_layer_ids(run_config(tmp_path, targets["kimi"], None)) == [2, 30, 58]
    with pytest.raises(SGLangTargetError, match=r"set export\.sglang_version to 0\.5\.14 or newer"):
        check_layer_ids(run_config(tmp_path, targets["kimi"], [3, 30, 58]))
    assert check_layer_ids(run_config(tmp_path, targets["kimi"], [3, 30, 58], "0.5.17")) == [3, 30, 58]
    with pytest.raises(ValueError, match=r"expected ascending ids"):
        check_layer_ids(run_config(tmp_path, targets["kimi"], [30, 2, 58]))


@pytest.mark.usefixtures("flush_prefect_logs")
def test_the_dataset_flow_refuses_them_before_any_answer_is_generated(prefect_server, targets, tmp_path):
    from flows.dataset import build_dataset_flow

    config = run_config(tmp_path, targets["kimi"], [1, 30, 58])
    with pytest.raises(SGLangTargetError, match=r"a first id of 1"):
        build_dataset_flow(config)
    assert not config.paths.dataset_dir.exists()  # no response log, no tokenizer loaded, nothing generated
