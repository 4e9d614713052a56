"""Export a training checkpoint to SGLang's EAGLE-3 draft format, and load such an export back.

    from eyas.export import export_sglang, load_exported_draft
    export_sglang("run/train/step-00000400", "run/export")          # -> Path("run/export")
    draft = load_exported_draft("run/export", target_embed)           # what SGLang would run

The export directory holds `model.safetensors` (SGLang key names, see eyas/formats.py),
`config.json` (LlamaForCausalLMEagle3, layer ids in SGLang's numbering) and `eyas_export.json`
(provenance: source checkpoint, target fingerprint, canonical layer ids). It is written to a
temporary directory and renamed into place, so a crash never leaves a half-written export.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.draft import DraftArch, Eagle3Draft
from eyas.formats import (
    SGLANG_KEY_MAP,
    SGLANG_NUM_AUX,
    check_keys,
    expected_eyas_shapes,
    expected_sglang_shapes,
    from_engine_layer_ids,
    invert_key_map,
    remap_keys,
    to_engine_layer_ids,
)
from eyas.fsio import fsync_path
from eyas.target import LAYER_ID_CONVENTION
from eyas.vocab import check_vocab_mapping

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SGLANG_LAYER_ID_CONVENTION = "sglang_llama"
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
PROVENANCE_FILE = "eyas_export.json"
_SGLANG_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """A checkpoint or an export that cannot be converted or loaded as it is."""


@dataclass
class Checkpoint:
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
    check_keys(_shapes(state), expected_eyas_shapes(arch), where=f"checkpoint {path}/model.safetensors (eyas format)")
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
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": arch.target_vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "target_hidden_size": arch.hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": to_engine_layer_ids(aux_layer_ids, SGLANG_LAYER_ID_CONVENTION),
            "use_aux_hidden_state": True,
        },
    }


def export_sglang(checkpoint_dir: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Convert a training checkpoint to SGLang's format in out_dir (replaced atomically); returns out_dir."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    ckpt = read_checkpoint(checkpoint_dir)
    arch = ckpt.arch
    if arch.num_aux != SGLANG_NUM_AUX:
        raise ExportError(
            f"checkpoint {ckpt.path}: num_aux={arch.num_aux}, expected {SGLANG_NUM_AUX}; SGLang's "
            f"LlamaForCausalLMEagle3 builds fc for exactly {SGLANG_NUM_AUX} aux layers: train with 3 aux layer ids"
        )
    where = f"checkpoint {ckpt.path}"
    check_vocab_mapping(ckpt.state["d2t"], ckpt.state["t2d"], where, arch.draft_vocab_size)
    names = remap_keys(ckpt.state, SGLANG_KEY_MAP, where=f"{where} (eyas -> sglang)")
    tensors = {dst: _cast(ckpt.state[src], dtype) for src, dst in names.items()}
    check_keys(_shapes(tensors), expected_sglang_shapes(arch), where=f"sglang export of {ckpt.path}")
    provenance = {
        "format": "sglang",
        "source_checkpoint": str(ckpt.path.resolve()),
        "target_fingerprint": ckpt.target_fingerprint,
        "aux_layer_ids": ckpt.aux_layer_ids,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "config_layer_id_convention": SGLANG_LAYER_ID_CONVENTION,
    }
    files = {
        "config.json": sglang_config(arch, ckpt.aux_layer_ids, dtype),
        PROVENANCE_FILE: provenance,
    }
    return _write_atomically(Path(out_dir), tensors, files)


def _cast(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return (t.to(_TORCH_DTYPES[dtype]) if t.is_floating_point() else t).contiguous()


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _write_atomically(out: Path, tensors: dict[str, torch.Tensor], files: dict[str, dict]) -> Path:
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
    for name, data in files.items():
        (tmp / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
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


def arch_from_sglang_config(config: dict, where: str) -> tuple[DraftArch, list[int]]:
    """(DraftArch, canonical aux layer ids) from an SGLang draft config.json."""
    if config.get("architectures") != [SGLANG_ARCHITECTURE]:
        raise ExportError(
            f"{where}: architectures {config.get('architectures')}, expected [{SGLANG_ARCHITECTURE!r}]; "
            "this is not an SGLang EAGLE-3 Llama draft"
        )
    eagle = config.get("eagle_config") or {}
    missing = [k for k in _SGLANG_CONFIG_KEYS if k not in config]
    eagle_keys = ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state")
    missing += [f"eagle_config.{k}" for k in eagle_keys if k not in eagle]
    if missing or eagle.get("use_aux_hidden_state") is not True:
        raise ExportError(
            f"{where}: missing {missing}, use_aux_hidden_state={eagle.get('use_aux_hidden_state')!r}; expected every "
            "field export_sglang writes, with an explicit draft_vocab_size and use_aux_hidden_state true: re-export it"
        )
    if config.get("target_hidden_size", config["hidden_size"]) != config["hidden_size"]:
        raise ExportError(
            f"{where}: target_hidden_size {config['target_hidden_size']} differs from hidden_size "
            f"{config['hidden_size']}; eyas drafts use the target's hidden size"
        )
    engine_ids = list(eagle["eagle_aux_hidden_state_layer_ids"])
    arch = DraftArch(
        hidden_size=config["hidden_size"],
        num_aux=len(engine_ids),
        target_vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
    )
    return arch, from_engine_layer_ids(engine_ids, SGLANG_LAYER_ID_CONVENTION)


def load_exported_draft(export_dir: str | Path, target_embed: torch.Tensor) -> Eagle3Draft:
    """The draft as SGLang runs it: exported weights (key set checked strictly), embed from the target.

    The returned draft (float32, eval mode) carries `aux_layer_ids`: the canonical ids to capture.
    """
    root = Path(export_dir)
    for name in ("config.json", "model.safetensors"):
        if not (root / name).is_file():
            raise ExportError(f"export {root}: no {name}; expected an SGLang draft directory written by export_sglang")
    config = json.loads((root / "config.json").read_text())
    arch, aux_layer_ids = arch_from_sglang_config(config, where=f"export {root}/config.json")
    with safe_open(root / "model.safetensors", framework="pt") as f:
        found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    check_keys(found, expected_sglang_shapes(arch), where=f"export {root}/model.safetensors (sglang format)")
    expected_embed = (arch.target_vocab_size, arch.hidden_size)
    if tuple(target_embed.shape) != expected_embed:
        raise ExportError(
            f"target embedding: shape {list(target_embed.shape)}, expected {list(expected_embed)} "
            f"(vocab_size x hidden_size of export {root}); the draft was trained for another target"
        )
    tensors = load_file(root / "model.safetensors")
    state = {src: tensors[dst] for dst, src in invert_key_map(SGLANG_KEY_MAP).items()}
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
    state["embed_tokens.weight"] = target_embed.detach().float()
    check_vocab_mapping(state["d2t"], state["t2d"], f"export {root}", arch.draft_vocab_size)
    draft = Eagle3Draft(arch)
    draft.load_state_dict(state, strict=True)
    draft.freeze_embeddings()
    draft.eval()
    draft.aux_layer_ids = aux_layer_ids
    return draft


def read_export_provenance(export_dir: str | Path) -> dict | None:
    """eyas_export.json of an eyas export, or None for an SGLang draft written elsewhere."""
    path = Path(export_dir) / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
