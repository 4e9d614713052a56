"""An exported drafter directory, as eyas writes it and as every reader finds it (no torch here).

    DIR/model.safetensors     the tensors, in the format's key names (eyas.export.keys); a drafter written
                              elsewhere may hold pytorch_model.bin instead (EAGLE official), read too
    DIR/config.json           the format's config (eyas.export.configs); arch.json + COMPLETE for the eyas format
    DIR/eyas_export.json      provenance: format, source checkpoint, target fingerprint, canonical layer ids,
                              and the numbering config.json's ids were written in (config_layer_id_convention)

An export is written to a temporary directory and put in place whole (`write_export_dir`), so a crash
never leaves a half-written export, and a directory that is not an earlier export is never replaced. The
temporaries a killed export left beside it (`.NAME.tmp-PID`, `.NAME.old.tmp-PID`) are removed by the next
export to the same place (`remove_partial_exports`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from eyas.export.bin_weights import bin_tensor_shapes, bin_tensor_values
from eyas.fsio import TMP_MARKER, checked_safetensors_header, read_json_record, replace_dir, temp_path

MODEL_FILE = "model.safetensors"
BIN_FILE = "pytorch_model.bin"  # read, never written
CONFIG_FILE = "config.json"
PROVENANCE_FILE = "eyas_export.json"
NUMBERING_KEY = "config_layer_id_convention"  # in PROVENANCE_FILE: the numbering of config.json's layer ids


class ExportError(ValueError):
    """A checkpoint or an export that cannot be converted or loaded as it is."""


def weights_file(root: Path) -> Path:
    """The weights of a drafter directory: model.safetensors, else pytorch_model.bin."""
    for name in (MODEL_FILE, BIN_FILE):
        if (Path(root) / name).is_file():
            return Path(root) / name
    raise ExportError(
        f"{root}: neither {MODEL_FILE} nor {BIN_FILE}; expected an eyas checkpoint or an exported drafter"
    )


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a weights file, from its header (safetensors' own reader, numpy) or its pickle
    (eyas.export.bin_weights): no torch."""
    if Path(path).name == BIN_FILE:
        return bin_tensor_shapes(path)
    header = checked_safetensors_header(path)  # a foreign file is refused before anything is allocated
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def read_small_tensor(path: Path, name: str) -> list:
    """The values of one small tensor (d2t, t2d) as a list; no other tensor is read."""
    if Path(path).name == BIN_FILE:
        return bin_tensor_values(path, name).tolist()
    checked_safetensors_header(path)
    with safe_open(str(path), framework="numpy") as f:
        return f.get_tensor(name).tolist()


def write_export_dir(out: Path, tensors: dict, files: dict[str, dict | None]) -> Path:
    """model.safetensors and JSON files (None: an empty marker, written last) in out, replaced atomically
    (eyas.fsio.replace_dir); a directory that is not an earlier export is never replaced."""
    if out.exists() and any(out.iterdir()) and not (out / PROVENANCE_FILE).is_file():
        raise ExportError(
            f"export directory {out}: exists, is not empty and holds no {PROVENANCE_FILE}; expected an empty "
            "directory or an earlier eyas export; refusing to replace it: pick another directory"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_partial_exports(out)
    tmp = temp_path(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    from safetensors.torch import save_file  # the one use of torch here: the writer's tensors are torch tensors

    save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
    for name, data in sorted(files.items(), key=lambda item: item[1] is None):
        (tmp / name).write_text("" if data is None else json.dumps(data, indent=2, sort_keys=True) + "\n")
    replace_dir(tmp, out)
    return out


def remove_partial_exports(out: Path) -> list[Path]:
    """Remove the temporaries of exports to `out` whose process is gone (a kill inside an export leaves its
    partial drafter beside `out`; one of a live export is left to it), each reported. Returns the removed."""
    removed = []
    for prefix in (f".{out.name}{TMP_MARKER}", f".{out.name}.old{TMP_MARKER}"):
        for path in sorted(out.parent.glob(f"{prefix}*")):
            pid = path.name[len(prefix) :]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            print(f"export {out}: removed {path.name}, a partial export left by process {pid}, which is gone")
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process's own leftover (the pid of a dead one, reused): nothing writes it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def read_export_provenance(export_dir: str | Path) -> dict | None:
    """eyas_export.json of an eyas export, or None for a drafter written elsewhere."""
    return read_json_record(Path(export_dir) / PROVENANCE_FILE)


def recorded_numbering(provenance: dict | None, fmt: str) -> str | None:
    """The layer-id numbering (eyas.layer_ids.LAYER_ID_CONVENTIONS) eyas's export wrote config.json's ids in, as
    eyas_export.json records it (SGLang's depends on the target's class, which the drafter does not name); None
    when the drafter records none (written elsewhere, or by an eyas that did not record it) or its provenance is
    of another format (edited after the export)."""
    from eyas.layer_ids import LAYER_ID_CONVENTIONS

    if not provenance or provenance.get("format") != fmt or NUMBERING_KEY not in provenance:
        return None
    numbering = provenance[NUMBERING_KEY]
    if numbering not in LAYER_ID_CONVENTIONS:
        raise ExportError(
            f"{PROVENANCE_FILE}: {NUMBERING_KEY} {numbering!r}, expected one of {sorted(LAYER_ID_CONVENTIONS)}; "
            "the file was edited or written by another tool: re-export the drafter (eyas remap)"
        )
    return numbering


@dataclass
class ExportState:
    """What an export directory holds now (for eyas status)."""

    complete: bool  # config.json and model.safetensors are there
    provenance: dict  # eyas_export.json ({} for a drafter written elsewhere)


def export_state(export_dir: str | Path) -> ExportState:
    """Whether an export directory is complete, and its provenance."""
    root = Path(export_dir)
    complete = (root / CONFIG_FILE).is_file() and (root / MODEL_FILE).is_file()
    return ExportState(complete=complete, provenance=(read_export_provenance(root) or {}) if complete else {})
