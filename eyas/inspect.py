"""`eyas inspect PATH`: audit a drafter directory from its config and safetensors headers only.

Detects the format (an eyas training checkpoint with arch.json, or an SGLang export with
config.json), lists every tensor with its shape, and reports every problem found, with the fix.
No tensor data is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from eyas.export import ExportError, arch_from_dict, arch_from_sglang_config
from eyas.formats import KeyCheckError, check_keys, expected_eyas_shapes, expected_sglang_shapes
from eyas.target import read_safetensors_header


@dataclass
class InspectReport:
    path: Path
    format: str
    shapes: dict[str, tuple[int, ...]]
    config: dict
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def text(self) -> str:
        lines = [f"{self.path}: format {self.format}, {len(self.shapes)} tensors"]
        lines += [f"  {name:48s} {list(shape)}" for name, shape in sorted(self.shapes.items())]
        for key in (
            "architectures",
            "draft_vocab_size",
            "vocab_size",
            "hidden_size",
            "tie_word_embeddings",
            "eagle_config",
            "aux_layer_ids",
            "layer_id_convention",
        ):
            if key in self.config:
                lines.append(f"  config.{key} = {json.dumps(self.config[key])}")
        lines.append("problems:" if self.problems else "no problems found")
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def read_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    header = read_safetensors_header(weights)
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def inspect_drafter(path: str | Path) -> InspectReport:
    root = Path(path)
    weights = root / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{root}: no model.safetensors; expected an eyas checkpoint or an exported drafter")
    shapes = read_shapes(weights)
    if (root / "arch.json").is_file():
        meta = json.loads((root / "arch.json").read_text())
        report = InspectReport(root, "eyas", shapes, meta)
        _check(report, lambda: expected_eyas_shapes(arch_from_dict(meta["arch"], str(root))))
        return report
    config = json.loads((root / "config.json").read_text())
    report = InspectReport(root, "sglang", shapes, config)
    _check(report, lambda: expected_sglang_shapes(arch_from_sglang_config(config, str(root))[0]))
    if config.get("tie_word_embeddings") is not False:
        report.problems.append(
            f"tie_word_embeddings is {config.get('tie_word_embeddings')!r}, expected false: the engine would tie "
            f"the draft's lm_head to the embedding and discard the trained head; re-export"
        )
    return report


def _check(report: InspectReport, expected) -> None:
    try:
        check_keys(report.shapes, expected(), str(report.path))
    except (KeyCheckError, ExportError) as err:
        report.problems.append(str(err))
