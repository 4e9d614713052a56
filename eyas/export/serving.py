"""Which engine versions serve a drafter: the key sets they fill and the draft options they run.

Read in each engine's code, not assumed. SGLang: `sglang/srt/models/llama_eagle3.py`
(LlamaForCausalLMEagle3) of every release wheel on PyPI from 0.5.10 to 0.5.23:
- 0.5.10, 0.5.11: build `model.midlayer` and load `midlayer.*` only; a `layers.0.*` key matches no
  parameter and is skipped without a word. No draft option: an `input_norm` / `fc_norm` tensor is skipped
  the same way and no flag is read.
- 0.5.12: renames midlayer to layers.0 (`legacy_name_map`: both key sets load); `fc_norm` (or the legacy
  `use_aux_norm`) builds one RMSNorm per aux chunk before fc; `norm_output` hands the normed hidden state
  to the next draft step (LlamaModel.forward: `aux = hidden_states_to_logits if self.norm_output`).
- aux count: 0.5.10 and 0.5.11 build fc for exactly 3 aux layers (`hidden_size_in * 3`); from 0.5.12 it is
  `num_aux_hidden_states`, else len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3.
- 0.5.12: builds `config.num_hidden_layers` draft layers (`model.layers`, layer 0 `is_input_layer` with 2H-wide
  qkv, later layers H-wide with hidden_norm fused over the residual); 0.5.10 and 0.5.11 raise for any count but 1.
- 0.5.17: `norm_before_fc` (eagle_config, else the top level): one RMSNorm over the concatenated aux
  input, `input_norm.weight`.
- no version: `norm_before_residual`; the first layer's residual is always the raw hidden input.
vLLM (`vllm/model_executor/models/llama_eagle3.py`, Eagle3LlamaForCausalLM): `norm_before_residual` only;
an option tensor it has no parameter for fails its load. speculators 0.9 (Eagle3DraftModel): all four.
EAGLE official (`eagle/model/cnets.py`): none. eyas's reference engine (eyas.draft): all four.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.draft_keys import DRAFT_OPTIONS
from eyas.engines.sglang import parse_version
from eyas.export.keys import get_format

# The first SGLang release that runs each draft option (None: no release does), and what it does there.
SGLANG_OPTION_SINCE: dict[str, str | None] = {
    "norm_before_fc": "0.5.17",
    "fc_norm": "0.5.12",
    "norm_before_residual": None,
    "norm_output": "0.5.12",
}
SGLANG_OLDEST = "0.5.10"  # the oldest release these tables were read in; format "sglang" serves it and later
SGLANG_LAYERS0_SINCE = "0.5.12"  # the first release that loads layers.0.* (format sglang-0.5.12)
SGLANG_ANY_NUM_AUX_SINCE = "0.5.12"  # before it, fc takes exactly 3 aux layers
# The first release that builds num_hidden_layers draft layers (model.layers; 0.5.10 and 0.5.11 raise "EAGLE3
# currently only supports 1 layer" for any other count).
SGLANG_NUM_LAYERS_SINCE = "0.5.12"
FIXED_NUM_AUX = 3  # older SGLang, and EAGLE official's cnets.py: fc = Linear(3 * H, H)
# The oldest SGLang release each SGLang format is for.
SGLANG_FORMAT_SINCE = {"sglang": SGLANG_OLDEST, "sglang-0.5.12": SGLANG_LAYERS0_SINCE}
# Draft options each non-SGLang destination runs.
FORMAT_OPTIONS: dict[str, tuple[str, ...]] = {
    "eyas": DRAFT_OPTIONS,
    "speculators": DRAFT_OPTIONS,
    "vllm": ("norm_before_residual",),
    "eagle": (),
}


@dataclass(frozen=True)
class Engine:
    """An engine version range: the formats whose exact key set it fills, the draft options it runs, and
    whether it runs a stack of draft layers (num_layers > 1) as eyas trains it."""

    name: str
    formats: tuple[str, ...]
    options: tuple[str, ...]
    stacks: bool = False


def _version(text: str) -> tuple[int, int, int]:
    parsed = parse_version(text)
    if parsed is None:
        raise ValueError(f"SGLang version {text!r}: expected a release such as 0.5.23")
    return parsed


def sglang_options(version: str) -> tuple[str, ...]:
    """The draft options SGLang `version` runs."""
    v = _version(version)
    return tuple(o for o, since in SGLANG_OPTION_SINCE.items() if since is not None and _version(since) <= v)


# A vllm-format export fills SGLang's key set but keeps its layer ids at the top level, where SGLang does not
# look (it reads eagle_config only: spec_aux_hidden_state.py), so SGLang captures its default layers: not served.
_SGLANG_KEYS = ("sglang", "sglang-0.5.12", "eagle")
ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("sglang<=0.5.11", ("sglang", "eagle"), sglang_options("0.5.11")),
        Engine("sglang>=0.5.12", _SGLANG_KEYS, sglang_options("0.5.12"), stacks=True),
        Engine("sglang>=0.5.17", _SGLANG_KEYS, sglang_options("0.5.17"), stacks=True),
        Engine("vllm", ("sglang", "sglang-0.5.12", "vllm", "speculators", "eagle"), FORMAT_OPTIONS["vllm"]),
        Engine("speculators>=0.9", ("speculators",), FORMAT_OPTIONS["speculators"]),
    )
}


def destination_options(fmt: str, sglang_version: str | None = None) -> tuple[str, ...]:
    """The draft options an export to `fmt` may carry; for SGLang formats, those every server from
    `sglang_version` (default: the oldest release the format is for) runs."""
    if fmt in SGLANG_FORMAT_SINCE:
        oldest = SGLANG_FORMAT_SINCE[fmt]
        if sglang_version is not None and _version(sglang_version) < _version(oldest):
            raise ValueError(
                f"format {fmt} with SGLang {sglang_version}: expected {oldest} or newer ({fmt} is for SGLang >= "
                f"{oldest}); export to format sglang for older servers"
            )
        return sglang_options(sglang_version or oldest)
    if sglang_version is not None:
        raise ValueError(f"an SGLang version ({sglang_version}) applies to the sglang formats only, not to {fmt}")
    return FORMAT_OPTIONS[fmt]


def num_aux_problem(num_aux: int, fmt: str, sglang_version: str | None = None) -> str | None:
    """Why a draft with `num_aux` aux layers would not load in an export to `fmt`; None when it does."""
    if num_aux == FIXED_NUM_AUX or fmt not in (*SGLANG_FORMAT_SINCE, "eagle"):
        return None
    if fmt == "eagle":
        return f"num_aux={num_aux}, expected {FIXED_NUM_AUX}: EAGLE official builds fc for exactly 3 aux layers"
    oldest = sglang_version or SGLANG_FORMAT_SINCE[fmt]
    if _version(oldest) >= _version(SGLANG_ANY_NUM_AUX_SINCE):
        return None
    return (
        f"num_aux={num_aux}, expected {FIXED_NUM_AUX} for SGLang >= {oldest}: SGLang before "
        f"{SGLANG_ANY_NUM_AUX_SINCE} builds fc for exactly 3 aux layers; export with --sglang-version "
        f"{SGLANG_ANY_NUM_AUX_SINCE} (or newer) if every server runs it, or train with 3 aux layer ids"
    )


# Why a destination without a stack (eyas.export.keys.Format.stack) cannot take a draft of num_layers > 1.
_NO_STACK = {
    "sglang": f"format sglang holds one draft layer (midlayer.*) and SGLang before {SGLANG_NUM_LAYERS_SINCE} refuses "
    "num_hidden_layers != 1",
    "vllm": "eyas has not read vLLM's draft stack against SGLang's",
    "eagle": "EAGLE official builds one draft layer (cnets.py midlayer)",
    "speculators": "speculators' later layers are plain Llama layers (input_layernorm where SGLang reads hidden_norm), "
    "a conversion eyas does not make",
}


def num_layers_problem(num_layers: int, fmt: str) -> str | None:
    """Why a draft of `num_layers` decoder layers cannot be exported to `fmt`, with the fix; None when it can
    (one layer goes everywhere; a stack to eyas and sglang-0.5.12, SGLang >= SGLANG_NUM_LAYERS_SINCE)."""
    if num_layers == 1 or get_format(fmt).stack:
        return None
    why = _NO_STACK.get(fmt, f"format {fmt} holds one draft layer")
    return (
        f"num_layers={num_layers}: {why}; export a stack of draft layers to format sglang-0.5.12 "
        f"(layers.{{i}}.*, served by SGLang >= {SGLANG_NUM_LAYERS_SINCE}) or train draft.num_layers 1"
    )


def option_problems(options: tuple[str, ...], fmt: str, sglang_version: str | None = None) -> list[str]:
    """Why each draft option in `options` would not run in an export to `fmt` (for SGLang: on every server from
    `sglang_version`); [] when all run."""
    served = destination_options(fmt, sglang_version)
    problems = []
    for option in (o for o in options if o not in served):
        if fmt not in SGLANG_FORMAT_SINCE:
            runs = [e.name for e in ENGINES.values() if option in e.options]
            problems.append(
                f"{option}: {fmt} does not run it (the flag is ignored or the tensor refused and the draft runs a "
                f"layer it was not trained with); served by {', '.join(runs)}: export to one of those"
            )
            continue
        since = SGLANG_OPTION_SINCE[option]
        oldest = sglang_version or SGLANG_FORMAT_SINCE[fmt]
        if since is None:
            problems.append(
                f"{option}: no SGLang version runs it (checked {SGLANG_OLDEST}-0.5.23); SGLang would run the draft "
                "without it, a layer it was not trained with: serve it with vLLM or speculators, or retrain without it"
            )
        else:
            problems.append(
                f"{option}: served by SGLang from {since}; this export is for SGLang >= {oldest}, where the flag "
                f"is ignored and its tensors are dropped without a word: export with --sglang-version {since} (or "
                "newer) if every server runs it"
            )
    return problems


def serving_engines(
    fmt: str, key_set_matches: dict[str, bool], options: tuple[str, ...], num_layers: int = 1
) -> dict[str, bool]:
    """{engine: whether it fills every tensor, runs every option and (num_layers > 1) runs the stack}, given
    which formats' exact key sets the drafter has (`key_set_matches[format]`)."""
    return {
        name: any(key_set_matches.get(f, False) for f in e.formats)
        and set(options) <= set(e.options)
        and (num_layers == 1 or e.stacks)
        for name, e in ENGINES.items()
    }


def variant_problem(variant_options: tuple[str, ...], variant: str, fmt: str, sglang_version: str) -> str | None:
    """Why a draft.variant (its options) cannot be exported for the run's servers (export.format,
    export.sglang_version; "" = every release the format serves), with the fix; None when it can."""
    version = sglang_version or None
    if not option_problems(variant_options, fmt, version):
        return None
    needed = max((SGLANG_OPTION_SINCE[o] for o in variant_options), key=_version)
    oldest = version or SGLANG_FORMAT_SINCE[fmt]
    return (
        f"draft.variant={variant!r} turns on {', '.join(variant_options)}, which SGLang runs from {needed}; "
        f"export.sglang_version={sglang_version!r} exports for every release from {oldest}, where they are ignored "
        f"and their tensors dropped without a word: set export.sglang_version to {needed} or newer (the oldest "
        f"release your servers run), or train draft.variant 'eagle3'"
    )


def check_variant_served(config) -> None:
    """Refuse a RunConfig whose draft.variant its export's servers would run without its norms (before any GPU
    time is spent: the flows call it when they resolve the run's facts)."""
    from eyas.config import DRAFT_VARIANTS

    problem = variant_problem(
        DRAFT_VARIANTS[config.draft.variant], config.draft.variant, config.export.format, config.export.sglang_version
    )
    if problem:
        raise ValueError(problem)
    problem = num_layers_problem(config.draft.num_layers, config.export.format)
    if problem:
        raise ValueError(f"draft.num_layers with export.format={config.export.format!r}: {problem}")
