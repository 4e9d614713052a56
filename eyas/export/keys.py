"""Checkpoint formats as data: key maps and the exact key set and shapes each destination expects.

A key map is `{eyas_key: destination_key | None}`; None marks a key deliberately dropped.
Every conversion goes through the eyas form (eyas.draft_keys) and is checked with `check_keys`
against the exact key set and shapes the destination expects, so that a loader which silently
skips or never fills a parameter (SGLang does both) cannot receive a checkpoint with a wrong key
set; the error says why each offender matters for that format (KEY_HINTS).

Formats (FORMATS): `eyas` (training checkpoints), `sglang` (`midlayer.*`: loaded by every SGLang
version), `sglang-0.5.12` (`layers.0.*`: SGLang >= 0.5.12 only, <= 0.5.11 drops it silently),
`vllm`, `speculators` (`layers.0.*`, keeps embed_tokens) and `eagle` (EAGLE official /
SpecForge naming, layer ids fixed by the target's code). eyas.export.serving says which key sets and
draft options each engine version serves. A draft option's tensors (eyas.draft_keys.option_shapes) keep
their names in every format: `Format.key_map_for(arch)`. A draft of num_layers > 1 keeps `layers.{i}.*` in
the formats that hold a stack (`eyas`, `sglang-0.5.12`: `Format.stack`); the others have no place for it.

Each format's layer-id convention names a rule of eyas.layer_ids. This module imports no torch:
`eyas inspect` uses it on headers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from eyas.draft_keys import (
    EYAS_LAYER_PREFIX,
    LAYER_KEYS,
    TOP_KEYS,
    KeyCheckError,
    Shapes,
    check_key_set,
    expected_eyas_shapes,
    layer_prefixes,
    option_shapes,
)
from eyas.layer_ids import sglang_convention

if TYPE_CHECKING:
    from eyas.draft import DraftArch


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
    stack: bool = False  # holds a draft of num_layers > 1, as layers.{i}.* (the eyas names)

    def key_map_for(self, arch) -> dict[str, str | None]:
        """The key map of a draft with `arch`: the plain draft's map and its option tensors, which keep their
        names; for num_layers > 1, every layers.{i}.* key keeps its name (a format without `stack` refuses)."""
        num_layers = getattr(arch, "num_layers", 1)
        if num_layers == 1:
            return {**self.key_map, **{k: k for k in option_shapes(arch)}}
        if not self.stack:
            stacks = sorted(f.name for f in FORMATS.values() if f.stack)
            raise ValueError(
                f"format {self.name}: holds one draft layer, found num_layers={num_layers}; export a stack to one "
                f"of {stacks}"
            )
        kept = {k: v for k, v in self.key_map.items() if not k.startswith(EYAS_LAYER_PREFIX)}
        layers = {k: k for k in expected_eyas_shapes(arch) if k.startswith(tuple(layer_prefixes(num_layers)))}
        return {**kept, **layers, **{k: k for k in option_shapes(arch)}}


# embed_tokens is dropped wherever the engine replaces the draft's embedding with the target's
# (SGLang always; vLLM shares the target's when the checkpoint has none; EAGLE loads the base model's).
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("eyas", _key_map("midlayer.", keep_embed=True), "hf_hidden_states", "eyas training checkpoint", True),
        Format("sglang", _key_map("midlayer.", keep_embed=False), "sglang_llama", "SGLang, every version"),
        Format("sglang-0.5.12", _key_map("layers.0.", keep_embed=False), "sglang_llama", "SGLang >= 0.5.12 only", True),
        Format("vllm", _key_map("midlayer.", keep_embed=False), "vllm", "vLLM Eagle3LlamaForCausalLM"),
        Format("speculators", _key_map("layers.0.", keep_embed=True), "speculators", "speculators >= 0.9"),
        Format("eagle", _key_map("midlayer.", keep_embed=False), "eagle_fixed", "EAGLE official / SpecForge"),
    )
}


def format_convention(fmt: str, target_architectures: list[str] | None = None) -> str:
    """The layer-id convention a `fmt` config is written in for a target of these architectures: SGLang reads
    eagle_config ids of a DeepSeek-family target in its conditional numbering (eyas.layer_ids)."""
    convention = get_format(fmt).layer_id_convention
    return sglang_convention(target_architectures) if convention == "sglang_llama" else convention


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(
            f"checkpoint format {name!r}: unknown; expected one of {sorted(FORMATS)}; "
            "add the dialect to FORMATS in eyas/export/keys.py"
        )
    return FORMATS[name]


def expected_shapes(fmt: str, arch: DraftArch) -> Shapes:
    """The exact key set and shapes of a `fmt` checkpoint of a draft with `arch`."""
    key_map = get_format(fmt).key_map_for(arch)
    return {key_map[src]: shape for src, shape in expected_eyas_shapes(arch).items() if key_map[src] is not None}


def derivable_keys(fmt: str, arch, found) -> dict[str, str]:
    """{key: why it may be absent} for the keys of `fmt`'s set that a producer leaves out because every engine
    derives them: embed_tokens of a speculators draft (speculators and vLLM then take the target's, as the
    EAGLE converter writes it), d2t/t2d of a draft over the whole target vocab (the identity mapping)."""
    derivable = {}
    if fmt == "speculators" and "embed_tokens.weight" not in found:
        derivable["embed_tokens.weight"] = "embed_tokens: absent; speculators and vLLM take the target's embedding"
    if arch.draft_vocab_size == arch.target_vocab_size and not ({"d2t", "t2d"} & set(found)):
        why = "d2t/t2d: absent, the draft vocab is the whole target vocab (identity mapping)"
        derivable.update({"d2t": why, "t2d": why})
    return derivable


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
        "SGLang <= 0.5.11 silently drops layers.0.* and runs the midlayer with random weights: "
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
    """eyas.draft_keys.check_key_set, with the KEY_HINTS of format `fmt` saying why an offender matters."""
    check_key_set(found, expected, where, hints=None if fmt is None else lambda m, u: key_hints(fmt, m, u))
