"""Checkpoint formats as data: key maps, expected key sets and shapes, layer-id conventions.

A key map is `{eyas_key: destination_key | None}`; None marks a key deliberately dropped.
Every conversion is checked with `check_keys` against the exact key set and shapes the
destination expects, so that a loader which silently skips or never fills a parameter
(SGLang does both) cannot receive a checkpoint with a wrong key set.

Layer ids: eyas stores them as indices into Hugging Face `outputs.hidden_states`
(0 = embeddings, k = input of layer k). Engines are configured in their own numbering;
`to_engine_layer_ids` / `from_engine_layer_ids` are the only place where they are converted.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.draft import DraftArch

Shapes = dict[str, tuple[int, ...]]

# eyas state-dict key -> SGLang LlamaForCausalLMEagle3 checkpoint key (SpecForge / EAGLE naming).
# `midlayer.*` is loaded by every SGLang version (<= 0.5.10 drops `layers.0.*` without a word).
# embed_tokens is dropped: SGLang always replaces the draft's embedding with the target's.
SGLANG_KEY_MAP: dict[str, str | None] = {
    "embed_tokens.weight": None,
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight": "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}

# SGLang's LlamaForCausalLMEagle3 builds fc as Linear(3 * target_hidden_size, hidden_size).
SGLANG_NUM_AUX = 3


class KeyCheckError(ValueError):
    """A state dict's keys or shapes differ from what its destination expects."""


def expected_eyas_shapes(arch: DraftArch) -> Shapes:
    """Every key of an eyas draft state dict (see eyas/draft.py) and its shape."""
    h, heads, kv, hd = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    return {
        "embed_tokens.weight": (arch.target_vocab_size, h),
        "fc.weight": (h, arch.num_aux * h),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "midlayer.mlp.gate_proj.weight": (arch.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (arch.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, arch.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (arch.draft_vocab_size, h),
        "d2t": (arch.draft_vocab_size,),
        "t2d": (arch.target_vocab_size,),
    }


def expected_sglang_shapes(arch: DraftArch) -> Shapes:
    """The exact key set and shapes of an SGLang EAGLE-3 draft checkpoint for `arch`."""
    eyas_shapes = expected_eyas_shapes(arch)
    return {dst: eyas_shapes[src] for src, dst in SGLANG_KEY_MAP.items() if dst is not None}


def remap_keys(names, key_map: dict[str, str | None], where: str) -> dict[str, str]:
    """{source name: destination name} for every kept key; an unmapped source key is an error."""
    unknown = sorted(set(names) - set(key_map))
    if unknown:
        raise KeyCheckError(
            f"{where}: {len(unknown)} key(s) not in the key map: {', '.join(unknown)}; "
            f"expected only {sorted(key_map)}; add them to the map (None to drop them deliberately)"
        )
    return {name: key_map[name] for name in names if key_map[name] is not None}


def invert_key_map(key_map: dict[str, str | None]) -> dict[str, str]:
    """{destination name: source name} for the kept keys."""
    return {dst: src for src, dst in key_map.items() if dst is not None}


def check_keys(found: Shapes, expected: Shapes, where: str) -> None:
    """Raise one KeyCheckError listing every missing key, unexpected key and shape mismatch, sorted."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    mismatched = sorted(k for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    if not (missing or unexpected or mismatched):
        return
    lines = [f"{where}: key set differs from the expected one"]
    lines += [f"  missing: {k} (expected shape {list(expected[k])})" for k in missing]
    lines += [f"  unexpected: {k} (shape {list(found[k])})" for k in unexpected]
    lines += [f"  shape mismatch: {k}: found {list(found[k])}, expected {list(expected[k])}" for k in mismatched]
    lines.append(
        f"  ({len(missing)} missing, {len(unexpected)} unexpected, {len(mismatched)} shape mismatches); "
        "the checkpoint does not match this draft architecture or format: re-export it from the training checkpoint"
    )
    raise KeyCheckError("\n".join(lines))


@dataclass(frozen=True)
class LayerIdConvention:
    """How an engine numbers aux layers: configured id = canonical id + offset."""

    name: str
    offset: int
    description: str


LAYER_ID_CONVENTIONS: dict[str, LayerIdConvention] = {
    c.name: c
    for c in (
        LayerIdConvention(
            "hf_hidden_states", 0, "canonical: index into HF outputs.hidden_states (k = input of layer k)"
        ),
        LayerIdConvention(
            "sglang_llama", -1, "SGLang Llama/Qwen eagle_config ids: SGLang captures the input of layer id+1"
        ),
        LayerIdConvention("specforge", -1, "SpecForge: the output of layer id, i.e. HF hidden_states[id + 1]"),
    )
}


def _convention(name: str) -> LayerIdConvention:
    if name not in LAYER_ID_CONVENTIONS:
        raise ValueError(
            f"layer-id convention {name!r}: unknown; expected one of {sorted(LAYER_ID_CONVENTIONS)}; "
            "add the engine's rule to LAYER_ID_CONVENTIONS in eyas/formats.py"
        )
    return LAYER_ID_CONVENTIONS[name]


def to_engine_layer_ids(canonical: list[int], convention: str) -> list[int]:
    """Canonical (HF hidden_states) ids -> the ids to configure in `convention`."""
    offset = _convention(convention).offset
    engine = [i + offset for i in canonical]
    if any(i < 0 for i in engine):
        raise ValueError(
            f"aux_layer_ids={list(canonical)} (hf_hidden_states): gives {engine} in {convention}, "
            "expected ids >= 0; hidden_states[0] (the embeddings) cannot be captured by that engine"
        )
    return engine


def from_engine_layer_ids(engine: list[int], convention: str) -> list[int]:
    """Ids configured in `convention` -> canonical (HF hidden_states) ids."""
    offset = _convention(convention).offset
    return [i - offset for i in engine]
