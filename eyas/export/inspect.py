"""`eyas inspect PATH`: audit a drafter directory from its config and safetensors headers only.

Detects the format (eyas.export.configs: an eyas training checkpoint with arch.json, or an sglang,
sglang-0.5.12, vllm, speculators or eagle export with config.json), lists every tensor with its
shape, which engine versions load its key set completely, and every problem found, with the fix.
Only the header, the JSON files and the small d2t/t2d tensors are read; torch is not imported.
`--engine sglang<=0.5.10` (any key of ENGINE_LOADS) also makes a problem of a key set that
engine version would not fill completely (e.g. `layers.0.*`, which SGLang <= 0.5.10 drops).

Layer ids are checked where a sound reference exists: against eyas_export.json (the canonical ids
the export was made from) and, given the target's layer count, for range and for the canonical
default written where the destination expects the shifted form. Without either, a wrong
convention cannot be told from a deliberate choice, and the report says nothing about it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from eyas.draft_keys import vocab_mapping_problems
from eyas.export.configs import (
    ConfigError,
    detect_format,
    read_config,
)
from eyas.export.drafter_dir import PROVENANCE_FILE, read_export_provenance, read_small_tensor, tensor_shapes
from eyas.export.keys import ENGINE_LOADS, KeyCheckError, check_keys, expected_shapes, get_format
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
)


@dataclass
class InspectReport:
    path: Path
    format: str
    shapes: dict[str, tuple[int, ...]]
    config: dict
    engines: dict[str, bool] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def text(self) -> str:
        lines = [f"{self.path}: format {self.format}, {len(self.shapes)} tensors"]
        lines += [f"  {name:48s} {list(shape)}" for name, shape in sorted(self.shapes.items())]
        lines += [f"  config.{k} = {json.dumps(self.config[k])}" for k in _SHOWN_CONFIG if k in self.config]
        lines += [f"  loads completely in {e}: {'yes' if ok else 'NO'}" for e, ok in self.engines.items()]
        lines.append("problems:" if self.problems else "no problems found")
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def inspect_drafter(
    path: str | Path, *, num_target_layers: int | None = None, engine: str | None = None
) -> InspectReport:
    """Audit the drafter in `path`.

    num_target_layers (the target's N) enables the layer-id range checks; engine (a key of
    ENGINE_LOADS) adds a problem when that engine version would not load every tensor.
    """
    if engine is not None and engine not in ENGINE_LOADS:
        raise ValueError(f"engine {engine!r}: unknown; expected one of {sorted(ENGINE_LOADS)}")
    root = Path(path)
    weights = root / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{root}: no model.safetensors; expected an eyas checkpoint or an exported drafter")
    shapes = tensor_shapes(weights)
    fmt = detect_format(root, shapes)
    config = json.loads((root / ("arch.json" if fmt == "eyas" else "config.json")).read_text())
    report = InspectReport(root, fmt, shapes, config)
    if fmt != "eyas":
        report.engines = {e: any(_loads(f, shapes) for f in fmts) for e, fmts in ENGINE_LOADS.items()}
    arch, ids = _read_arch(report)
    if arch is None:
        return report
    _check_keys(report, arch)
    if "d2t" in shapes and "t2d" in shapes:
        d2t, t2d = read_small_tensor(weights, "d2t"), read_small_tensor(weights, "t2d")
        report.problems += vocab_mapping_problems(d2t, t2d, arch.draft_vocab_size)
    provenance = read_export_provenance(root)
    if provenance is not None and provenance.get("format") != fmt:
        report.problems.append(
            f"{PROVENANCE_FILE} says format {provenance.get('format')!r}, the files read as {fmt!r}: they were "
            "edited after the export; re-export (eyas remap) rather than editing keys or config by hand"
        )
    report.problems += layer_id_problems(fmt, ids, provenance, num_target_layers)
    if engine is not None and not report.engines.get(engine, False):
        report.problems.append(engine_problem(report, arch, engine))
    return report


def engine_problem(report: InspectReport, arch: SimpleNamespace, engine: str) -> str:
    """Why `engine` would not fill every parameter: the key check against its closest key set."""
    errors = []
    for fmt in ENGINE_LOADS[engine]:
        try:
            check_keys(report.shapes, expected_shapes(fmt, arch), f"{report.path} for {engine} ({fmt} keys)", fmt=fmt)
        except KeyCheckError as err:
            errors.append(str(err))
    return min(errors, key=lambda e: (e.count("\n"), e))


def _read_arch(report: InspectReport) -> tuple[SimpleNamespace | None, list[int] | None]:
    if report.format == "eyas":
        fields, ids = report.config.get("arch") or {}, report.config.get("aux_layer_ids")
        missing = sorted(set(_ARCH_FIELDS) - set(fields))
        if missing:
            report.problems.append(
                f"{report.path}/arch.json: arch lacks {missing}; expected every DraftArch field: re-save it from training"
            )
            return None, None
        return SimpleNamespace(**fields), ids
    try:
        info = read_config(report.format, report.config)
    except ConfigError as err:
        report.problems.append(str(err))
        return None, None
    report.problems += info.problems
    if info.arch["draft_vocab_size"] is None:
        info.arch["draft_vocab_size"] = report.shapes.get("lm_head.weight", (info.arch["target_vocab_size"],))[0]
    return SimpleNamespace(**info.arch), info.aux_layer_ids


def _check_keys(report: InspectReport, arch: SimpleNamespace) -> None:
    try:
        check_keys(report.shapes, expected_shapes(report.format, arch), str(report.path), fmt=report.format)
    except KeyCheckError as err:
        report.problems.append(str(err))
    except (AttributeError, TypeError) as err:
        report.problems.append(f"{report.path}: the config does not describe a draft architecture ({err}); re-export")


def _loads(fmt: str, shapes: dict) -> bool:
    """Whether the key set is exactly `fmt`'s (shapes are checked separately, against the config)."""
    keys = {dst for dst in get_format(fmt).key_map.values() if dst is not None}
    return set(shapes) == keys


def layer_id_problems(
    fmt: str, canonical: list[int] | None, provenance: dict | None, num_target_layers: int | None
) -> list[str]:
    """Layer ids in the wrong convention, judged against eyas_export.json and the target's layer count."""
    if canonical is None:
        return []
    convention = get_format(fmt).layer_id_convention
    engine = to_engine_layer_ids(canonical, convention) if fmt != "eyas" else canonical
    problems = []
    if provenance and provenance.get("format") == fmt and "aux_layer_ids" in provenance:
        expected = to_engine_layer_ids(list(provenance["aux_layer_ids"]), convention)
        if engine != expected:
            problems.append(
                f"aux layer ids {engine} ({convention}), expected {expected}: {PROVENANCE_FILE} records canonical "
                f"ids {provenance['aux_layer_ids']}, which are {expected} in {convention}; the config was written in "
                f"another convention ({LAYER_ID_CONVENTIONS[convention].description}): re-export with eyas remap"
            )
    if num_target_layers is None:
        return problems
    top = num_target_layers if fmt == "speculators" else num_target_layers - 1
    out_of_range = [i for i in canonical if not 1 <= i <= top]
    if out_of_range:
        problems.append(
            f"aux layer ids {engine} ({convention}) are canonical {canonical}; {out_of_range} fall outside 1..{top} "
            f"for a {num_target_layers}-layer target: the ids are in another convention or for another target"
        )
    default = default_aux_layer_ids(num_target_layers)
    if LAYER_ID_CONVENTIONS[convention].offset != 0 and engine == default:
        problems.append(
            f"aux layer ids {engine} ({convention}) equal the canonical default {default} of a "
            f"{num_target_layers}-layer target, but {convention} expects {to_engine_layer_ids(default, convention)} "
            "for those layers: canonical ids were written without conversion; re-export with eyas remap"
        )
    return problems
