"""Checksums of a training checkpoint's files, recorded in its COMPLETE marker and checked before anything of it is
loaded (resume, export, the checkpoint copy's restore), as a shard is checked against its manifest row.

    write_marker(step_dir, completion_record(temp_dir, step))   # eyas.train.checkpoint.commit_step_dir: last
    verify_checkpoint(step_dir, RESUME_FILES)          # True, or False for a checkpoint from before checksums;
                                                       # CheckpointDamagedError names the file that differs
    set_aside(step_dir, reason)                        # step-00000600 -> step-00000600.damaged, DAMAGED.json inside

COMPLETE holds the completion record {"step": 600, "files": {NAME: {"checksum": "xxh3-128:...", "bytes": N}}}
(eyas.checksum, the shards' checksum), written atomically once every file and the directory are fsynced: it is
whole or absent, and a checkpoint without it is never loaded. A marker written before checkpoints carried checksums
holds the bare step (or nothing): such a checkpoint is loaded unverified, and `verify_checkpoint` returns False so
that the loader says so. A damaged checkpoint is set aside under a name that is no step dir (`step-N.damaged`,
`-2`, ... when taken), kept for inspection with the reason in DAMAGED.json; nothing lists, loads or rotates it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from eyas.checksum import checksum_file, short
from eyas.fsio import atomic_write_text, fsync_path

COMPLETE_MARKER = "COMPLETE"
MODEL_FILE = "model.safetensors"
ARCH_FILE = "arch.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
TRAINER_STATE_FILE = "trainer_state.json"
RESUME_FILES = (MODEL_FILE, ARCH_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE, TRAINER_STATE_FILE)
DAMAGED_SUFFIX = ".damaged"
DAMAGED_RECORD = "DAMAGED.json"
_SET_ASIDE = re.compile(r"^step-\d{8}\.damaged(-\d+)?$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match what is being loaded into."""


class CheckpointDamagedError(CheckpointError):
    """A complete checkpoint's file differs from its completion record (or the record itself is unreadable)."""

    def __init__(self, checkpoint_dir: Path, file: str, problem: str):
        self.checkpoint_dir, self.file, self.problem = Path(checkpoint_dir), file, problem
        super().__init__(
            f"checkpoint {checkpoint_dir}: {file} {problem}; the file changed after the checkpoint was completed "
            "(a disk fault, a partial copy, an edit): its state is not loaded"
        )


def completion_record(step_dir: Path, step: int) -> dict:
    """{"step", "files": {NAME: {"checksum", "bytes"}}} of every file in `step_dir` (COMPLETE aside)."""
    files = {
        path.name: {"checksum": checksum_file(path), "bytes": path.stat().st_size}
        for path in sorted(Path(step_dir).iterdir())
        if path.is_file() and path.name != COMPLETE_MARKER
    }
    return {"step": step, "files": files}


def write_marker(step_dir: Path, record: dict | str) -> None:
    """COMPLETE, atomically (whole or absent), then the directory fsynced: the checkpoint is complete from here."""
    text = record if isinstance(record, str) else json.dumps(record, indent=2, sort_keys=True) + "\n"
    atomic_write_text(step_dir / COMPLETE_MARKER, text)
    fsync_path(step_dir)


def read_completion_record(checkpoint_dir: Path) -> dict | None:
    """The completion record of a complete checkpoint; None for a marker from before checksums (a bare step)."""
    checkpoint_dir = Path(checkpoint_dir)
    return parse_completion_record((checkpoint_dir / COMPLETE_MARKER).read_text(errors="replace"), checkpoint_dir)


def parse_completion_record(text: str, checkpoint_dir: Path) -> dict | None:
    """The completion record in a COMPLETE marker's `text` (None for a bare step), its form checked."""
    text = text.strip()
    if text == "" or text.isdigit():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointDamagedError(
            checkpoint_dir, COMPLETE_MARKER, f"is not the JSON record eyas writes ({err})"
        ) from err
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("checksum"), str) and isinstance(e.get("bytes"), int)
        for e in files.values()
    ):
        raise CheckpointDamagedError(
            checkpoint_dir, COMPLETE_MARKER, 'lacks "files" with a "checksum" and "bytes" per file'
        )
    return record


def verify_files(checkpoint_dir: Path, record: dict, files: Iterable[str]) -> None:
    """Each of `files` in `checkpoint_dir` has the size and checksum `record` holds for it, else
    CheckpointDamagedError naming the first that differs (files in name order)."""
    listed = record["files"]
    for name in sorted(files):
        path = Path(checkpoint_dir) / name
        if name not in listed:
            raise CheckpointDamagedError(checkpoint_dir, name, f"is not in its {COMPLETE_MARKER} record")
        expected = listed[name]
        if not path.is_file():
            raise CheckpointDamagedError(checkpoint_dir, name, f"is missing ({COMPLETE_MARKER} records it)")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointDamagedError(
                checkpoint_dir, name, f"has {size} bytes, its {COMPLETE_MARKER} record says {expected['bytes']}"
            )
        found = checksum_file(path)
        if found != expected["checksum"]:
            raise CheckpointDamagedError(
                checkpoint_dir,
                name,
                f"has checksum {short(found)}, its {COMPLETE_MARKER} record says {short(expected['checksum'])}",
            )


def verify_checkpoint(checkpoint_dir: str | Path, files: Iterable[str] = RESUME_FILES) -> bool:
    """Check `files` of a complete checkpoint against its completion record: True when they match; False when the
    checkpoint predates checksums (nothing to check them against); CheckpointDamagedError otherwise."""
    checkpoint_dir = Path(checkpoint_dir)
    record = read_completion_record(checkpoint_dir)
    if record is None:
        return False
    verify_files(checkpoint_dir, record, files)
    return True


def require_complete(checkpoint_dir: Path) -> None:
    if not (checkpoint_dir / COMPLETE_MARKER).is_file():
        raise CheckpointError(
            f"checkpoint {checkpoint_dir}: no {COMPLETE_MARKER} marker; it was not written completely "
            f"(crash during save) or it is not a training checkpoint; use latest_complete(output_dir) to pick a "
            "complete one"
        )


def require_verified(checkpoint_dir: Path, files: Iterable[str], log: Callable[[str], None] = print) -> None:
    """A complete checkpoint whose `files` match its completion record (CheckpointDamagedError names the first
    that does not); one from before checksums is let through, and `log` says it is unverified."""
    require_complete(checkpoint_dir)
    if not verify_checkpoint(checkpoint_dir, files):
        log(unverified_note(checkpoint_dir))


def unverified_note(checkpoint_dir: Path) -> str:
    """What a loader says of a checkpoint whose marker predates checksums."""
    return (
        f"checkpoint {checkpoint_dir}: its {COMPLETE_MARKER} marker holds no checksums (written before eyas "
        "checkpoints carried them); its files are loaded unverified"
    )


def set_aside(checkpoint_dir: Path, reason: str) -> Path:
    """Rename a damaged checkpoint to `NAME.damaged` (`-2`, ... when taken) beside DAMAGED.json holding `reason`;
    returns the new path. Nothing lists, loads or rotates it; delete it once inspected."""
    checkpoint_dir = Path(checkpoint_dir)
    dst, k = checkpoint_dir.with_name(checkpoint_dir.name + DAMAGED_SUFFIX), 2
    while dst.exists():
        dst, k = checkpoint_dir.with_name(f"{checkpoint_dir.name}{DAMAGED_SUFFIX}-{k}"), k + 1
    checkpoint_dir.rename(dst)
    fsync_path(dst.parent)
    note = {"checkpoint": checkpoint_dir.name, "reason": reason, "set_aside_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    atomic_write_text(dst / DAMAGED_RECORD, json.dumps(note, indent=2, sort_keys=True) + "\n")
    return dst


def read_set_aside(checkpoints_root: Path) -> list[dict]:
    """The DAMAGED.json records of the checkpoints set aside under `checkpoints_root` (+ "path"), by name."""
    root = Path(checkpoints_root)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(p for p in root.iterdir() if _SET_ASIDE.match(p.name) and p.is_dir()):
        note = path / DAMAGED_RECORD
        unrecorded = {"checkpoint": path.name.split(".")[0], "reason": "not recorded (stopped while setting it aside)"}
        record = json.loads(note.read_text()) if note.is_file() else unrecorded
        found.append({**record, "path": str(path)})
    return found
