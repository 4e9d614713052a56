"""config.json per checkpoint format: writing, reading, norm options, format detection.

    write_config("speculators", arch, [2, 16, 29], "bfloat16")   # -> dict for config.json
    read_config("sglang", config, where="export/config.json")     # -> ConfigInfo (arch fields, ids, problems)

Layer ids passed in and returned are canonical (HF hidden_states indices); each format's
convention comes from eyas.export.keys (FORMATS) and eyas.layer_ids. Norm options (NORM_OPTIONS) are variants of the draft
layer that some engines implement and others ignore: eyas trains none of them, writes them as
explicit false only where the destination implements them, and refuses a checkpoint that turns
one on. No torch here: `eyas inspect` uses this module on headers and JSON only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.export.keys import get_format
from eyas.layer_ids import default_aux_layer_ids, from_engine_layer_ids, to_engine_layer_ids

LLAMA_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"

# option -> the engine versions that implement it (eyas's Eagle3Draft and SGLang's
# LlamaForCausalLMEagle3 implement none: the flag would be ignored and the draft run wrong).
NORM_OPTIONS: dict[str, tuple[str, ...]] = {
    "norm_before_residual": ("speculators>=0.9", "vllm"),
    "norm_before_fc": ("speculators>=0.9", "vllm"),
    "fc_norm": ("speculators>=0.9",),
    "norm_output": ("speculators>=0.9",),
    "sliding_window": ("speculators>=0.9",),
}
# Norm flags written (as explicit false) per format: only those the destination implements.
# vLLM reads an absent norm_before_residual of a speculators config as TRUE: write it.
WRITTEN_NORM_OPTIONS: dict[str, tuple[str, ...]] = {
    "eyas": (),
    "sglang": (),
    "sglang-0.5.12": (),
    "eagle": (),
    "vllm": ("norm_before_residual", "norm_before_fc"),
    "speculators": ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"),
}
_LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


class ConfigError(ValueError):
    """A checkpoint config that an engine would load wrong, or that eyas cannot convert."""


@dataclass
class ConfigInfo:
    """What a format's config says: DraftArch fields, canonical aux layer ids, every problem found."""

    arch: dict
    aux_layer_ids: list[int] | None
    engine_layer_ids: list[int] | None
    problems: list[str] = field(default_factory=list)


def _llama_config(arch, dtype: str) -> dict:
    return {
        "architectures": [LLAMA_EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        **{name: getattr(arch, name) for name in _LLAMA_FIELDS},
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": arch.target_vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "target_hidden_size": arch.hidden_size,
    }


def _check_eagle_ids(canonical: list[int]) -> None:
    num_layers = canonical[-1] + 3 if len(canonical) == 3 else None
    if num_layers is None or canonical != default_aux_layer_ids(num_layers):
        raise ConfigError(
            f"aux_layer_ids={canonical} (hf_hidden_states): the eagle format cannot carry them; EAGLE official "
            "captures the fixed layers [2, N//2, N-3] of an N-layer target; train with the default ids or "
            "export to sglang, vllm or speculators"
        )


def write_config(fmt: str, arch, aux_layer_ids: list[int], dtype: str) -> dict:
    """config.json of a `fmt` draft; aux_layer_ids are canonical and converted here."""
    convention = get_format(fmt).layer_id_convention
    norms = {name: False for name in WRITTEN_NORM_OPTIONS[fmt]}
    ids = to_engine_layer_ids(aux_layer_ids, convention)
    if fmt in ("sglang", "sglang-0.5.12"):
        eagle = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        return {**_llama_config(arch, dtype), "eagle_config": eagle}
    if fmt == "vllm":
        return {
            **_llama_config(arch, dtype),
            **norms,
            "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"use_aux_hidden_state": True},
        }
    if fmt == "eagle":
        _check_eagle_ids(list(aux_layer_ids))
        return {**_llama_config(arch, dtype), "eagle_config": {"use_aux_hidden_state": True}}
    if fmt == "speculators":
        layer = {
            k: v for k, v in _llama_config(arch, dtype).items() if k not in ("draft_vocab_size", "target_hidden_size")
        }
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": arch.draft_vocab_size,
            "target_hidden_size": arch.hidden_size,
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            **norms,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"architectures": [], "name_or_path": None},
            },
        }
    raise ConfigError(
        f"config.json for format {fmt!r}: expected one of {sorted(set(WRITTEN_NORM_OPTIONS) - {'eyas'})}; "
        "eyas checkpoints keep arch.json instead"
    )


def _norm_options_on(config: dict, layer: dict) -> dict[str, str]:
    """{option: its value as found} for every norm option a config turns on."""
    found = {**layer, **(config.get("eagle_config") or {}), **config}
    on = {k: json.dumps(found[k]) for k in NORM_OPTIONS if k != "sliding_window" and found.get(k) not in (None, False)}
    sliding = "sliding_attention" in (layer.get("layer_types") or [])
    if sliding or (layer.get("sliding_window") is not None and layer.get("use_sliding_window", True)):
        on["sliding_window"] = json.dumps(layer.get("sliding_window"))
    return on


def _norm_problems(fmt: str, config: dict, layer: dict) -> list[str]:
    """Norm options turned on: eyas and SGLang implement none of them."""
    problems = [
        f"{option}={value}: not implemented by eyas, SGLang (every version) or EAGLE; "
        f"implemented by {', '.join(NORM_OPTIONS[option])}; the draft was trained with a layer those engines do not "
        "run: convert it with its own tools or retrain without the option"
        for option, value in _norm_options_on(config, layer).items()
    ]
    if fmt == "speculators" and "norm_before_residual" not in config:
        problems.append(
            "norm_before_residual: absent; vLLM reads an absent norm_before_residual of a speculators config as "
            "true: write norm_before_residual: false explicitly (eyas remap --to speculators)"
        )
    return problems


def _arch_fields(fmt: str, config: dict, layer: dict, num_aux: int, problems: list[str]) -> dict:
    missing = sorted(
        k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in layer
    )
    if missing:
        raise ConfigError(f"{fmt} config: missing {missing}; expected a Llama draft config: re-export it")
    heads = layer["num_attention_heads"]
    fields = {
        "hidden_size": layer["hidden_size"],
        "num_aux": num_aux,
        "target_vocab_size": layer["vocab_size"],
        "draft_vocab_size": config.get("draft_vocab_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads", heads),
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads,
        "intermediate_size": layer["intermediate_size"],
    }
    fields.update({k: layer[k] for k in ("rms_norm_eps", "rope_theta", "max_position_embeddings") if k in layer})
    if fields["draft_vocab_size"] is None:
        state = "null" if "draft_vocab_size" in config else "absent"
        problems.append(
            f"draft_vocab_size: {state}; SGLang then replaces the trained lm_head with the target's and the draft "
            "predicts over the full vocab: write draft_vocab_size explicitly (eyas remap)"
        )
    target_h = config.get("target_hidden_size")
    if target_h not in (None, fields["hidden_size"]):
        problems.append(
            f"target_hidden_size {target_h} differs from hidden_size {fields['hidden_size']}; eyas drafts use the "
            "target's hidden size"
        )
    return fields


def _config_ids(fmt: str, config: dict) -> list[int] | None:
    if fmt in ("sglang", "sglang-0.5.12"):
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    elif fmt in ("vllm", "speculators"):
        ids = config.get("eagle_aux_hidden_state_layer_ids")
    else:
        ids = None
    return None if ids is None else list(ids)


def read_config(fmt: str, config: dict) -> ConfigInfo:
    """Arch fields, canonical layer ids and every problem of a `fmt` draft config."""
    problems: list[str] = []
    layer = (config.get("transformer_layer_config") or {}) if fmt == "speculators" else config
    expected_arch = [SPECULATORS_ARCHITECTURE] if fmt == "speculators" else [LLAMA_EAGLE3_ARCHITECTURE]
    if config.get("architectures") != expected_arch:
        problems.append(
            f"architectures {config.get('architectures')}, expected {expected_arch}: the engine would not build an "
            f"EAGLE-3 draft from it: re-export with eyas remap --to {fmt}"
        )
    engine_ids = _config_ids(fmt, config)
    num_aux = len(engine_ids) if engine_ids else 3
    fields = _arch_fields(fmt, config, layer, num_aux, problems)
    if config.get("tie_word_embeddings", layer.get("tie_word_embeddings")) is not False:
        problems.append(
            f"tie_word_embeddings is {config.get('tie_word_embeddings')!r}, expected false: the engine would tie "
            "the draft's lm_head to the embedding and discard the trained head; re-export"
        )
    use_aux = (config.get("eagle_config") or {}).get("use_aux_hidden_state", config.get("use_aux_hidden_state"))
    if use_aux is not True:
        problems.append(
            f"use_aux_hidden_state: {json.dumps(use_aux)}, expected true: SGLang does not capture the aux "
            "hidden states when it is false and the draft's fc sees the wrong features: re-export"
        )
    if engine_ids is None and fmt != "eagle":
        problems.append(
            f"aux layer ids: absent; the engine falls back to its own default layers, which need not be those the "
            f"draft was trained on: write them (eyas remap --to {fmt})"
        )
    problems += _norm_problems(fmt, config, layer)
    canonical = None
    if engine_ids is not None:
        canonical = from_engine_layer_ids(engine_ids, get_format(fmt).layer_id_convention)
    return ConfigInfo(fields, canonical, engine_ids, problems)


def detect_format(root: Path, key_names) -> str:
    """The format of a checkpoint directory, from arch.json / config.json and its key names."""
    if (root / "arch.json").is_file():
        return "eyas"
    if not (root / "config.json").is_file():
        raise ConfigError(
            f"{root}: neither arch.json nor config.json; expected an eyas checkpoint or an exported drafter"
        )
    config = json.loads((root / "config.json").read_text())
    if "speculators_model_type" in config:
        return "speculators"
    if "eagle_aux_hidden_state_layer_ids" in config:
        return "vllm"
    if "eagle_aux_hidden_state_layer_ids" in (config.get("eagle_config") or {}):
        names = list(key_names)
        midlayer = any(k.startswith("midlayer.") for k in names)
        return "sglang-0.5.12" if not midlayer and any(k.startswith("layers.0.") for k in names) else "sglang"
    return "eagle"
