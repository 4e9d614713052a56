"""Checkpoint formats as data: key maps, expected key sets and shapes, layer-id conventions.

A key map is `{eyas_key: destination_key | None}`; None marks a key deliberately dropped.
Every conversion goes through the eyas form (the state dict of eyas/draft.py) and is checked
with `check_keys` against the exact key set and shapes the destination expects, so that a
loader which silently skips or never fills a parameter (SGLang does both) cannot receive a
checkpoint with a wrong key set.

Formats (FORMATS): `eyas` (training checkpoints), `sglang` (`midlayer.*`: loaded by every SGLang
version), `sglang-0.5.12` (`layers.0.*`: SGLang >= 0.5.12 only, <= 0.5.10 drops it silently),
`vllm`, `speculators` (`layers.0.*`, keeps embed_tokens) and `eagle` (EAGLE official /
SpecForge naming, layer ids fixed by the target's code). ENGINE_LOADS says which key sets each
engine version loads completely.

Layer ids: eyas stores them as indices into Hugging Face `outputs.hidden_states`
(0 = embeddings, k = input of layer k). Engines are configured in their own numbering;
`to_engine_layer_ids` / `from_engine_layer_ids` are the only place where they are converted.
This module imports no torch: `eyas inspect` uses it on headers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eyas.draft import DraftArch

Shapes = dict[str, tuple[int, ...]]

# The decoder layer's tensors, relative to its prefix (`midlayer.` in eyas).
LAYER_KEYS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
TOP_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
EYAS_LAYER_PREFIX = "midlayer."


def _key_map(layer_prefix: str, *, keep_embed: bool) -> dict[str, str | None]:
    mapping: dict[str, str | None] = {"embed_tokens.weight": "embed_tokens.weight" if keep_embed else None}
    mapping.update({f"{EYAS_LAYER_PREFIX}{k}": f"{layer_prefix}{k}" for k in LAYER_KEYS})
    mapping.update({k: k for k in TOP_KEYS})
    return mapping


@dataclass(frozen=True)
class Format:
    """One checkpoint dialect: its key map from the eyas form and where its layer ids live."""

    name: str
    key_map: dict[str, str | None]
    layer_id_convention: str
    description: str


# embed_tokens is dropped wherever the engine replaces the draft's embedding with the target's
# (SGLang always; vLLM shares the target's when the checkpoint has none; EAGLE loads the base model's).
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("eyas", _key_map("midlayer.", keep_embed=True), "hf_hidden_states", "eyas training checkpoint"),
        Format("sglang", _key_map("midlayer.", keep_embed=False), "sglang_llama", "SGLang, every version"),
        Format("sglang-0.5.12", _key_map("layers.0.", keep_embed=False), "sglang_llama", "SGLang >= 0.5.12 only"),
        Format("vllm", _key_map("midlayer.", keep_embed=False), "vllm", "vLLM Eagle3LlamaForCausalLM"),
        Format("speculators", _key_map("layers.0.", keep_embed=True), "speculators", "speculators >= 0.9"),
        Format("eagle", _key_map("midlayer.", keep_embed=False), "eagle_fixed", "EAGLE official / SpecForge"),
    )
}

# Which formats' exact key sets each engine version loads with every parameter filled.
ENGINE_LOADS: dict[str, tuple[str, ...]] = {
    "sglang<=0.5.10": ("sglang", "vllm", "eagle"),
    "sglang>=0.5.12": ("sglang", "sglang-0.5.12", "vllm", "eagle"),
    "vllm": ("sglang", "sglang-0.5.12", "vllm", "speculators", "eagle"),
    "speculators>=0.9": ("speculators",),
}

SGLANG_KEY_MAP = FORMATS["sglang"].key_map

# SGLang's LlamaForCausalLMEagle3 builds fc as Linear(3 * target_hidden_size, hidden_size).
SGLANG_NUM_AUX = 3


class KeyCheckError(ValueError):
    """A state dict's keys or shapes differ from what its destination expects."""


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(
            f"checkpoint format {name!r}: unknown; expected one of {sorted(FORMATS)}; "
            "add the dialect to FORMATS in eyas/formats.py"
        )
    return FORMATS[name]


def expected_eyas_shapes(arch: DraftArch) -> Shapes:
    """Every key of an eyas draft state dict (see eyas/draft.py) and its shape."""
    h, heads, kv, hd = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    layer = {
        "input_layernorm.weight": (h,),
        "hidden_norm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, 2 * h),
        "self_attn.k_proj.weight": (kv * hd, 2 * h),
        "self_attn.v_proj.weight": (kv * hd, 2 * h),
        "self_attn.o_proj.weight": (h, heads * hd),
        "mlp.gate_proj.weight": (arch.intermediate_size, h),
        "mlp.up_proj.weight": (arch.intermediate_size, h),
        "mlp.down_proj.weight": (h, arch.intermediate_size),
    }
    return {
        "embed_tokens.weight": (arch.target_vocab_size, h),
        "fc.weight": (h, arch.num_aux * h),
        **{f"{EYAS_LAYER_PREFIX}{k}": v for k, v in layer.items()},
        "norm.weight": (h,),
        "lm_head.weight": (arch.draft_vocab_size, h),
        "d2t": (arch.draft_vocab_size,),
        "t2d": (arch.target_vocab_size,),
    }


def expected_shapes(fmt: str, arch: DraftArch) -> Shapes:
    """The exact key set and shapes of a `fmt` checkpoint of a draft with `arch`."""
    eyas_shapes = expected_eyas_shapes(arch)
    return {dst: eyas_shapes[src] for src, dst in get_format(fmt).key_map.items() if dst is not None}


def expected_sglang_shapes(arch: DraftArch) -> Shapes:
    """The exact key set and shapes of an SGLang EAGLE-3 draft checkpoint for `arch`."""
    return expected_shapes("sglang", arch)


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


# Why an offender matters, for the formats whose loaders fail silently: (kind, key prefix, formats, why).
KEY_HINTS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    (
        "unexpected",
        "layers.0.",
        ("sglang", "vllm", "eagle"),
        "SGLang <= 0.5.10 silently drops layers.0.* and runs the midlayer with random weights: "
        "rename them to midlayer.* (eyas remap --to sglang)",
    ),
    (
        "missing",
        "midlayer.",
        ("sglang", "vllm", "eagle", "eyas"),
        "midlayer tensors are missing: the engine keeps their random init without a word "
        "(SGLang never reports unfilled parameters): re-export from the training checkpoint",
    ),
    (
        "missing",
        "layers.0.",
        ("sglang-0.5.12", "speculators"),
        "layers.0 tensors are missing: the engine keeps their random init without a word: "
        "re-export from the training checkpoint",
    ),
    (
        "unexpected",
        "embed_tokens.",
        ("sglang", "sglang-0.5.12", "vllm", "eagle"),
        "the engine replaces the draft's embed_tokens with the target's (SGLang always): a trained "
        "embedding would be discarded, a frozen copy is dead weight: drop it (eyas remap)",
    ),
    (
        "missing",
        "d2t",
        tuple(FORMATS),
        "without d2t the draft's token ids are not mapped to target ids when draft_vocab_size < vocab_size "
        "(acceptance about 1.1): export d2t (offsets) with the weights",
    ),
)


def key_hints(fmt: str, missing: list[str], unexpected: list[str]) -> list[str]:
    """The KEY_HINTS that apply to these offenders in format `fmt`, in table order."""
    offenders = {"missing": missing, "unexpected": unexpected}
    return [
        why
        for kind, prefix, formats, why in KEY_HINTS
        if fmt in formats and any(k.startswith(prefix) for k in offenders[kind])
    ]


def check_keys(found: Shapes, expected: Shapes, where: str, *, fmt: str | None = None) -> None:
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
    if fmt is not None:
        lines += [f"  why: {why}" for why in key_hints(fmt, missing, unexpected)]
    raise KeyCheckError("\n".join(lines))


@dataclass(frozen=True)
class LayerIdConvention:
    """How an engine numbers aux layers: configured id = canonical id + offset.

    `shift_if_first` marks a conditional rule: the engine adds 1 to every id only when the first
    configured id equals it (SGLang DeepSeek/Kimi >= 0.5.14).
    """

    name: str
    offset: int
    description: str
    shift_if_first: int | None = None


LAYER_ID_CONVENTIONS: dict[str, LayerIdConvention] = {
    c.name: c
    for c in (
        LayerIdConvention(
            "hf_hidden_states", 0, "canonical: index into HF outputs.hidden_states (k = input of layer k)"
        ),
        LayerIdConvention(
            "sglang_llama", -1, "SGLang Llama/Qwen eagle_config ids: SGLang captures the input of layer id+1"
        ),
        LayerIdConvention(
            "sglang_deepseek",
            0,
            "SGLang DeepSeek/Kimi >= 0.5.14: adds 1 to every id only when the first id is 1",
            shift_if_first=1,
        ),
        LayerIdConvention("specforge", -1, "SpecForge: the output of layer id, i.e. HF hidden_states[id + 1]"),
        LayerIdConvention("vllm", 0, "vLLM top-level ids: captures the input of layer id (canonical)"),
        LayerIdConvention("speculators", 0, "speculators: HF hidden_states indices, N = the final state"),
        LayerIdConvention("eagle_fixed", 0, "EAGLE official: fixed [2, N//2, N-3] in the target's code"),
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
    conv = _convention(convention)
    if conv.shift_if_first is not None:
        return _to_conditional(list(canonical), conv)
    engine = [i + conv.offset for i in canonical]
    if any(i < 0 for i in engine):
        raise ValueError(
            f"aux_layer_ids={list(canonical)} (hf_hidden_states): gives {engine} in {convention}, "
            "expected ids >= 0; hidden_states[0] (the embeddings) cannot be captured by that engine"
        )
    return engine


def _to_conditional(canonical: list[int], conv: LayerIdConvention) -> list[int]:
    shift = conv.shift_if_first
    if canonical and canonical[0] == shift + 1:
        return [i - 1 for i in canonical]
    if canonical and canonical[0] == shift:
        raise ValueError(
            f"aux_layer_ids={canonical} (hf_hidden_states): cannot be written in {conv.name}: a first id of "
            f"{shift} makes the engine add 1 to every id ({conv.description}); choose a first layer other than {shift}"
        )
    return list(canonical)


def from_engine_layer_ids(engine: list[int], convention: str) -> list[int]:
    """Ids configured in `convention` -> canonical (HF hidden_states) ids."""
    conv = _convention(convention)
    if conv.shift_if_first is not None:
        return [i + 1 for i in engine] if engine and engine[0] == conv.shift_if_first else list(engine)
    return [i - conv.offset for i in engine]


def default_canonical_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers for an N-layer target, canonical: [2, N//2, N-3]."""
    return [2, num_layers // 2, num_layers - 3]
