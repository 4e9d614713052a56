"""Aux layer ids: the one canonical numbering eyas stores, and each engine's numbering.

eyas stores layer ids as indices into Hugging Face `outputs.hidden_states` (LAYER_ID_CONVENTION:
0 = embeddings, k = output of layer k-1 = input of layer k). Engines are configured in their own
numbering (LAYER_ID_CONVENTIONS); `to_engine_layer_ids` / `from_engine_layer_ids` are the only
place where ids are converted: at export, at engine launch and when reading a foreign checkpoint.
EAGLE-3's default is [2, N//2, N-3] in the canonical numbering (`default_aux_layer_ids`).
SGLang numbers ids by the target's class: which rule each class follows in each release is data derived from
SGLang's own source (eyas/sglang_layer_rules.py, written by scripts/sglang_layer_rules.py from the wheels of
kits/sglang-wheels.txt); `sglang_convention` and `sglang_layer_ids` read it, and a class it does not know is
refused rather than guessed.
No torch here: `eyas inspect` uses this module on headers and JSON only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eyas.sglang_layer_rules import RELEASES as SGLANG_RELEASES
from eyas.sglang_layer_rules import RULES as SGLANG_CLASS_RULES

LAYER_ID_CONVENTION = "hf_hidden_states"  # the canonical numbering


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers for an N-layer target, canonical: inputs of layers 2, N//2 and N-3."""
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids (canonical), or the default when None; each in 1..N-1, in ascending order."""
    ids = default_aux_layer_ids(num_layers) if configured is None else list(configured)
    bad = [i for i in ids if not 1 <= i <= num_layers - 1]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"target.aux_layer_ids={ids}: expected distinct ids in 1..{num_layers - 1} "
            f"(HF hidden_states indices of a {num_layers}-layer target); found {bad or 'duplicates'}; "
            f"leave it unset for the default {default_aux_layer_ids(num_layers)}"
        )
    if ids != sorted(ids):
        raise ValueError(
            f"target.aux_layer_ids={ids}: expected ascending ids; SGLang concatenates the aux states in layer order "
            "whatever the order configured (its models collect them in the loop over the layers), so the features "
            f"would not be in the order their ids name: write {sorted(ids)}"
        )
    return ids


@dataclass(frozen=True)
class LayerIdConvention:
    """How an engine numbers aux layers: configured id = canonical id + offset.

    `shift_if_first` marks a conditional rule: the engine adds 1 to every id only when the first
    configured id equals it (SGLang's DeepSeek family from 0.5.14; which class follows which rule in which
    release is in eyas/sglang_layer_rules.py).
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
            "SGLang DeepSeek family (DeepSeek, Kimi-K2.5, GLM-MoE-DSA, Mistral-Large-3) from 0.5.14 (0.5.12 adds 1 "
            "always; 0.5.13 is not in the kit): adds 1 to every id only when the first id is 1",
            shift_if_first=1,
        ),
        LayerIdConvention("specforge", -1, "SpecForge: the output of layer id, i.e. HF hidden_states[id + 1]"),
        LayerIdConvention("vllm", 0, "vLLM top-level ids: captures the input of layer id (canonical)"),
        LayerIdConvention("speculators", 0, "speculators: HF hidden_states indices, N = the final state"),
        LayerIdConvention("eagle_fixed", 0, "EAGLE official: fixed [2, N//2, N-3] in the target's code"),
    )
}


def sglang_convention(target_architectures: list[str] | None, *, version: str | None = None) -> str:
    """The convention SGLang `version` (default: the newest release eyas checked) reads a draft's eagle_config ids
    in, for a target of these config.json `architectures`, from the rule its class follows there
    (eyas/sglang_layer_rules.py). A class SGLang does not register, or whose rule is not known, is refused.
    Without architectures (a draft read without its target) the ids are read in Llama's numbering."""
    if not target_architectures:
        return "sglang_llama"
    release = _checked_release(version, target_architectures)
    _, rule = served_class(target_architectures, release)
    return SGLANG_RULES[rule][1]


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


# ---- SGLang: the rule of each target class, per release (eyas/sglang_layer_rules.py) ---------------------------

# What a rule of eyas/sglang_layer_rules.py captures for configured ids (the inputs of these layers: canonical ids)
# of an N-layer target, and the convention eyas writes ids in for it. plus_one_unless_last_is_n (gpt_oss.py) adds 1
# whenever the largest id is not N: eyas's canonical ids stay below N (resolve_aux_layer_ids), so the ids it writes
# in Llama's numbering stay below N - 1 and are always shifted.
SGLANG_RULES = {
    "plus_one": (lambda ids, n: [i + 1 for i in ids], "sglang_llama"),
    "plus_one_if_first_is_1": (lambda ids, n: [i + 1 for i in ids] if ids[:1] == [1] else list(ids),
                               "sglang_deepseek"),
    "plus_one_unless_last_is_n": (lambda ids, n: list(ids) if ids and max(ids) == n else [i + 1 for i in ids],
                                  "sglang_llama"),
}  # fmt: skip
_RULES_FILE = "eyas/sglang_layer_rules.py, derived by scripts/sglang_layer_rules.py from kits/sglang-wheels.txt"


class SGLangTargetError(ValueError):
    """SGLang's numbering of a target's aux layers is not known, or cannot express the ids."""


def _release_key(version: str) -> tuple[int, ...]:
    """(major, minor, patch); an rc/dev/post tag counts as its release."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"SGLang version {version!r}: expected MAJOR.MINOR.PATCH (e.g. {SGLANG_RELEASES[-1]})")
    return tuple(int(p) for p in found.groups())


def _rule_at(architecture: str, release: str) -> str | None:
    """The rule class `architecture` follows in checked release `release`; None when it registers no such class."""
    rule = None
    for first, value in SGLANG_CLASS_RULES.get(architecture, ()):
        if _release_key(first) <= _release_key(release):
            rule = value
    return rule


def served_class(architectures: list[str], release: str) -> tuple[str, str]:
    """(class, rule) of a target of these config.json architectures in checked SGLang release `release`: the first
    architecture that release registers, as its models/registry.py resolves them. Refused (SGLangTargetError) when
    it registers none of them, or when the class cannot capture aux states or its rule is not known."""
    for architecture in architectures:
        rule = _rule_at(architecture, release)
        if rule is None:
            continue
        if rule in SGLANG_RULES:
            return architecture, rule
        if rule == "none":
            raise SGLangTargetError(
                f"target architecture {architecture}: SGLang {release} serves it without EAGLE-3 aux capture (the "
                "class has no set_eagle3_layers_to_capture, so SGLang refuses to capture its aux hidden states and "
                f"cannot run an EAGLE-3 draft for it; see {_RULES_FILE}); train a drafter for a target SGLang serves "
                "with EAGLE-3"
            )
        raise SGLangTargetError(
            f"target architecture {architecture}: SGLang {release} serves it, but which layers its "
            f"set_eagle3_layers_to_capture captures could not be read from SGLang's source "
            f"({rule.removeprefix('unresolved: ')}); eyas does not guess it: teach scripts/sglang_layer_rules.py "
            "to read this class and rerun it"
        )
    served = [r for r in SGLANG_RELEASES if any(_rule_at(a, r) is not None for a in architectures)]
    where = f"; releases that do: {', '.join(served)}" if served else ""
    raise SGLangTargetError(
        f"target architectures {list(architectures)}: SGLang {release} registers none of them (it would run the "
        f"target through its transformers fallback, which captures no aux states){where}; the classes of SGLang "
        f"{SGLANG_RELEASES[0]}..{SGLANG_RELEASES[-1]} are in {_RULES_FILE}"
    )


def _checked_release(version: str | None, architectures: list[str]) -> str:
    """The checked release whose rules hold for SGLang `version` (None: the newest checked). A version between two
    checked releases takes the older one's rule when both agree for this target; otherwise it is refused."""
    if version is None:
        return SGLANG_RELEASES[-1]
    key = _release_key(version)
    same = [r for r in SGLANG_RELEASES if _release_key(r) == key]
    if same:
        return same[0]
    older = [r for r in SGLANG_RELEASES if _release_key(r) < key]
    newer = [r for r in SGLANG_RELEASES if _release_key(r) > key]
    if not older or not newer:
        raise SGLangTargetError(
            f"SGLang {version}: outside the releases eyas has checked ({SGLANG_RELEASES[0]}..{SGLANG_RELEASES[-1]}), "
            f"so its numbering of aux layer ids is not known; add it to kits/sglang-wheels.txt and run "
            "`python scripts/sglang_layer_rules.py`"
        )
    rules = {r: [_rule_at(a, r) for a in architectures] for r in (older[-1], newer[0])}
    if rules[older[-1]] != rules[newer[0]]:
        raise SGLangTargetError(
            f"SGLang {version}: not a release eyas has checked, and its neighbours {older[-1]} and {newer[0]} number "
            f"the aux layer ids of {list(architectures)} differently ({rules[older[-1]]} vs {rules[newer[0]]}); add "
            "it to kits/sglang-wheels.txt and run `python scripts/sglang_layer_rules.py`"
        )
    return older[-1]


def sglang_layer_ids(
    canonical: list[int], architectures: list[str], num_layers: int, *, oldest_release: str = ""
) -> list[int]:
    """The ids to configure SGLang with (eagle_config, --return-aux-hidden-state-layer-ids) so that it captures the
    canonical ids `canonical` of a target of these architectures: written in the newest checked release's
    numbering, and read back as the same layers by every checked release from `oldest_release` on ("" = the
    oldest checked; an unchecked one counts from the checked release before it). Refused when a release in that
    range cannot serve the class, or captures other layers, naming the release and the fix."""
    newest = SGLANG_RELEASES[-1]
    name, rule = served_class(architectures, newest)
    try:
        written = to_engine_layer_ids(list(canonical), SGLANG_RULES[rule][1])
    except ValueError as err:
        raise SGLangTargetError(f"target {name} (SGLang {newest}, rule {rule}): {err}") from err
    for release in _releases_from(oldest_release):
        try:
            served, rule_then = served_class(architectures, release)
        except SGLangTargetError as err:
            first = _first_serving(architectures)
            raise SGLangTargetError(
                f"export.sglang_version={oldest_release!r} asks for every SGLang release from "
                f"{oldest_release or SGLANG_RELEASES[0]}: {err}; set export.sglang_version to {first} or newer"
            ) from err
        got = SGLANG_RULES[rule_then][0](written, num_layers)
        if got != list(canonical):
            raise SGLangTargetError(
                f"aux_layer_ids={list(canonical)} (hf_hidden_states) on {name}: written {written} for SGLang {newest} "
                f"({rule}), SGLang {release} captures hidden_states {got} instead ({served}: {rule_then}); set "
                f"export.sglang_version to {_next_rule_change(architectures, release)} or newer, or choose ids every "
                f"release reads alike (the default {default_aux_layer_ids(num_layers)} is)"
            )
    return written


def _releases_from(oldest: str) -> list[str]:
    if not oldest:
        return list(SGLANG_RELEASES)
    key = _release_key(oldest)
    before = [r for r in SGLANG_RELEASES if _release_key(r) <= key]
    start = before[-1] if before else SGLANG_RELEASES[0]
    return [r for r in SGLANG_RELEASES if _release_key(r) >= _release_key(start)]


def _first_serving(architectures: list[str]) -> str:
    """The oldest checked release from which on every later one serves the class with a known rule."""
    first = SGLANG_RELEASES[-1]
    for release in reversed(SGLANG_RELEASES):
        if not any(_rule_at(a, release) in SGLANG_RULES for a in architectures):
            break
        first = release
    return first


def _next_rule_change(architectures: list[str], release: str) -> str:
    """The first checked release after `release` whose rule for the class is the newest one."""
    newest = [_rule_at(a, SGLANG_RELEASES[-1]) for a in architectures]
    later = [r for r in SGLANG_RELEASES if _release_key(r) > _release_key(release)]
    rules = {r: [_rule_at(a, r) for a in architectures] for r in later}
    return next(r for at, r in enumerate(later) if all(rules[s] == newest for s in later[at:]))
