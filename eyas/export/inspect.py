"""`eyas inspect PATH`: audit a drafter directory from its config and safetensors headers only.

Names the producer and format (eyas.export.producers: an eyas training checkpoint or export, speculators
with its release, SpecForge, EAGLE official, a vLLM-format config), reads the config as that producer
writes it (eyas.export.configs: what is derived is listed as a note), lists every tensor with its shape,
the draft options it turns on, which engine versions fill every tensor and run every option
(eyas.export.serving), and every problem found, with the fix: every float weight is read, a chunk at a time,
for NaN and inf (eyas.export.finite); otherwise the header (or the pickle of a pytorch_model.bin), the JSON
files and the small d2t/t2d tensors are read; torch is not imported.
`--engine sglang<=0.5.11` (any key of ENGINES) also makes a problem of a drafter that engine version
would not run as trained (e.g. `layers.0.*`, which SGLang <= 0.5.11 drops, or an option it ignores).

Layer ids are read in the numbering of the target's class given --target (SGLang numbers a DeepSeek or
Kimi target's ids otherwise than a Llama's), else in the one eyas's export recorded in eyas_export.json,
else in the format's own (SGLang's: Llama's), which the report notes. They are checked where a sound
reference exists: against eyas_export.json (the canonical ids the export was made from) and, given the
target's layer count, for range and for the canonical default written where the destination expects the
shifted form. Without either, a wrong convention cannot be told from a deliberate choice, and the report
says nothing about it. Given --target, a drafter whose hidden size or vocab is not the target's is a
problem too (those two come from eyas.target, which imports torch: only then).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from eyas.config import variant_of
from eyas.draft_keys import DRAFT_OPTIONS, vocab_mapping_problems
from eyas.export.configs import ConfigError, TargetRef, read_config
from eyas.export.drafter_dir import (
    PROVENANCE_FILE,
    read_export_provenance,
    read_small_tensor,
    recorded_numbering,
    tensor_shapes,
    weights_file,
)
from eyas.export.finite import nonfinite_problems
from eyas.export.keys import (
    KeyCheckError,
    check_keys,
    derivable_keys,
    expected_shapes,
    format_convention,
    get_format,
)
from eyas.export.producers import Producer, identify_producer
from eyas.export.serving import ENGINES, serving_engines
from eyas.layer_ids import LAYER_ID_CONVENTIONS, default_aux_layer_ids, to_engine_layer_ids

_ARCH_FIELDS = (
    "hidden_size",
    "num_aux",
    "target_vocab_size",
    "draft_vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)
_SHOWN_CONFIG = (
    "architectures",
    "draft_vocab_size",
    "vocab_size",
    "hidden_size",
    "tie_word_embeddings",
    "eagle_config",
    "eagle_aux_hidden_state_layer_ids",
    "aux_layer_ids",
    "layer_id_convention",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "num_hidden_layers",
)


@dataclass
class InspectReport:
    path: Path
    producer: Producer
    shapes: dict[str, tuple[int, ...]]
    config: dict
    options: tuple[str, ...] = ()
    engines: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def format(self) -> str:
        return self.producer.format

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def variant(self) -> str | None:
        """The draft.variant these options are (eyas.draft_keys.DRAFT_VARIANTS), None for another combination."""
        return variant_of(self.options)

    @property
    def text(self) -> str:
        lines = [f"{self.path}: format {self.format}, {len(self.shapes)} tensors, written by {self.producer.label}"]
        lines += [f"  {name:48s} {list(shape)}" for name, shape in sorted(self.shapes.items())]
        lines += [f"  config.{k} = {json.dumps(self.config[k])}" for k in _SHOWN_CONFIG if k in self.config]
        lines.append(f"  draft options: {', '.join(self.options) or 'none (plain EAGLE-3)'}")
        lines.append(f"  draft variant: {self.variant or 'none that eyas trains (draft.variant)'}")
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  loads completely in {e}: {'yes' if ok else 'NO'}" for e, ok in self.engines.items()]
        lines.append("problems:" if self.problems else "no problems found")
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def inspect_drafter(
    path: str | Path,
    *,
    num_target_layers: int | None = None,
    engine: str | None = None,
    target: str | Path | None = None,
) -> InspectReport:
    """Audit the drafter in `path`.

    num_target_layers (the target's N) enables the layer-id range checks; engine (a key of ENGINES) adds a
    problem when that engine version would not fill every tensor or run every draft option; target (its model
    directory or config.json) gives N and the numbering SGLang reads the draft's ids in.
    """
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: unknown; expected one of {sorted(ENGINES)}")
    ref = TargetRef.read(target) if target is not None else None
    num_target_layers = num_target_layers or (ref.num_layers if ref else None)
    root = Path(path)
    weights = weights_file(root)
    shapes = tensor_shapes(weights)
    producer = identify_producer(root, shapes)
    config = json.loads((root / ("arch.json" if producer.format == "eyas" else "config.json")).read_text())
    report = InspectReport(root, producer, shapes, config)
    report.problems += nonfinite_problems(weights)
    provenance = read_export_provenance(root)
    convention = _numbering(report, ref, provenance)
    arch, ids = _read_arch(report, convention)
    if arch is None:
        return report
    report.options = tuple(o for o in DRAFT_OPTIONS if getattr(arch, o, False))
    derivable = _derivable(report, arch)
    report.notes += sorted(set(derivable.values()))
    expected = _expected(report, arch)
    shapes = {**shapes, **{k: expected[k] for k in derivable if k in expected}}
    if report.format != "eyas":
        matches = {f: _loads(f, shapes, arch) for e in ENGINES.values() for f in e.formats}
        report.engines = serving_engines(report.format, matches, report.options, getattr(arch, "num_layers", 1))
    _check_keys(report, arch, shapes)
    if "d2t" in report.shapes and "t2d" in report.shapes:
        d2t, t2d = read_small_tensor(weights, "d2t"), read_small_tensor(weights, "t2d")
        report.problems += vocab_mapping_problems(d2t, t2d, arch.draft_vocab_size)
    fmt = report.format
    if provenance is not None and provenance.get("format") != fmt:
        report.problems.append(
            f"{PROVENANCE_FILE} says format {provenance.get('format')!r}, the files read as {fmt!r}: they were "
            "edited after the export; re-export (eyas remap) rather than editing keys or config by hand"
        )
    report.problems += layer_id_problems(fmt, ids, provenance, num_target_layers, convention, target=ref)
    if ref is not None:
        problems, notes = target_fit_problems(arch, ref)
        report.problems += problems
        report.notes += notes
    if engine is not None and not report.engines.get(engine, False):
        report.problems += engine_problems(report, arch, shapes, engine)
    return report


def _numbering(report: InspectReport, ref: TargetRef | None, provenance: dict | None) -> str:
    """The numbering the config's layer ids are read in: the target's class's (--target), else the one eyas's
    export recorded, else the format's own, which a note names."""
    fmt = report.format
    if ref is not None:
        return format_convention(fmt, list(ref.architectures))
    recorded = recorded_numbering(provenance, fmt)
    if recorded is not None:
        if recorded != format_convention(fmt):
            report.notes.append(
                f"layer ids read in {recorded} numbering, which {PROVENANCE_FILE} records the export wrote them in "
                f"({LAYER_ID_CONVENTIONS[recorded].description})"
            )
        return recorded
    convention = format_convention(fmt)
    if convention == "sglang_llama":
        report.notes.append(
            f"layer ids read in sglang_llama numbering (a Llama/Qwen target), as no {PROVENANCE_FILE} records the "
            "numbering; for a DeepSeek or Kimi target pass the target (--target), whose SGLang numbering differs"
        )
    return convention


def target_fit_problems(arch: SimpleNamespace, ref: TargetRef) -> tuple[list[str], list[str]]:
    """(problems, notes): a drafter whose hidden size or vocab is not the target's (--target), whose fc, embedding
    and vocab mapping would not fit the states and tokens the target gives; a note for what the target's files do
    not say (a config.json without weights gives no embedding rows)."""
    hidden, vocab, vocab_source = _target_shape(ref)
    where = f"target {ref.path}"
    fix = "train a drafter for this target, or pass the target the drafter was trained for (--target)"
    problems, notes = [], []
    if hidden is None:
        notes.append(f"{where}: config.json gives no hidden_size; the drafter's hidden size is not checked")
    elif arch.hidden_size != hidden:
        problems.append(
            f"hidden_size {arch.hidden_size} (the drafter's; fc takes {arch.num_aux} x {arch.hidden_size}), "
            f"expected {hidden}, the hidden size of {where}: {fix}"
        )
    if vocab is None:
        notes.append(f"{where}: neither weights nor config.json give the vocab; the drafter's vocab is not checked")
    elif arch.target_vocab_size != vocab:
        problems.append(
            f"target vocab {arch.target_vocab_size} (the drafter's vocab_size, the length of its t2d), expected "
            f"{vocab}, {vocab_source} of {where}: {fix}"
        )
    return problems, notes


def _target_shape(ref: TargetRef) -> tuple[int | None, int | None, str]:
    """(hidden size, vocab, where the vocab comes from) of the target's text model: the vocab is the rows of its
    input embedding in the weight headers (what training takes), else config.json's vocab_size."""
    config = json.loads((Path(ref.path) / "config.json").read_text())
    text = config.get("text_config") or config
    vocab, source = text.get("vocab_size"), "the vocab_size in config.json"
    if any(Path(ref.path).glob("*.safetensors")):
        from eyas.target import find_weight  # imports torch: only for a target with weights

        found = find_weight(ref.path, "embed_tokens.weight")
        if found is not None:
            vocab, source = int(found[2]["shape"][0]), f"the rows of the input embedding {found[1]}"
    return text.get("hidden_size"), vocab, source


def engine_problems(report: InspectReport, arch: SimpleNamespace, shapes: dict, engine: str) -> list[str]:
    """Why `engine` would not run the drafter as trained: the key check against its closest key set, and
    each draft option it does not run."""
    e = ENGINES[engine]
    problems = [
        f"{o}: {engine} does not run this draft option; it runs {list(e.options) or 'none'}"
        for o in report.options
        if o not in e.options
    ]
    errors = []
    for fmt in e.formats:
        try:
            check_keys(shapes, expected_shapes(fmt, arch), f"{report.path} for {engine} ({fmt} keys)", fmt=fmt)
        except KeyCheckError as err:
            errors.append(str(err))
    if len(errors) == len(e.formats):
        problems.insert(0, min(errors, key=lambda text: (text.count("\n"), text)))
    return problems


def _read_arch(report: InspectReport, convention: str) -> tuple[SimpleNamespace | None, list[int] | None]:
    if report.format == "eyas":
        fields, ids = report.config.get("arch") or {}, report.config.get("aux_layer_ids")
        fields = {**dict.fromkeys(DRAFT_OPTIONS, False), **fields}
        missing = sorted(set(_ARCH_FIELDS) - set(fields))
        if missing:
            report.problems.append(
                f"{report.path}/arch.json: arch lacks {missing}; expected every DraftArch field: re-save it from training"
            )
            return None, None
        return SimpleNamespace(**fields), ids
    try:
        info = read_config(report.format, report.config, report.producer.name, convention)
    except ConfigError as err:
        report.problems.append(str(err))
        return None, None
    report.problems += info.problems
    report.notes += info.notes
    if info.arch["draft_vocab_size"] is None:
        info.arch["draft_vocab_size"] = report.shapes.get("lm_head.weight", (info.arch["target_vocab_size"],))[0]
    return SimpleNamespace(**info.arch), info.aux_layer_ids


def _derivable(report: InspectReport, arch: SimpleNamespace) -> dict[str, str]:
    try:
        return derivable_keys(report.format, arch, report.shapes)
    except (AttributeError, TypeError):
        return {}


def _expected(report: InspectReport, arch: SimpleNamespace) -> dict:
    try:
        return expected_shapes(report.format, arch)
    except (AttributeError, TypeError):
        return {}


def _check_keys(report: InspectReport, arch: SimpleNamespace, shapes: dict) -> None:
    try:
        check_keys(shapes, expected_shapes(report.format, arch), str(report.path), fmt=report.format)
    except KeyCheckError as err:
        report.problems.append(str(err))
    except (AttributeError, TypeError) as err:
        report.problems.append(f"{report.path}: the config does not describe a draft architecture ({err}); re-export")


def _loads(fmt: str, shapes: dict, arch: SimpleNamespace) -> bool:
    """Whether the key set is exactly `fmt`'s for this draft (shapes are checked separately); a format
    without a stack never loads a draft of num_layers > 1."""
    try:
        return set(shapes) == set(expected_shapes(fmt, arch))
    except (AttributeError, TypeError, ValueError):
        return False


def layer_range_problems(fmt: str, canonical: list[int] | None, num_target_layers: int | None) -> list[str]:
    """Canonical ids that a `fmt` engine cannot capture for an N-layer target: 1..N-1 (inputs of its layers),
    and N (the final state) for speculators."""
    if canonical is None or num_target_layers is None:
        return []
    top = num_target_layers if fmt == "speculators" else num_target_layers - 1
    out_of_range = [i for i in canonical if not 1 <= i <= top]
    if not out_of_range:
        return []
    return [
        f"aux layer ids (canonical {canonical}): {out_of_range} fall outside 1..{top}, what {fmt} can capture of a "
        f"{num_target_layers}-layer target (N = the final state only for speculators): the ids are in another "
        "convention or for another target, or the destination cannot serve them"
    ]


def layer_id_problems(
    fmt: str,
    canonical: list[int] | None,
    provenance: dict | None,
    num_target_layers: int | None,
    convention: str | None = None,
    *,
    target: TargetRef | None = None,
) -> list[str]:
    """Layer ids in the wrong convention, judged against eyas_export.json and the target's layer count;
    `target` (--target) names the target whose numbering `convention` is."""
    if canonical is None:
        return []
    convention = convention or get_format(fmt).layer_id_convention
    engine = to_engine_layer_ids(canonical, convention) if fmt != "eyas" else canonical
    problems = []
    if provenance and provenance.get("format") == fmt and "aux_layer_ids" in provenance:
        problems += _provenance_problems(fmt, engine, provenance, convention, target)
    if num_target_layers is None:
        return problems
    problems += layer_range_problems(fmt, canonical, num_target_layers)
    default = default_aux_layer_ids(num_target_layers)
    if LAYER_ID_CONVENTIONS[convention].offset != 0 and engine == default:
        problems.append(
            f"aux layer ids {engine} ({convention}) equal the canonical default {default} of a "
            f"{num_target_layers}-layer target, but {convention} expects {to_engine_layer_ids(default, convention)} "
            "for those layers: canonical ids were written without conversion; re-export with eyas remap"
        )
    return problems


def _provenance_problems(fmt: str, engine: list[int], provenance: dict, convention: str, target) -> list[str]:
    """The config's ids against the canonical ids eyas_export.json records, read in `convention`."""
    recorded, written = list(provenance["aux_layer_ids"]), recorded_numbering(provenance, fmt)
    for_target = f"target {target.path} " if target is not None else ""
    try:
        expected = to_engine_layer_ids(recorded, convention)
    except ValueError as err:
        return [
            f"aux layer ids: {PROVENANCE_FILE} records canonical ids {recorded}, which {for_target}numbering "
            f"{convention} cannot express ({err}): retrain with other aux layer ids for this target"
        ]
    if engine == expected:
        return []
    if target is not None and written not in (None, convention):
        return [
            f"aux layer ids {engine} ({convention}, the numbering of {for_target.strip()}), expected {expected}: "
            f"the export wrote canonical ids {recorded} in {written} numbering ({PROVENANCE_FILE}), for a target "
            f"of another family, and SGLang would capture other layers of this one than the draft was trained on: "
            f"re-export for this target (eyas remap {provenance.get('source_checkpoint') or 'CHECKPOINT'} DST --to "
            f"{fmt} --target {target.path})"
        ]
    return [
        f"aux layer ids {engine} ({convention}), expected {expected}: {PROVENANCE_FILE} records canonical "
        f"ids {recorded}, which are {expected} in {convention}; the config was written in "
        f"another convention ({LAYER_ID_CONVENTIONS[convention].description}): re-export with eyas remap"
    ]
