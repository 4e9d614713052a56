"""config.json per destination: fields, layer-id conventions, norm options; reading them back."""

from __future__ import annotations

import pytest
from draft_fixtures import ARCH

from eyas.draft import DraftArch
from eyas.draft_keys import DRAFT_OPTIONS, vocab_mapping_problems
from eyas.export.configs import WRITTEN_NORM_OPTIONS, ConfigError, read_config, write_config
from eyas.export.keys import FORMATS

IDS = [2, 16, 29]  # canonical, a 32-layer target


def test_every_config_has_the_fields_engines_need_silently():
    for fmt in sorted(set(FORMATS) - {"eyas"}):
        config = write_config(fmt, ARCH, IDS, "bfloat16")
        assert config["draft_vocab_size"] == 512 and config["tie_word_embeddings"] is False, fmt
        info = read_config(fmt, config)
        assert info.problems == [] and info.arch["draft_vocab_size"] == 512, fmt
        assert info.aux_layer_ids == (None if fmt == "eagle" else IDS), fmt


def test_layer_ids_are_written_in_each_destination_convention():
    def where(config):
        return config.get("eagle_aux_hidden_state_layer_ids"), config.get("eagle_config")

    assert where(write_config("sglang", ARCH, IDS, "float32")) == (
        None,
        {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": True},
    )
    assert where(write_config("sglang-0.5.12", ARCH, IDS, "float32"))[1]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        15,
        28,
    ]
    assert where(write_config("vllm", ARCH, IDS, "float32")) == (IDS, {"use_aux_hidden_state": True})
    assert where(write_config("speculators", ARCH, IDS, "float32")) == (IDS, None)
    assert where(write_config("eagle", ARCH, IDS, "float32")) == (None, {"use_aux_hidden_state": True})


def test_norm_options_are_written_only_where_implemented():
    assert WRITTEN_NORM_OPTIONS == {
        "eyas": (),
        "sglang": (),
        "sglang-0.5.12": (),
        "eagle": (),
        "vllm": ("norm_before_residual", "norm_before_fc"),
        "speculators": ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"),
    }
    for fmt, options in WRITTEN_NORM_OPTIONS.items():
        if fmt == "eyas":
            continue
        config = write_config(fmt, ARCH, IDS, "float32")
        assert {k: v for k, v in config.items() if k in DRAFT_OPTIONS} == dict.fromkeys(options, False), fmt


def test_options_are_written_where_the_destination_reads_them():
    arch = DraftArch(**{**ARCH.to_dict(), "norm_before_fc": True, "fc_norm": True, "norm_output": True})
    sglang = write_config("sglang", arch, IDS, "float32")
    assert {k: sglang[k] for k in DRAFT_OPTIONS if k in sglang} == {
        "norm_before_fc": True,
        "fc_norm": True,
        "norm_output": True,
    }
    spec = write_config("speculators", arch, IDS, "float32")
    assert {k: spec[k] for k in DRAFT_OPTIONS} == {**dict.fromkeys(DRAFT_OPTIONS, True), "norm_before_residual": False}
    for fmt in ("sglang", "speculators"):
        info = read_config(fmt, write_config(fmt, arch, IDS, "float32"))
        assert DraftArch(**info.arch) == arch and info.problems == [], fmt


def test_speculators_config_is_pinned():
    config = write_config("speculators", ARCH, IDS, "bfloat16")
    assert config["architectures"] == ["Eagle3DraftModel"] and config["speculators_model_type"] == "eagle3"
    assert config["dtype"] == "bfloat16" and "use_aux_hidden_state" not in config
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 2048
    assert "draft_vocab_size" not in layer and config["target_hidden_size"] == 64
    assert config["speculators_config"]["algorithm"] == "eagle3"


def test_an_option_no_engine_of_the_format_runs_is_a_problem():
    config = {**write_config("sglang", ARCH, IDS, "float32"), "norm_before_residual": True}
    assert read_config("sglang", config).problems == [
        "norm_before_residual: no SGLang version runs it (checked 0.5.10-0.5.23); SGLang would run the draft "
        "without it, a layer it was not trained with: serve it with vLLM or speculators, or retrain without it"
    ]
    config = {**write_config("vllm", ARCH, IDS, "float32"), "norm_before_fc": True}
    assert read_config("vllm", config).problems == [
        "norm_before_fc: vllm does not run it (the flag is ignored or the tensor refused and the draft runs a "
        "layer it was not trained with); served by sglang>=0.5.17, speculators>=0.9: export to one of those"
    ]
    config = {**write_config("speculators", ARCH, IDS, "float32"), "norm_before_fc": True}
    info = read_config("speculators", config)
    assert info.problems == [] and info.arch["norm_before_fc"] is True


def test_sliding_window_layers_are_refused():
    config = write_config("speculators", ARCH, IDS, "float32")
    config["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=4096)
    assert read_config("speculators", config).problems == [
        "sliding_window=4096: the draft layer attends to a window; eyas's reference engine runs full attention "
        "and SGLang takes a draft window only from its --speculative-draft-window-size server argument, not from "
        "config.json: serve it with its own tools or retrain with full attention"
    ]


def test_a_config_without_llama_fields_is_refused():
    with pytest.raises(ConfigError, match=r"vllm config: missing \['hidden_size', 'intermediate_size'\]; "):
        read_config("vllm", {"num_attention_heads": 4, "vocab_size": 9})


def test_vocab_problems_match_eyas_vocab_messages():
    assert vocab_mapping_problems([0, 1, 1], [True, False, True, False, True, True], 3) == [
        "t2d marks 4 target ids, d2t has 3, expected draft_vocab_size=3; the vocab mapping does not belong to "
        "this draft: rebuild it with the same draft_vocab_size"
    ]
    assert vocab_mapping_problems([0, 1, 2], [True, False, True, False, True], 3) == []
