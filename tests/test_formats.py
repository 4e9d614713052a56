"""Key maps, expected key sets and shapes, key checking and layer-id conventions."""

from __future__ import annotations

import pytest
from draft_fixtures import ARCH

from eyas.draft import DraftArch, Eagle3Draft
from eyas.draft_keys import KeyCheckError, expected_eyas_shapes
from eyas.export.keys import FORMATS, check_keys, expected_shapes, invert_key_map, remap_keys
from eyas.export.serving import ENGINES
from eyas.layer_ids import LAYER_ID_CONVENTIONS, from_engine_layer_ids, to_engine_layer_ids


def test_sglang_key_map_is_pinned():
    kept = {k: v for k, v in FORMATS["sglang"].key_map.items() if v is not None}
    assert FORMATS["sglang"].key_map["embed_tokens.weight"] is None
    assert sorted(kept.values()) == [
        "d2t",
        "fc.weight",
        "lm_head.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.mlp.down_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "norm.weight",
        "t2d",
    ]
    assert all(k == v for k, v in kept.items())


def test_expected_sglang_shapes_are_pinned():
    assert expected_shapes("sglang", ARCH) == {
        "fc.weight": (64, 192),
        "midlayer.input_layernorm.weight": (64,),
        "midlayer.hidden_norm.weight": (64,),
        "midlayer.post_attention_layernorm.weight": (64,),
        "midlayer.self_attn.q_proj.weight": (64, 128),
        "midlayer.self_attn.k_proj.weight": (32, 128),
        "midlayer.self_attn.v_proj.weight": (32, 128),
        "midlayer.self_attn.o_proj.weight": (64, 64),
        "midlayer.mlp.gate_proj.weight": (128, 64),
        "midlayer.mlp.up_proj.weight": (128, 64),
        "midlayer.mlp.down_proj.weight": (64, 128),
        "norm.weight": (64,),
        "lm_head.weight": (512, 64),
        "d2t": (512,),
        "t2d": (2048,),
    }


def test_expected_eyas_shapes_match_the_draft_module():
    state = Eagle3Draft(ARCH).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_eyas_shapes(ARCH)
    assert set(FORMATS["sglang"].key_map) == set(state)


def test_check_keys_accepts_the_exact_set():
    check_keys(expected_shapes("sglang", ARCH), expected_shapes("sglang", ARCH), where="x")


def test_check_keys_lists_every_offender_sorted_in_one_error():
    expected = {"a": (1,), "b": (2, 3), "c": (4,), "d": (5,)}
    found = {"b": (3, 2), "d": (5,), "z": (7,), "layers.0.x": (1,)}
    with pytest.raises(KeyCheckError) as err:
        check_keys(found, expected, where="export out/model.safetensors")
    assert str(err.value) == (
        "export out/model.safetensors: key set differs from the expected one\n"
        "  missing: a (expected shape [1])\n"
        "  missing: c (expected shape [4])\n"
        "  unexpected: layers.0.x (shape [1])\n"
        "  unexpected: z (shape [7])\n"
        "  shape mismatch: b: found [3, 2], expected [2, 3]\n"
        "  (2 missing, 2 unexpected, 1 shape mismatches); the checkpoint does not match this draft "
        "architecture or format: re-export it from the training checkpoint"
    )


def test_remap_keys_refuses_a_key_the_map_does_not_know():
    with pytest.raises(KeyCheckError, match=r"ckpt: 1 key\(s\) not in the key map: layers.0.mlp.up_proj.weight;"):
        remap_keys(["fc.weight", "layers.0.mlp.up_proj.weight"], FORMATS["sglang"].key_map, where="ckpt")


def test_remap_keys_drops_embed_tokens_and_inverts():
    names = remap_keys(list(FORMATS["sglang"].key_map), FORMATS["sglang"].key_map, where="ckpt")
    assert "embed_tokens.weight" not in names
    assert invert_key_map(FORMATS["sglang"].key_map) == {v: k for k, v in names.items()}


def test_sglang_layer_ids_are_canonical_minus_one():
    assert to_engine_layer_ids([2, 16, 29], "sglang_llama") == [1, 15, 28]
    assert from_engine_layer_ids([1, 15, 28], "sglang_llama") == [2, 16, 29]
    assert to_engine_layer_ids([2, 30, 58], "hf_hidden_states") == [2, 30, 58]
    assert to_engine_layer_ids([2, 16, 29], "specforge") == [1, 15, 28]


def test_layer_id_conventions_are_pinned():
    assert {n: c.offset for n, c in LAYER_ID_CONVENTIONS.items()} == {
        "hf_hidden_states": 0,
        "sglang_llama": -1,
        "sglang_deepseek": 0,
        "specforge": -1,
        "vllm": 0,
        "speculators": 0,
        "eagle_fixed": 0,
    }
    assert {n: c.shift_if_first for n, c in LAYER_ID_CONVENTIONS.items() if c.shift_if_first} == {"sglang_deepseek": 1}


def test_unknown_convention_is_refused():
    expected = r"layer-id convention 'tensorrt': unknown; expected one of \['eagle_fixed', 'hf_hidden_states', "
    with pytest.raises(ValueError, match=expected):
        to_engine_layer_ids([2], "tensorrt")


def test_embeddings_cannot_be_captured_by_sglang():
    expected = r"aux_layer_ids=\[0, 4\] \(hf_hidden_states\): gives \[-1, 3\] in sglang_llama"
    with pytest.raises(ValueError, match=expected):
        to_engine_layer_ids([0, 4], "sglang_llama")


def test_every_format_key_map_is_pinned():
    layout = {}
    for name, fmt in FORMATS.items():
        assert set(fmt.key_map) == set(expected_eyas_shapes(ARCH)), name
        kept = [v for v in fmt.key_map.values() if v is not None]
        prefixes = sorted({k.split(".")[0] for k in kept if k.count(".") > 1})
        layout[name] = (prefixes, fmt.key_map["embed_tokens.weight"] is not None, fmt.layer_id_convention)
    assert layout == {
        "eyas": (["midlayer"], True, "hf_hidden_states"),
        "sglang": (["midlayer"], False, "sglang_llama"),
        "sglang-0.5.12": (["layers"], False, "sglang_llama"),
        "vllm": (["midlayer"], False, "vllm"),
        "speculators": (["layers"], True, "speculators"),
        "eagle": (["midlayer"], False, "eagle_fixed"),
    }
    assert FORMATS["speculators"].key_map["midlayer.mlp.up_proj.weight"] == "layers.0.mlp.up_proj.weight"


def test_engines_are_pinned():
    assert {name: (e.formats, e.options) for name, e in ENGINES.items()} == {
        # vllm's key set loads in SGLang, but its top-level layer ids are not read there: not served
        "sglang<=0.5.11": (("sglang", "eagle"), ()),
        "sglang>=0.5.12": (("sglang", "sglang-0.5.12", "eagle"), ("fc_norm", "norm_output")),
        "sglang>=0.5.17": (
            ("sglang", "sglang-0.5.12", "eagle"),
            ("norm_before_fc", "fc_norm", "norm_output"),
        ),
        "vllm": (("sglang", "sglang-0.5.12", "vllm", "speculators", "eagle"), ("norm_before_residual",)),
        "speculators>=0.9": (("speculators",), ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")),
    }


def test_option_tensors_keep_their_names_in_every_format():
    arch = DraftArch(**{**ARCH.to_dict(), "norm_before_fc": True, "fc_norm": True})
    state = Eagle3Draft(arch).state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected_eyas_shapes(arch)
    added = {
        "input_norm.weight": (192,),
        "fc_norm.0.weight": (64,),
        "fc_norm.1.weight": (64,),
        "fc_norm.2.weight": (64,),
    }
    for name in FORMATS:
        shapes = expected_shapes(name, arch)
        assert {k: shapes[k] for k in added} == added and len(shapes) == len(expected_shapes(name, ARCH)) + 4, name


def test_expected_shapes_follow_the_key_map():
    spec = expected_shapes("speculators", ARCH)
    assert spec["embed_tokens.weight"] == (2048, 64) and spec["layers.0.self_attn.q_proj.weight"] == (64, 128)
    assert expected_shapes("eyas", ARCH) == expected_eyas_shapes(ARCH)


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match=r"checkpoint format 'tgi': unknown; expected one of \['eagle', 'eyas', "):
        expected_shapes("tgi", ARCH)


def test_check_keys_explains_silent_loader_failures_for_the_format():
    found = {"layers.0.x": (1,)}
    with pytest.raises(KeyCheckError) as err:
        check_keys(found, {"midlayer.x": (1,)}, where="w", fmt="sglang")
    assert str(err.value).splitlines()[-2:] == [
        "  why: SGLang <= 0.5.11 silently drops layers.0.* and runs the midlayer with random weights: "
        "rename them to midlayer.* (eyas remap --to sglang)",
        "  why: midlayer tensors are missing: the engine keeps their random init without a word "
        "(SGLang never reports unfilled parameters): re-export from the training checkpoint",
    ]


def test_deepseek_ids_shift_only_when_the_first_id_is_one():
    assert to_engine_layer_ids([2, 30, 58], "sglang_deepseek") == [1, 29, 57]
    assert from_engine_layer_ids([1, 29, 57], "sglang_deepseek") == [2, 30, 58]
    assert to_engine_layer_ids([3, 30, 58], "sglang_deepseek") == [3, 30, 58]
    assert from_engine_layer_ids([3, 30, 58], "sglang_deepseek") == [3, 30, 58]
    with pytest.raises(ValueError, match=r"aux_layer_ids=\[1, 30, 58\] \(hf_hidden_states\): cannot be written in "):
        to_engine_layer_ids([1, 30, 58], "sglang_deepseek")


def test_vllm_and_speculators_ids_are_canonical():
    assert to_engine_layer_ids([2, 16, 29], "vllm") == [2, 16, 29]
    assert to_engine_layer_ids([2, 16, 32], "speculators") == [2, 16, 32]
