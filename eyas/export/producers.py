"""Who wrote a drafter directory, and so which format (key and config dialect) it is in (no torch here).

    producer = identify_producer(root, key_names)
    producer.format, producer.label          # "speculators", "speculators 0.9.0 (Eagle3DraftModel: trained)"

Each producer is told by what it really writes (tests/producer_fixtures.py builds one checkpoint of each,
with the real tool where it runs here and from a published checkpoint's config and key names where not):
- eyas: arch.json (a training checkpoint), or eyas_export.json beside an export.
- speculators: `speculators_model_type` in config.json, its release in `speculators_version`;
  `architectures` is ["Eagle3DraftModel"] when the model class saved itself (training, 0.3 and later) and
  ["Eagle3Speculator"] when `speculators convert` or an early release wrote it. Keys `layers.0.*`.
- vLLM format: `eagle_aux_hidden_state_layer_ids` at the top level of a LlamaForCausalLMEagle3 config.
- SGLang format: the ids under `eagle_config` (SpecForge writes this; so do other SGLang trainers and
  eyas). Keys `midlayer.*`, or `layers.0.*` (SGLang >= 0.5.12 only).
- EAGLE format: no layer ids anywhere (the engine takes the target's default layers). EAGLE official
  writes `architectures` ["LlamaForCausalLM"] and `pytorch_model.bin`; SpecForge's templates without
  eagle_config give the same format with ["LlamaForCausalLMEagle3"].
Nothing in a SpecForge config names SpecForge: an SGLang- or EAGLE-format config that eyas did not export
is read as SpecForge's ("specforge"), whose `norm_output` means something else (eyas.export.configs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eyas.export.drafter_dir import BIN_FILE, CONFIG_FILE, PROVENANCE_FILE, ExportError, read_export_provenance

ARCH_FILE = "arch.json"  # an eyas training checkpoint (eyas.train.checkpoint owns it)
SPECULATORS_ARCHITECTURES = ("Eagle3DraftModel", "Eagle3Speculator")
EAGLE_OFFICIAL_ARCHITECTURE = "LlamaForCausalLM"


@dataclass(frozen=True)
class Producer:
    """The tool that wrote a drafter (`name`: eyas, speculators, specforge, eagle-official), its release where
    the files say it, and the format its files are in."""

    name: str
    format: str
    version: str | None = None
    detail: str = ""

    @property
    def label(self) -> str:
        names = {
            "eyas": "eyas",
            "speculators": "speculators",
            "specforge": "SpecForge",
            "eagle-official": "EAGLE official",
            "other": "a producer the files do not name",
        }
        text = names[self.name] + (f" {self.version}" if self.version else "")
        return f"{text} ({self.detail})" if self.detail else text


def identify_producer(root: str | Path, key_names) -> Producer:
    """The producer and format of the drafter in `root`, from its JSON files and tensor names."""
    root = Path(root)
    if (root / ARCH_FILE).is_file():
        return Producer("eyas", "eyas", detail="training checkpoint")
    if not (root / CONFIG_FILE).is_file():
        raise ExportError(
            f"{root}: neither {ARCH_FILE} nor {CONFIG_FILE}; expected an eyas checkpoint or an exported drafter"
        )
    config = json.loads((root / CONFIG_FILE).read_text())
    architectures = config.get("architectures") or []
    fmt = "speculators" if "speculators_model_type" in config else _llama_format(config, list(key_names))
    provenance = read_export_provenance(root)
    if provenance is not None:
        return Producer("eyas", fmt, provenance.get("eyas_version"), f"export, {PROVENANCE_FILE}")
    if fmt == "speculators":
        how = {"Eagle3DraftModel": "trained", "Eagle3Speculator": "converted or an early release"}
        arch = architectures[0] if architectures else "no architectures"
        detail = f"{arch}: {how[arch]}" if arch in how else arch
        return Producer("speculators", fmt, config.get("speculators_version"), detail)
    if fmt == "eagle" and architectures == [EAGLE_OFFICIAL_ARCHITECTURE]:
        weights = BIN_FILE if (root / BIN_FILE).is_file() else "safetensors"
        return Producer("eagle-official", fmt, detail=f"{EAGLE_OFFICIAL_ARCHITECTURE}, {weights}")
    if fmt == "vllm":
        return Producer("other", fmt, detail="vLLM-format config")
    return Producer("specforge", fmt, detail="or another trainer writing SGLang's format")


def _llama_format(config: dict, names: list[str]) -> str:
    """The format of a Llama-style draft config: where its layer ids are, and its layer prefix."""
    if "eagle_aux_hidden_state_layer_ids" in config:
        return "vllm"
    if "eagle_aux_hidden_state_layer_ids" in (config.get("eagle_config") or {}):
        midlayer = any(k.startswith("midlayer.") for k in names)
        return "sglang-0.5.12" if not midlayer and any(k.startswith("layers.0.") for k in names) else "sglang"
    return "eagle"
