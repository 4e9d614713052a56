"""`eyas remap SRC DST --to FORMAT`: convert a drafter between checkpoint formats through the eyas form.

    from eyas.export.remap import remap_checkpoint
    remap_checkpoint("hub/eagle3-llama", "out/sglang", to="sglang")
    remap_checkpoint("out/sglang", "out/eyas", to="eyas", embed_from="target/model.safetensors")

The source format is detected (eyas.export.configs), its config read with every problem an error,
its keys checked against its exact expected set, renamed to eyas keys, then written in the
destination format and checked against that one's exact set. Formats that drop embed_tokens
need `embed_from` (a safetensors file with `embed_tokens.weight` or `model.embed_tokens.weight`)
to produce one that keeps it. The eagle format carries no layer ids: pass `num_target_layers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas.export.configs import detect_format
from eyas.export.convert import EXPORT_DTYPES, arch_from_config, convert_checkpoint
from eyas.export.drafter_dir import (
    CONFIG_FILE,
    MODEL_FILE,
    ExportError,
    read_export_provenance,
    tensor_shapes,
    write_export_dir,
)
from eyas.export.keys import FORMATS, check_keys, expected_shapes, invert_key_map
from eyas.layer_ids import default_aux_layer_ids
from eyas.train.checkpoint import DraftCheckpoint, read_checkpoint

EMBED_KEYS = ("embed_tokens.weight", "model.embed_tokens.weight")


def read_any(
    src: str | Path, *, embed_from: str | Path | None = None, num_target_layers: int | None = None
) -> tuple[str, DraftCheckpoint]:
    """(detected format, the draft in the eyas form) from a checkpoint directory of any format."""
    root = Path(src)
    weights = root / MODEL_FILE
    if not weights.is_file():
        raise ExportError(f"{root}: no {MODEL_FILE}; expected a drafter checkpoint directory")
    found = tensor_shapes(weights)
    fmt = detect_format(root, found)
    if fmt == "eyas":
        ckpt = read_checkpoint(root)
    else:
        config = json.loads((root / CONFIG_FILE).read_text())
        arch, ids = arch_from_config(fmt, config, where=f"{root}/config.json")
        check_keys(found, expected_shapes(fmt, arch), where=f"{root}/model.safetensors ({fmt} format)", fmt=fmt)
        tensors = load_file(weights)
        state = {src_key: tensors[dst] for dst, src_key in invert_key_map(FORMATS[fmt].key_map).items()}
        provenance = read_export_provenance(root) or {}
        ids = ids if ids is not None else _eagle_ids(root, provenance, num_target_layers)
        ckpt = DraftCheckpoint(root, arch, ids, str(provenance.get("target_fingerprint", "")), state)
    if embed_from is not None:
        ckpt.state["embed_tokens.weight"] = _read_embedding(Path(embed_from), ckpt)
    return fmt, ckpt


def _eagle_ids(root: Path, provenance: dict, num_target_layers: int | None) -> list[int]:
    if "aux_layer_ids" in provenance:
        return list(provenance["aux_layer_ids"])
    if num_target_layers is None:
        raise ExportError(
            f"{root}: eagle format, whose layer ids are fixed in the target's code ([2, N//2, N-3]); expected the "
            "target's layer count to name them: pass num_target_layers (eyas remap --num-target-layers N)"
        )
    return default_aux_layer_ids(num_target_layers)


def _read_embedding(path: Path, ckpt: DraftCheckpoint) -> torch.Tensor:
    expected = (ckpt.arch.target_vocab_size, ckpt.arch.hidden_size)
    with safe_open(path, framework="pt") as f:
        names = [k for k in EMBED_KEYS if k in f.keys()]
        if not names:
            raise ExportError(
                f"embed_from {path}: none of {list(EMBED_KEYS)}; expected the target's weights file that holds "
                "its input embedding (or an eyas checkpoint's model.safetensors)"
            )
        embed = f.get_tensor(names[0])
    if tuple(embed.shape) != expected:
        raise ExportError(
            f"embed_from {path}: {names[0]} has shape {list(embed.shape)}, expected {list(expected)} "
            "(target vocab x hidden size of the draft); it belongs to another target"
        )
    return embed


def remap_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    to: str,
    dtype: str | None = None,
    embed_from: str | Path | None = None,
    num_target_layers: int | None = None,
) -> Path:
    """Convert the drafter in src to format `to` in dst (replaced atomically); returns dst."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"remap dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    _, ckpt = read_any(src, embed_from=embed_from, num_target_layers=num_target_layers)
    tensors, files = convert_checkpoint(ckpt, to, dtype)
    return write_export_dir(Path(dst), tensors, files)
