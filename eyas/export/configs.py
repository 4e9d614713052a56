"""config.json per checkpoint format: what eyas writes, and how it reads what each producer really writes.

    write_config("speculators", arch, [2, 16, 29], "bfloat16")        # -> dict for config.json
    read_config("sglang", config, producer="specforge")                # -> ConfigInfo (arch, ids, problems, notes)

Layer ids passed in and returned are canonical (HF hidden_states indices); each format's convention comes
from eyas.export.keys (FORMATS) and eyas.layer_ids. Draft options (eyas.draft_keys.DRAFT_OPTIONS) are read
from where each producer writes them and written where each destination reads them; which destination
runs which option is eyas.export.serving's table, checked before anything is written. No torch here:
`eyas inspect` uses this module on headers and JSON only.

What a producer writes that a reader must derive rather than demand, or must not misread:
- speculators (0.9.0 and 0.8.1, checked with the package itself): no `use_aux_hidden_state` (the field does
  not exist: its EAGLE-3 always takes aux states); layer ids at the top level, possibly null (the verifier's
  default layers); `target_hidden_size` null (= hidden_size); the four norm flags as explicit booleans
  (absent = false); the decoder in `transformer_layer_config`, RoPE in `rope_parameters` (transformers 5),
  `dtype` instead of `torch_dtype`; `architectures` Eagle3DraftModel (or Eagle3Speculator).
- SGLang format: `use_aux_hidden_state` may be absent (SGLang and vLLM read absent as true);
  `norm_before_fc` under eagle_config or at the top level, `fc_norm` (legacy `use_aux_norm`) and
  `norm_output` at the top level. SpecForge's `norm_output` (default true) switches the final norm before
  lm_head and always feeds the pre-norm state back; SGLang's (default false) feeds the normed state back:
  one key, two meanings, and nothing in the file says which was meant.
- EAGLE official: `architectures` ["LlamaForCausalLM"], no eagle_config, no rope_theta (10000.0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.draft_keys import DRAFT_OPTIONS
from eyas.export.keys import get_format
from eyas.export.producers import EAGLE_OFFICIAL_ARCHITECTURE, SPECULATORS_ARCHITECTURES
from eyas.export.serving import SGLANG_FORMAT_SINCE, option_problems
from eyas.layer_ids import default_aux_layer_ids, from_engine_layer_ids, target_layout, to_engine_layer_ids

LLAMA_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = SPECULATORS_ARCHITECTURES[0]  # what speculators 0.9's save_pretrained writes
NEWEST_SGLANG = "0.5.23"  # an option no SGLang release up to this one runs is a problem in an SGLang config
# Norm flags written as explicit false where the destination reads them (and the value when on).
# vLLM reads an absent norm_before_residual of a speculators config as TRUE: write it.
WRITTEN_NORM_OPTIONS: dict[str, tuple[str, ...]] = {
    "eyas": (),
    "sglang": (),
    "sglang-0.5.12": (),
    "eagle": (),
    "vllm": ("norm_before_residual", "norm_before_fc"),
    "speculators": DRAFT_OPTIONS,
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
_ACCEPTED_ARCHITECTURES = {
    "speculators": SPECULATORS_ARCHITECTURES,
    "eagle": (LLAMA_EAGLE3_ARCHITECTURE, EAGLE_OFFICIAL_ARCHITECTURE),
}


class ConfigError(ValueError):
    """A checkpoint config that an engine would load wrong, or that eyas cannot convert."""


@dataclass(frozen=True)
class TargetRef:
    """What a drafter's config needs of its target: where it is (speculators' `verifier`), its architectures
    (the numbering SGLang reads ids in) and its layer count (ids a config leaves out, range checks)."""

    path: str | None = None
    architectures: tuple[str, ...] = ()
    num_layers: int | None = None

    @classmethod
    def read(cls, target: str | Path) -> TargetRef:
        """From the target model's directory (or its config.json)."""
        path = Path(target)
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise FileNotFoundError(
                f"target {target}: no config.json; expected the target model's directory or its config.json"
            )
        architectures, layers = target_layout(json.loads(config_path.read_text()))
        return cls(str(config_path.parent.resolve()), tuple(architectures), layers)


@dataclass
class ConfigInfo:
    """What a format's config says: DraftArch fields, canonical aux layer ids, every problem found, and notes
    on what was derived rather than read."""

    arch: dict
    aux_layer_ids: list[int] | None
    engine_layer_ids: list[int] | None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _llama_config(arch, dtype: str) -> dict:
    return {
        "architectures": [LLAMA_EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        **{name: getattr(arch, name) for name in _LLAMA_FIELDS},
        "num_hidden_layers": getattr(arch, "num_layers", 1),
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


def write_config(
    fmt: str, arch, aux_layer_ids: list[int], dtype: str, convention: str | None = None, target: TargetRef | None = None
) -> dict:
    """config.json of a `fmt` draft; aux_layer_ids are canonical and converted here, to `convention` (default:
    the format's; eyas.export.keys.format_convention picks it for a target). The draft options of `arch` are
    written where `fmt` reads them; whether `fmt` runs them is checked by the caller
    (eyas.export.serving.option_problems). `target` fills speculators' verifier entry, which speculators'
    from_pretrained needs to load the draft."""
    convention = convention or get_format(fmt).layer_id_convention
    on = {name: True for name in arch.options()}
    norms = {name: getattr(arch, name) for name in WRITTEN_NORM_OPTIONS.get(fmt, ())}
    ids = to_engine_layer_ids(aux_layer_ids, convention)
    if fmt in SGLANG_FORMAT_SINCE:
        eagle = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        return {**_llama_config(arch, dtype), **on, "eagle_config": eagle}
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
        skip = ("draft_vocab_size", "target_hidden_size", "torch_dtype", "rope_theta")
        layer = {k: v for k, v in _llama_config(arch, dtype).items() if k not in skip and k != "architectures"}
        layer["rope_parameters"] = {"rope_theta": arch.rope_theta, "rope_type": "default"}
        return {
            "architectures": [SPECULATORS_ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": arch.draft_vocab_size,
            "target_hidden_size": arch.hidden_size,
            "eagle_aux_hidden_state_layer_ids": ids,
            "tie_word_embeddings": False,
            "dtype": dtype,
            **norms,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {
                    "architectures": list(target.architectures) if target else [],
                    "name_or_path": target.path if target else None,
                },
            },
        }
    raise ConfigError(
        f"config.json for format {fmt!r}: expected one of {sorted(set(WRITTEN_NORM_OPTIONS) - {'eyas'})}; "
        "eyas checkpoints keep arch.json instead"
    )


def _read_options(fmt: str, config: dict, problems: list[str]) -> dict[str, bool]:
    """The draft options a config turns on, read where its format keeps them."""
    eagle = config.get("eagle_config") or {}
    if fmt == "speculators":
        found = {name: config.get(name, False) for name in DRAFT_OPTIONS}
    else:
        found = {
            "norm_before_fc": eagle.get("norm_before_fc", config.get("norm_before_fc", False)),
            "fc_norm": config.get("fc_norm") or config.get("use_aux_norm", False),
            "norm_before_residual": config.get("norm_before_residual", False),
            "norm_output": config.get("norm_output", False),
        }
    for name, value in found.items():
        if not isinstance(value, bool) and value is not None:
            problems.append(f"{name}: {json.dumps(value)}, expected true or false; engines read it as truthy: fix it")
    return {name: bool(value) for name, value in found.items()}


def _sliding_window(layer: dict) -> str | None:
    """The draft layer's sliding window when it is on (layer_types or use_sliding_window), else None."""
    sliding = "sliding_attention" in (layer.get("layer_types") or [])
    if sliding or (layer.get("sliding_window") is not None and layer.get("use_sliding_window", True)):
        return json.dumps(layer.get("sliding_window"))
    return None


def _served_as(fmt: str, config: dict) -> str:
    """The format whose engines a config is meant for: an eagle-format config (no layer ids) with SGLang's
    architecture is SGLang's (SpecForge writes these; SGLang takes the target's default layers)."""
    if fmt == "eagle" and config.get("architectures") == [LLAMA_EAGLE3_ARCHITECTURE]:
        return "sglang"
    return fmt


def _option_problems(fmt: str, config: dict, layer: dict, options: dict[str, bool], producer: str | None) -> list:
    on = tuple(name for name, value in options.items() if value)
    served_as = _served_as(fmt, config)
    problems = option_problems(on, served_as, NEWEST_SGLANG if served_as in SGLANG_FORMAT_SINCE else None)
    window = _sliding_window(layer)
    if window is not None:
        problems.append(
            f"sliding_window={window}: the draft layer attends to a window; eyas's reference engine runs full "
            "attention and SGLang takes a draft window only from its --speculative-draft-window-size server "
            "argument, not from config.json: serve it with its own tools or retrain with full attention"
        )
    if fmt == "speculators" and "norm_before_residual" not in config:
        problems.append(
            "norm_before_residual: absent; vLLM reads an absent norm_before_residual of a speculators config as "
            "true: write norm_before_residual: false explicitly (eyas remap --to speculators)"
        )
    if producer == "specforge" and "norm_output" in config:
        problems.append(
            f"norm_output: {json.dumps(config['norm_output'])} in a config eyas did not export: SpecForge writes it "
            "for its final norm before lm_head (true: the standard head, the pre-norm state fed back to the next "
            "step), SGLang >= 0.5.12 reads it as feeding the normed state back; the file does not say which was "
            "meant. If SpecForge trained it with norm_output true, delete the key (SGLang then runs the head "
            "SpecForge trained); false means no final norm, which no engine eyas knows runs"
        )
    return problems


def _rope_theta(layer: dict, problems: list[str], notes: list[str]) -> float | None:
    params = layer.get("rope_parameters") or layer.get("rope_scaling")
    if params is not None and params.get("rope_type", params.get("type", "default")) != "default":
        problems.append(
            f"RoPE {json.dumps(params)}: eyas's draft implements the default RoPE only and would run the draft "
            "at other positions: serve it with its own tools"
        )
    theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta"))
    if theta is None:
        notes.append("rope_theta: absent, 10000.0 assumed (the Llama default engines use)")
    return theta


def _arch_fields(fmt: str, config: dict, layer: dict, num_aux: int, problems: list[str], notes: list[str]) -> dict:
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
        "num_key_value_heads": layer.get("num_key_value_heads") or heads,
        "head_dim": layer.get("head_dim") or layer["hidden_size"] // heads,
        "intermediate_size": layer["intermediate_size"],
    }
    fields.update({k: layer[k] for k in ("rms_norm_eps", "max_position_embeddings") if layer.get(k) is not None})
    theta = _rope_theta(layer, problems, notes)
    if theta is not None:
        fields["rope_theta"] = theta
    if fields["draft_vocab_size"] is None:
        state = "null" if "draft_vocab_size" in config else "absent"
        problems.append(
            f"draft_vocab_size: {state}; SGLang then replaces the trained lm_head with the target's and the draft "
            "predicts over the full vocab: write draft_vocab_size explicitly (eyas remap)"
        )
    layers = layer.get("num_hidden_layers", 1)
    if isinstance(layers, int) and layers > 1 and get_format(fmt).stack:
        fields["num_layers"] = layers
    elif layers != 1:
        problems.append(
            f"num_hidden_layers: {layers}, expected 1 in format {fmt}, which holds one draft layer (a stack of layers "
            "is read from format sglang-0.5.12, layers.{i}.*): serve it with its own tools"
        )
    target_h = config.get("target_hidden_size")
    if target_h is None and "target_hidden_size" in config and fmt != "speculators":
        problems.append(
            "target_hidden_size: null; SGLang builds fc from it whenever the key exists and fails to load the "
            "draft: write the target's hidden size or drop the key (eyas remap)"
        )
    elif target_h not in (None, fields["hidden_size"]):
        problems.append(
            f"target_hidden_size {target_h} differs from hidden_size {fields['hidden_size']}; eyas drafts use the "
            "target's hidden size"
        )
    elif target_h is None and fmt == "speculators":
        notes.append("target_hidden_size: null, read as hidden_size (speculators' meaning)")
    return fields


def _config_ids(fmt: str, config: dict) -> list[int] | None:
    if fmt in SGLANG_FORMAT_SINCE:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    elif fmt in ("vllm", "speculators"):
        ids = config.get("eagle_aux_hidden_state_layer_ids")
    else:
        ids = None
    return None if ids is None else list(ids)


def read_config(fmt: str, config: dict, producer: str | None = None, convention: str | None = None) -> ConfigInfo:
    """Arch fields (draft options included), canonical layer ids, every problem and every derived value of a
    `fmt` draft config; `producer` (eyas.export.producers.Producer.name) chooses how ambiguous keys are read,
    `convention` the numbering its ids are in (default: the format's)."""
    problems: list[str] = []
    notes: list[str] = []
    layer = (config.get("transformer_layer_config") or {}) if fmt == "speculators" else config
    accepted = _ACCEPTED_ARCHITECTURES.get(fmt, (LLAMA_EAGLE3_ARCHITECTURE,))
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and len(architectures) == 1 and architectures[0] in accepted):
        problems.append(
            f"architectures {architectures}, expected one of {[[a] for a in accepted]}: the engine would not build "
            f"an EAGLE-3 draft from it: re-export with eyas remap --to {fmt}"
        )
    engine_ids = _config_ids(fmt, config)
    num_aux = len(engine_ids) if engine_ids else config.get("num_aux_hidden_states") or 3
    fields = _arch_fields(fmt, config, layer, num_aux, problems, notes)
    options = _read_options(fmt, config, problems)
    fields.update(options)
    tied = config.get("tie_word_embeddings", layer.get("tie_word_embeddings"))
    if tied is None:
        notes.append("tie_word_embeddings: absent, read as false (LlamaConfig's default)")
    elif tied is not False:
        problems.append(
            f"tie_word_embeddings is {tied!r}, expected false: the engine would tie the draft's lm_head to the "
            "embedding and discard the trained head; re-export"
        )
    if fmt != "speculators":
        use_aux = (config.get("eagle_config") or {}).get("use_aux_hidden_state", config.get("use_aux_hidden_state"))
        if use_aux is None:
            notes.append("use_aux_hidden_state: absent, read as true (as SGLang and vLLM do)")
        elif use_aux is not True:
            problems.append(
                f"use_aux_hidden_state: {json.dumps(use_aux)}, expected true: SGLang does not capture the aux "
                "hidden states when it is false and the draft's fc sees the wrong features: re-export"
            )
    if engine_ids is None and fmt in ("vllm", *SGLANG_FORMAT_SINCE):
        problems.append(
            f"aux layer ids: absent; the engine falls back to its own default layers, which need not be those the "
            f"draft was trained on: write them (eyas remap --to {fmt})"
        )
    elif engine_ids is None and fmt == "speculators":
        state = "null" if "eagle_aux_hidden_state_layer_ids" in config else "absent"
        notes.append(
            f"aux layer ids: {state}; speculators and vLLM then capture the verifier's default layers [2, N//2, N-3] "
            "(give the target's layer count to name them)"
        )
    problems += _option_problems(fmt, config, layer, options, producer)
    canonical = None
    if engine_ids is not None:
        canonical = from_engine_layer_ids(engine_ids, convention or get_format(fmt).layer_id_convention)
    return ConfigInfo(fields, canonical, engine_ids, problems, notes)
