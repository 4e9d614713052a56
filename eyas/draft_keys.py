"""The eyas draft's state-dict keys and shapes, the exact key-set check every reader and writer uses, and the
check of its vocab mapping (d2t offsets, t2d mask).

    check_key_set(found_shapes, expected_eyas_shapes(arch), where="checkpoint run/step-00000400")

The key set is the one of eyas/draft.py's Eagle3Draft (tests/test_formats.py pins the two equal). A
check lists every missing key, unexpected key and shape mismatch, sorted, in one KeyCheckError.
No torch here: `eyas inspect` uses this module on headers only.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

Shapes = dict[str, tuple[int, ...]]


# The first decoder layer's tensors, relative to its prefix (`midlayer.` in eyas; a later layer of a stack has
# no input_layernorm: layer_shapes).
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


def option_shapes(arch) -> Shapes:
    """The tensors the draft options of `arch` add (same names in every format): input_norm.weight for
    norm_before_fc, fc_norm.{i}.weight for fc_norm; norm_before_residual and norm_output add none."""
    h, n = arch.hidden_size, arch.num_aux
    shapes: Shapes = {}
    if getattr(arch, "norm_before_fc", False):
        shapes["input_norm.weight"] = (n * h,)
    if getattr(arch, "fc_norm", False):
        shapes.update({f"fc_norm.{i}.weight": (h,) for i in range(n)})
    return shapes


EYAS_LAYER_PREFIX = "midlayer."


def layer_prefixes(num_layers: int) -> list[str]:
    """The eyas prefixes of a draft's decoder layers: `midlayer.` alone, or `layers.0.` .. `layers.{n-1}.`."""
    return [EYAS_LAYER_PREFIX] if num_layers == 1 else [f"layers.{i}." for i in range(num_layers)]


def layer_shapes(arch, first: bool) -> Shapes:
    """A decoder layer's tensors and shapes, relative to its prefix: the first takes cat(embeds, hidden) into
    2H-wide q/k/v; a later one has no input_layernorm and H-wide q/k/v (SGLang's LlamaDecoderLayer, is_input_layer)."""
    h, heads, kv, hd = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    width = 2 * h if first else h
    shapes = {
        "input_layernorm.weight": (h,),
        "hidden_norm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * hd, width),
        "self_attn.k_proj.weight": (kv * hd, width),
        "self_attn.v_proj.weight": (kv * hd, width),
        "self_attn.o_proj.weight": (h, heads * hd),
        "mlp.gate_proj.weight": (arch.intermediate_size, h),
        "mlp.up_proj.weight": (arch.intermediate_size, h),
        "mlp.down_proj.weight": (h, arch.intermediate_size),
    }
    if not first:
        del shapes["input_layernorm.weight"]
    return shapes


# Variants of the EAGLE-3 draft layer (eyas.draft says what each does); all off in a plain draft.
DRAFT_OPTIONS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")


class KeyCheckError(ValueError):
    """A state dict's keys or shapes differ from what its destination expects."""


def expected_eyas_shapes(arch) -> Shapes:
    """Every key of an eyas draft state dict (see eyas/draft.py) and its shape; `arch` is a DraftArch or anything
    with its fields (eyas inspect passes the fields a config names)."""
    h = arch.hidden_size
    prefixes = layer_prefixes(getattr(arch, "num_layers", 1))
    layers = {
        f"{prefix}{k}": v for i, prefix in enumerate(prefixes) for k, v in layer_shapes(arch, first=i == 0).items()
    }
    return {
        "embed_tokens.weight": (arch.target_vocab_size, h),
        **option_shapes(arch),
        "fc.weight": (h, arch.num_aux * h),
        **layers,
        "norm.weight": (h,),
        "lm_head.weight": (arch.draft_vocab_size, h),
        "d2t": (arch.draft_vocab_size,),
        "t2d": (arch.target_vocab_size,),
    }


def check_key_set(
    found: Shapes, expected: Shapes, where: str, *, hints: Callable[[list[str], list[str]], list[str]] | None = None
) -> None:
    """Raise one KeyCheckError listing every missing key, unexpected key and shape mismatch, sorted;
    `hints(missing, unexpected)` adds the lines that say why those offenders matter."""
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
    if hints is not None:
        lines += [f"  why: {why}" for why in hints(missing, unexpected)]
    raise KeyCheckError("\n".join(lines))


def vocab_mapping_problems(d2t, t2d, draft_vocab_size: int | None = None) -> list[str]:
    """What is wrong with a vocab mapping (d2t offsets, t2d mask; any array-likes), as messages; [] when
    t2d marks exactly draft_vocab_size ids and arange + d2t == nonzero(t2d)."""
    d2t, t2d = np.asarray(d2t, dtype=np.int64).ravel(), np.asarray(t2d).ravel().astype(bool)
    size = len(d2t) if draft_vocab_size is None else draft_vocab_size
    ids = np.flatnonzero(t2d)
    if len(ids) != size or len(d2t) != size:
        return [
            f"t2d marks {len(ids)} target ids, d2t has {len(d2t)}, expected draft_vocab_size={size}; the vocab "
            "mapping does not belong to this draft: rebuild it with the same draft_vocab_size"
        ]
    mapped = np.arange(size) + d2t
    if np.array_equal(mapped, ids):
        return []
    if np.array_equal(d2t, ids):
        return [
            "d2t holds absolute target ids, expected offsets (target_id = i + d2t[i]); "
            "store d2t = target_ids - arange(draft_vocab_size)"
        ]
    bad = int(np.flatnonzero(mapped != ids)[0])
    return [
        f"arange + d2t differs from nonzero(t2d) first at draft id {bad} (maps to {int(mapped[bad])}, t2d says "
        f"{int(ids[bad])}); d2t and t2d describe different vocabularies: rebuild both from the same sorted list of "
        "target ids"
    ]
