"""Export a training checkpoint to an engine's EAGLE-3 draft format, and load such an export back.

    out = export_run(config)                                                  # the stage entry
    export_sglang("run/train/checkpoints/step-00000400", "run/export/sglang")
    export_checkpoint("run/train/checkpoints/step-00000400", "run/spec", to="speculators")

The checkpoint is read by its owner (eyas.train.checkpoint); the export directory is written by its
owner (eyas.export.drafter_dir): `model.safetensors` in the format's key names (eyas.export.keys),
`config.json` (eyas.export.configs: layer ids in the destination's numbering) and `eyas_export.json`.
Every export is checked against the destination's exact key set and shapes, and its draft options
against what the destination runs (eyas.export.serving). eyas.export.reader reads any drafter back.
"""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import torch

from eyas.config import RunConfig
from eyas.dataset.vocab import check_vocab_mapping
from eyas.export.configs import TargetRef, write_config
from eyas.export.drafter_dir import CONFIG_FILE, PROVENANCE_FILE, ExportError, write_export_dir
from eyas.export.keys import (
    check_keys,
    expected_shapes,
    format_convention,
    get_format,
    invert_key_map,
    remap_keys,
)
from eyas.export.serving import SGLANG_FORMAT_SINCE, num_aux_problem, num_layers_problem, option_problems
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.train.checkpoint import ARCH_FILE, COMPLETE_MARKER, DraftCheckpoint, arch_record, read_checkpoint
from eyas.train.checkpoint_fallback import export_choice

EXPORT_DTYPES = ("float32", "bfloat16", "float16")
EYAS_VERSION = version("eyas")
SGLANG_EXPORT = "sglang"  # the export stage writes RUN/export/sglang
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_checkpoint(
    ckpt: DraftCheckpoint,
    to: str,
    dtype: str | None,
    *,
    sglang_version: str | None = None,
    target: TargetRef | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors in format `to`, files beside them) from the eyas form, checked against `to`'s exact key set;
    for the SGLang formats, `sglang_version` is the oldest server the export must run on (default: the oldest
    the format is for), which decides the draft options it may carry; the target's architectures decide the
    numbering of the layer ids (eyas.export.keys.format_convention), its path speculators' verifier entry."""
    fmt = get_format(to)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    where = f"checkpoint {ckpt.path}"
    try:
        unserved = option_problems(ckpt.arch.options(), to, sglang_version)
    except ValueError as err:
        raise ExportError(f"{where}: {err}") from err
    problems = [f"the draft's options cannot be served by format {to}: " + "; ".join(unserved)] if unserved else []
    problems += [
        problem
        for problem in (
            num_aux_problem(ckpt.arch.num_aux, to, sglang_version),
            num_layers_problem(ckpt.arch.num_layers, to),
        )
        if problem
    ]
    if problems:
        raise ExportError(f"{where}: " + "; ".join(problems))
    check_vocab_mapping(ckpt.state["d2t"], ckpt.state["t2d"], where, ckpt.arch.draft_vocab_size)
    key_map = fmt.key_map_for(ckpt.arch)
    needed = set(invert_key_map(key_map).values())
    if "embed_tokens.weight" in needed and "embed_tokens.weight" not in ckpt.state:
        raise ExportError(
            f"{where}: no embed_tokens.weight, expected one for format {to!r} (it stores the embedding); the source "
            "format dropped it: pass embed_from (eyas remap --embed-from TARGET_WEIGHTS.safetensors)"
        )
    names = remap_keys(ckpt.state, key_map, where=f"{where} (eyas -> {to})")
    tensors = {dst: _cast(ckpt.state[src], dtype) for src, dst in names.items()}
    check_keys(_shapes(tensors), expected_shapes(to, ckpt.arch), where=f"{to} export of {ckpt.path}", fmt=to)
    stored = dtype or _float_dtype(tensors)
    convention = format_convention(to, list(target.architectures) if target else None)
    try:
        config = write_config(to, ckpt.arch, ckpt.aux_layer_ids, stored, convention, target) if to != "eyas" else None
    except ValueError as err:
        raise ExportError(f"{where}: {err}") from err
    provenance = {
        "format": to,
        "eyas_version": EYAS_VERSION,
        "sglang_version": sglang_version or SGLANG_FORMAT_SINCE.get(to),
        "source_checkpoint": str(ckpt.path.resolve()),
        "target_fingerprint": ckpt.target_fingerprint,
        "aux_layer_ids": ckpt.aux_layer_ids,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "config_layer_id_convention": convention,
    }
    if to == "eyas":
        meta = arch_record(ckpt.arch, ckpt.aux_layer_ids, ckpt.target_fingerprint)
        return tensors, {ARCH_FILE: meta, PROVENANCE_FILE: provenance, COMPLETE_MARKER: None}
    return tensors, {CONFIG_FILE: config, PROVENANCE_FILE: provenance}


def export_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    to: str,
    dtype: str = "float32",
    target: TargetRef | None = None,
    sglang_version: str | None = None,
) -> Path:
    """Convert a training checkpoint to format `to` in out_dir (replaced atomically); returns out_dir.
    `sglang_version`: the oldest SGLang server it must run on (convert_checkpoint)."""
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype {dtype!r}: expected one of {list(EXPORT_DTYPES)}")
    ckpt = read_checkpoint(checkpoint_dir)
    tensors, files = convert_checkpoint(ckpt, to, dtype, target=target, sglang_version=sglang_version)
    return write_export_dir(Path(out_dir), tensors, files)


def export_sglang(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    target: TargetRef | None = None,
    sglang_version: str | None = None,
) -> Path:
    """Convert a training checkpoint to SGLang's format (`midlayer.*`, loaded by every SGLang version; the
    draft's options by those from `sglang_version`, eyas.export.serving)."""
    return export_checkpoint(
        checkpoint_dir, out_dir, to="sglang", dtype=dtype, target=target, sglang_version=sglang_version
    )


def _cast(t: torch.Tensor, dtype: str | None) -> torch.Tensor:
    return (t.to(_TORCH_DTYPES[dtype]) if dtype and t.is_floating_point() else t).contiguous()


def _float_dtype(tensors: dict[str, torch.Tensor]) -> str:
    names = {v: k for k, v in _TORCH_DTYPES.items()}
    found = sorted({names.get(t.dtype, str(t.dtype)) for t in tensors.values() if t.is_floating_point()})
    return found[0] if len(found) == 1 else "float32"


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def export_run(config: RunConfig) -> Path:
    """The stage entry: the training checkpoint export.checkpoint chooses (best: the one the BEST marker names,
    eyas.train.checkpoint.best_checkpoint; last: the newest complete one), its files checked against their
    checksums (a damaged one is set aside and the next is taken, loudly: eyas.train.checkpoint_fallback) ->
    RUN/export/sglang in export.format, checked against that format's exact key set."""
    e = config.export
    checkpoint = export_choice(config.paths.train_dir, e.checkpoint, log=print)
    if checkpoint is None:
        raise FileNotFoundError(
            f"export: no complete checkpoint under {config.paths.train_dir}/checkpoints; run the train stage first"
        )
    target = TargetRef.read(config.target.model_path)
    out = export_checkpoint(
        checkpoint,
        config.paths.export_dir / SGLANG_EXPORT,
        to=e.format,
        dtype=e.dtype,
        target=target,
        sglang_version=e.sglang_version or None,
    )
    print(f"exported {checkpoint.name} (export.checkpoint={e.checkpoint}) -> {out}")
    return out
