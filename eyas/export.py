"""Export a training checkpoint to an engine's EAGLE-3 draft format, and load such an export back.

    from eyas.export import export_sglang, export_checkpoint, load_exported_draft
    export_sglang("run/train/step-00000400", "run/export")                  # -> Path("run/export")
    export_checkpoint("run/train/step-00000400", "run/spec", to="speculators")
    draft = load_exported_draft("run/export", target_embed)                   # what the engine would run

An export directory holds `model.safetensors` (the format's key names, see eyas/formats.py),
`config.json` (see eyas/dialects.py: layer ids in the destination's numbering) and
`eyas_export.json` (provenance: format, source checkpoint, target fingerprint, canonical layer
ids). It is written to a temporary directory and renamed into place, so a crash never leaves a
half-written export. Every export is checked against the destination's exact key set and shapes.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eyas.dialects import ConfigError, detect_format, read_config, read_safetensors_header, write_config
from eyas.draft import DraftArch, Eagle3Draft
from eyas.formats import (
    FORMATS,
    SGLANG_NUM_AUX,
    check_keys,
    expected_eyas_shapes,
    expected_shapes,
    get_format,
    invert_key_map,
    remap_keys,
)
from eyas.fsio import fsync_path
from eyas.target import LAYER_ID_CONVENTION
from eyas.vocab import check_vocab_mapping

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
PROVENANCE_FILE = "eyas_export.json"
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Formats whose engine builds fc for exactly SGLANG_NUM_AUX aux layers.
_THREE_AUX_FORMATS = ("sglang", "sglang-0.5.12", "eagle")


class ExportError(ValueError):
    """A checkpoint or an export that cannot be converted or loaded as it is."""


@dataclass
class Checkpoint:
    """A draft in the eyas form: eyas keys (embed_tokens.weight may be absent), canonical layer ids."""

    path: Path
    arch: DraftArch
    aux_layer_ids: list[int]
    target_fingerprint: str
    state: dict[str, torch.Tensor]


def read_checkpoint(checkpoint_dir: str | Path) -> Checkpoint:
    """A complete training checkpoint: arch.json, model.safetensors (eyas keys, checked strictly)."""
    path = Path(checkpoint_dir)
    for name in ("COMPLETE", "arch.json", "model.safetensors"):
        if not (path / name).is_file():
            raise ExportError(
                f"checkpoint {path}: no {name}; expected a complete training checkpoint "
                "(COMPLETE, arch.json, model.safetensors); pick a checkpoint whose COMPLETE marker exists"
            )
    meta = json.loads((path / "arch.json").read_text())
    convention = meta.get("layer_id_convention")
    if convention != LAYER_ID_CONVENTION:
        raise ExportError(
            f"checkpoint {path}/arch.json: layer_id_convention {convention!r}, expected {LAYER_ID_CONVENTION!r}; "
            "eyas checkpoints store HF hidden_states indices; convert the ids before exporting"
        )
    arch = arch_from_dict(meta.get("arch", {}), where=f"checkpoint {path}/arch.json")
    state = load_file(path / "model.safetensors")
    check_keys(
        _shapes(state),
        expected_eyas_shapes(arch),
        where=f"checkpoint {path}/model.safetensors (eyas format)",
        fmt="eyas",
    )
    ids = list(meta.get("aux_layer_ids", []))
    if len(ids) != arch.num_aux:
        raise ExportError(
            f"checkpoint {path}/arch.json: aux_layer_ids={ids} has {len(ids)} ids, expected arch.num_aux="
            f"{arch.num_aux}; the checkpoint metadata is inconsistent: re-save it from training"
        )
    return Checkpoint(path, arch, ids, str(meta.get("target_fingerprint", "")), state)


def arch_from_dict(data: dict, where: str) -> DraftArch:
    names = {f.name for f in fields(DraftArch)}
    required = {f.name for f in fields(DraftArch) if f.default is MISSING}
    missing, unknown = sorted(required - set(data)), sorted(set(data) - names)
    if missing or unknown:
        raise ExportError(
            f"{where}: arch has missing fields {missing} and unknown fields {unknown}; "
            f"expected the fields of DraftArch {sorted(names)}"
        )
    return DraftArch(**data)


def sglang_config(arch: DraftArch, aux_layer_ids: list[int], dtype: str) -> dict:
    """config.json of an SGLang EAGLE-3 draft; aux_layer_ids are canonical and converted here."""
    return write_config("sglang", arch, aux_layer_ids, dtype)


def convert_checkpoint(ckpt: Checkpoint, to: str, dtype: str | None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors in format `to`, files beside them) from the eyas form, checked against `to`'s exact key set."""
    fmt = get_format(to)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    where = f"checkpoint {ckpt.path}"
    if to in _THREE_AUX_FORMATS and ckpt.arch.num_aux != SGLANG_NUM_AUX:
        raise ExportError(
            f"{where}: num_aux={ckpt.arch.num_aux}, expected {SGLANG_NUM_AUX}; SGLang's LlamaForCausalLMEagle3 "
            f"builds fc for exactly {SGLANG_NUM_AUX} aux layers: train with 3 aux layer ids"
        )
    check_vocab_mapping(ckpt.state["d2t"], ckpt.state["t2d"], where, ckpt.arch.draft_vocab_size)
    needed = set(invert_key_map(fmt.key_map).values())
    if "embed_tokens.weight" in needed and "embed_tokens.weight" not in ckpt.state:
        raise ExportError(
            f"{where}: no embed_tokens.weight, expected one for format {to!r} (it stores the embedding); the source "
            "format dropped it: pass embed_from (eyas remap --embed-from TARGET_WEIGHTS.safetensors)"
        )
    names = remap_keys(ckpt.state, fmt.key_map, where=f"{where} (eyas -> {to})")
    tensors = {dst: _cast(ckpt.state[src], dtype) for src, dst in names.items()}
    check_keys(_shapes(tensors), expected_shapes(to, ckpt.arch), where=f"{to} export of {ckpt.path}", fmt=to)
    stored = dtype or _float_dtype(tensors)
    try:
        config = write_config(to, ckpt.arch, ckpt.aux_layer_ids, stored) if to != "eyas" else None
    except ValueError as err:
        raise ExportError(f"{where}: {err}") from err
    provenance = {
        "format": to,
        "source_checkpoint": str(ckpt.path.resolve()),
        "target_fingerprint": ckpt.target_fingerprint,
        "aux_layer_ids": ckpt.aux_layer_ids,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "config_layer_id_convention": fmt.layer_id_convention,
    }
    if to == "eyas":
        meta = {
            "arch": ckpt.arch.to_dict(),
            "aux_layer_ids": ckpt.aux_layer_ids,
            "layer_id_convention": LAYER_ID_CONVENTION,
            "target_fingerprint": ckpt.target_fingerprint,
        }
        return tensors, {"arch.json": meta, PROVENANCE_FILE: provenance, "COMPLETE": None}
    return tensors, {"config.json": config, PROVENANCE_FILE: provenance}


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, to: str, dtype: str = "float32") -> Path:
    """Convert a training checkpoint to format `to` in out_dir (replaced atomically); returns out_dir."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    tensors, files = convert_checkpoint(read_checkpoint(checkpoint_dir), to, dtype)
    return write_atomically(Path(out_dir), tensors, files)


def export_sglang(checkpoint_dir: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Convert a training checkpoint to SGLang's format (`midlayer.*`, loaded by every SGLang version)."""
    return export_checkpoint(checkpoint_dir, out_dir, to="sglang", dtype=dtype)


def _cast(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    return (t.to(_TORCH_DTYPES[dtype]) if dtype and t.is_floating_point() else t).contiguous()


def _float_dtype(tensors: dict[str, torch.Tensor]) -> str:
    names = {v: k for k, v in _TORCH_DTYPES.items()}
    found = sorted({names.get(t.dtype, str(t.dtype)) for t in tensors.values() if t.is_floating_point()})
    return found[0] if len(found) == 1 else "float32"


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def write_atomically(out: Path, tensors: dict[str, torch.Tensor], files: dict[str, dict | None]) -> Path:
    """model.safetensors and JSON files (None: an empty marker, written last) in out, replaced atomically."""
    if out.exists() and any(out.iterdir()) and not (out / PROVENANCE_FILE).is_file():
        raise ExportError(
            f"export directory {out}: exists, is not empty and holds no {PROVENANCE_FILE}; expected an empty "
            "directory or an earlier eyas export; refusing to replace it: pick another directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    for stale in (tmp, old):
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name, data in sorted(files.items(), key=lambda item: item[1] is None):
        (tmp / name).write_text("" if data is None else json.dumps(data, indent=2, sort_keys=True) + "\n")
    for child in tmp.iterdir():
        fsync_path(child)
    fsync_path(tmp)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    fsync_path(out.parent)
    if old.exists():
        shutil.rmtree(old)
    return out


def arch_from_config(fmt: str, config: dict, where: str) -> tuple[DraftArch, list[int] | None]:
    """(DraftArch, canonical aux layer ids) from a `fmt` config; every problem found is one ExportError."""
    try:
        info = read_config(fmt, config)
    except ConfigError as err:
        raise ExportError(f"{where}: {err}") from err
    if info.problems:
        raise ExportError(f"{where} ({fmt} format): " + "; ".join(info.problems))
    return DraftArch(**info.arch), info.aux_layer_ids


def detect_export_format(root: Path) -> str:
    header = read_safetensors_header(root / "model.safetensors")
    return detect_format(root, [k for k in header if k != "__metadata__"])


def load_exported_draft(export_dir: str | Path, target_embed: torch.Tensor) -> Eagle3Draft:
    """The draft as the engine runs it: exported weights (key set checked strictly), embed from the target.

    The returned draft (float32, eval mode) carries `aux_layer_ids`: the canonical ids to capture.
    """
    root = Path(export_dir)
    for name in ("config.json", "model.safetensors"):
        if not (root / name).is_file():
            raise ExportError(f"export {root}: no {name}; expected a drafter directory written by export_checkpoint")
    fmt = detect_export_format(root)
    config = json.loads((root / "config.json").read_text())
    arch, aux_layer_ids = arch_from_config(fmt, config, where=f"export {root}/config.json")
    header = read_safetensors_header(root / "model.safetensors")
    found = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    check_keys(found, expected_shapes(fmt, arch), where=f"export {root}/model.safetensors ({fmt} format)", fmt=fmt)
    expected_embed = (arch.target_vocab_size, arch.hidden_size)
    if tuple(target_embed.shape) != expected_embed:
        raise ExportError(
            f"target embedding: shape {list(target_embed.shape)}, expected {list(expected_embed)} "
            f"(vocab_size x hidden_size of export {root}); the draft was trained for another target"
        )
    tensors = load_file(root / "model.safetensors")
    state = {src: tensors[dst] for dst, src in invert_key_map(FORMATS[fmt].key_map).items()}
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    state["embed_tokens.weight"] = target_embed.detach().float()
    check_vocab_mapping(state["d2t"], state["t2d"], f"export {root}", arch.draft_vocab_size)
    draft = Eagle3Draft(arch)
    draft.load_state_dict(state, strict=True)
    draft.freeze_embeddings()
    draft.eval()
    provenance = read_export_provenance(root)
    draft.aux_layer_ids = (
        aux_layer_ids if aux_layer_ids is not None or provenance is None else provenance["aux_layer_ids"]
    )
    return draft


def read_export_provenance(export_dir: str | Path) -> dict | None:
    """eyas_export.json of an eyas export, or None for a drafter written elsewhere."""
    path = Path(export_dir) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
