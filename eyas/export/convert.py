"""Export a training checkpoint to an engine's EAGLE-3 draft format, and load such an export back.

    out = export_run(config)                                                  # the stage entry
    export_sglang("run/train/checkpoints/step-00000400", "run/export/sglang")
    export_checkpoint("run/train/checkpoints/step-00000400", "run/spec", to="speculators")
    draft = load_exported_draft("run/export/sglang", target_embed)            # what the engine would run

The checkpoint is read by its owner (eyas.train.checkpoint); the export directory is written by its
owner (eyas.export.drafter_dir): `model.safetensors` in the format's key names (eyas.export.keys),
`config.json` (eyas.export.configs: layer ids in the destination's numbering) and `eyas_export.json`.
Every export is checked against the destination's exact key set and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eyas.config import RunConfig
from eyas.dataset.vocab import check_vocab_mapping
from eyas.draft import DraftArch, Eagle3Draft
from eyas.export.configs import ConfigError, detect_format, read_config, write_config
from eyas.export.drafter_dir import (
    CONFIG_FILE,
    MODEL_FILE,
    PROVENANCE_FILE,
    ExportError,
    read_export_provenance,
    tensor_shapes,
    write_export_dir,
)
from eyas.export.keys import (
    FORMATS,
    SGLANG_NUM_AUX,
    check_keys,
    expected_shapes,
    get_format,
    invert_key_map,
    remap_keys,
)
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.train.checkpoint import (
    ARCH_FILE,
    COMPLETE_MARKER,
    DraftCheckpoint,
    arch_record,
    latest_complete,
    read_checkpoint,
)

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
SGLANG_EXPORT = "sglang"  # the export stage writes RUN/export/sglang
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Formats whose engine builds fc for exactly SGLANG_NUM_AUX aux layers.
_THREE_AUX_FORMATS = ("sglang", "sglang-0.5.12", "eagle")


def convert_checkpoint(ckpt: DraftCheckpoint, to: str, dtype: str | None) -> tuple[dict[str, torch.Tensor], dict]:
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
        meta = arch_record(ckpt.arch, ckpt.aux_layer_ids, ckpt.target_fingerprint)
        return tensors, {ARCH_FILE: meta, PROVENANCE_FILE: provenance, COMPLETE_MARKER: None}
    return tensors, {CONFIG_FILE: config, PROVENANCE_FILE: provenance}


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, *, to: str, dtype: str = "float32") -> Path:
    """Convert a training checkpoint to format `to` in out_dir (replaced atomically); returns out_dir."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    tensors, files = convert_checkpoint(read_checkpoint(checkpoint_dir), to, dtype)
    return write_export_dir(Path(out_dir), tensors, files)


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
    return detect_format(root, list(tensor_shapes(root / MODEL_FILE)))


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
    found = tensor_shapes(root / MODEL_FILE)
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


def export_run(config: RunConfig) -> Path:
    """The stage entry: the newest complete training checkpoint -> RUN/export/sglang, checked against SGLang's
    exact key set."""
    checkpoint = latest_complete(config.paths.train_dir)
    if checkpoint is None:
        raise FileNotFoundError(
            f"export: no complete checkpoint under {config.paths.train_dir}/checkpoints; run the train stage first"
        )
    out = export_sglang(checkpoint, config.paths.export_dir / SGLANG_EXPORT, dtype=config.export.dtype)
    print(f"exported {checkpoint.name} -> {out}")
    return out
