"""Aux layer ids: the one canonical numbering eyas stores, and each engine's numbering.

eyas stores layer ids as indices into Hugging Face `outputs.hidden_states` (LAYER_ID_CONVENTION:
0 = embeddings, k = output of layer k-1 = input of layer k). Engines are configured in their own
numbering (LAYER_ID_CONVENTIONS); `to_engine_layer_ids` / `from_engine_layer_ids` are the only
place where ids are converted: at export, at engine launch and when reading a foreign checkpoint.
EAGLE-3's default is [2, N//2, N-3] in the canonical numbering (`default_aux_layer_ids`).
No torch here: `eyas inspect` uses this module on headers and JSON only.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYER_ID_CONVENTION = "hf_hidden_states"  # the canonical numbering


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers for an N-layer target, canonical: inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids (canonical), or the default when None; each in 1..N-1 and distinct."""
    ids = default_aux_layer_ids(num_layers) if configured is None else list(configured)
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"target.aux_layer_ids={ids}: expected distinct ids in 1..{num_layers - 1} "
            f"(HF hidden_states indices of a {num_layers}-layer target); found {bad or 'duplicates'}; "
            f"leave it unset for the default {default_aux_layer_ids(num_layers)}"
        )
    return ids


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
            "SGLang DeepSeek/Kimi/GLM-MoE-DSA >= 0.5.13: adds 1 to every id only when the first id is 1",
            shift_if_first=1,
        ),
        LayerIdConvention("specforge", -1, "SpecForge: the output of layer id, i.e. HF hidden_states[id + 1]"),
        LayerIdConvention("vllm", 0, "vLLM top-level ids: captures the input of layer id (canonical)"),
        LayerIdConvention("speculators", 0, "speculators: HF hidden_states indices, N = the final state"),
        LayerIdConvention("eagle_fixed", 0, "EAGLE official: fixed [2, N//2, N-3] in the target's code"),
    )
}


# SGLang target classes whose set_eagle3_layers_to_capture adds 1 to the configured ids only when the first one
# is 1 (sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM and its subclasses, glm4_moe_lite.py; Kimi-K2.5
# delegates to its DeepseekV3 language model), from 0.5.13 on; every other target class adds 1 always.
SGLANG_CONDITIONAL_TARGETS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "KimiK25ForConditionalGeneration",
)


def sglang_convention(target_architectures: list[str] | None) -> str:
    """The convention SGLang (>= 0.5.13) reads a draft's eagle_config ids in, for a target of these
    architectures (its config.json `architectures`); Llama numbering when they are not known."""
    if target_architectures and any(a in SGLANG_CONDITIONAL_TARGETS for a in target_architectures):
        return "sglang_deepseek"
    return "sglang_llama"


def target_layout(config: dict) -> tuple[list[str], int | None]:
    """(architectures, number of decoder layers) of a target's config.json (a multimodal wrapper's text model
    counts: Kimi-K2.5 keeps it in text_config)."""
    text = config.get("text_config") or {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    return list(config.get("architectures") or []), layers


def _convention(name: str) -> LayerIdConvention:
    if name not in LAYER_ID_CONVENTIONS:
        raise ValueError(
            f"layer-id convention {name!r}: unknown; expected one of {sorted(LAYER_ID_CONVENTIONS)}; "
            "add the engine's rule to LAYER_ID_CONVENTIONS in eyas/layer_ids.py"
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
