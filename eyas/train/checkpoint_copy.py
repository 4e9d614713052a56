"""Copies of complete training checkpoints in a second place (S3, or a directory elsewhere), and restore.

    store = open_copy_store(job.train)                   # None when train.checkpoint_copy_url is empty
    copy_checkpoint(store, checkpoint_dir)               # rank 0, once the local checkpoint is complete
    rotate_copies(store, keep_last=2)
    restore_latest(store, output_dir)                    # a fresh machine: the newest complete copy -> local

Layout under the copy URL (step names at the top, so that a non-recursive list finds every copy):

  step-00000400/NAME            every file of the local step dir, its COMPLETE marker included
  step-00000400.pending         written before the first file; deleted once the copy is complete or deleted
  step-00000400.complete.json   the manifest {"step", "files": {NAME: {"checksum", "bytes"}}}, written LAST

A copy is complete exactly when its manifest exists: a copy cut off at any instant is never taken for
complete. A `.pending` record without a manifest marks the files of an interrupted copy (or deletion);
the next rotation deletes them. Deletion takes the manifest away first. Only a checkpoint whose files match its
completion record (eyas.train.checkpoint_verify) is copied. A restore checks every file against the manifest's
checksum while it downloads into a temporary dir, and against the completion record the copy carries, then commits
it like a local save (fsync, rename, COMPLETE last). A damaged copy is not restored: the restore falls back to the
newest older copy that verifies, and the log names the damaged file and the copy taken instead. One run writes to
a copy URL at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from eyas.checksum import checksum_bytes, short
from eyas.config import TrainConfig
from eyas.fsio import temp_path
from eyas.storage import open_storage
from eyas.storage.base import ChecksumMismatchError, Storage
from eyas.train.checkpoint import CHECKPOINTS_DIR, commit_step_dir, list_checkpoints, step_dir_name
from eyas.train.checkpoint_fallback import AllCheckpointsDamagedError, resume_checkpoint
from eyas.train.checkpoint_verify import (
    COMPLETE_MARKER,
    CheckpointDamagedError,
    CheckpointError,
    parse_completion_record,
    read_completion_record,
    require_complete,
    verify_files,
)

Log = Callable[[str], None]

MANIFEST_SUFFIX = ".complete.json"
PENDING_SUFFIX = ".pending"
_MANIFEST = re.compile(r"^step-(\d{8})\.complete\.json$")
_PENDING = re.compile(r"^step-(\d{8})\.pending$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def open_copy_store(train: TrainConfig) -> Storage | None:
    """The storage of `train.checkpoint_copy_url`, or None when copies are off."""
    if not train.checkpoint_copy_url:
        return None
    return open_storage(train.checkpoint_copy_url, endpoint_url=train.s3_endpoint_url)


def copy_steps(store: Storage) -> list[int]:
    """Steps of the complete copies, ascending."""
    return sorted(int(m.group(1)) for name in store.list() if (m := _MANIFEST.match(name)))


def copy_checkpoint(store: Storage, checkpoint_dir: str | Path) -> dict:
    """Upload a complete local checkpoint, each file checked against its completion record as it is read (a
    damaged checkpoint is refused, not copied), its manifest last; returns the manifest."""
    checkpoint_dir = Path(checkpoint_dir)
    require_complete(checkpoint_dir)
    record = read_completion_record(checkpoint_dir)
    listed = record["files"] if record is not None else {}
    name = checkpoint_dir.name
    store.put_bytes(name + PENDING_SUFFIX, b"")
    files = {}
    for path in sorted(checkpoint_dir.iterdir()):
        data = path.read_bytes()
        if path.name in listed and checksum_bytes(data) != listed[path.name]["checksum"]:
            raise CheckpointDamagedError(
                checkpoint_dir,
                path.name,
                f"has checksum {short(checksum_bytes(data))}, its {COMPLETE_MARKER} record says "
                f"{short(listed[path.name]['checksum'])}; not copied to {store.url}",
            )
        files[path.name] = {"checksum": store.put_bytes(f"{name}/{path.name}", data), "bytes": len(data)}
    manifest = {"step": int(name.removeprefix("step-")), "files": files}
    store.put_bytes(name + MANIFEST_SUFFIX, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    store.delete(name + PENDING_SUFFIX)
    return manifest


def _delete_files(store: Storage, name: str) -> None:
    for key in store.list(f"{name}/"):
        store.delete(key)


def delete_copy(store: Storage, step: int) -> None:
    """Delete one copy: mark it pending, take its manifest away, then its files, then the mark."""
    name = step_dir_name(step)
    store.put_bytes(name + PENDING_SUFFIX, b"")
    store.delete(name + MANIFEST_SUFFIX)
    _delete_files(store, name)
    store.delete(name + PENDING_SUFFIX)


def rotate_copies(store: Storage, keep_last: int) -> list[int]:
    """Keep the newest `keep_last` complete copies; delete older ones and what interrupted copies left.
    Returns the steps of the complete copies deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: expected at least 1 (the newest copy is never deleted)")
    names = store.list()
    complete = copy_steps(store)
    for step in sorted(int(m.group(1)) for name in names if (m := _PENDING.match(name))):
        name = step_dir_name(step)
        if step not in complete:  # an interrupted copy or deletion: its files are garbage
            _delete_files(store, name)
        store.delete(name + PENDING_SUFFIX)
    doomed = complete[:-keep_last]
    for step in doomed:
        delete_copy(store, step)
    return doomed


def _read_manifest(store: Storage, name: str) -> dict:
    source = f"{store.url}/{name}{MANIFEST_SUFFIX}"
    try:
        manifest = json.loads(store.get_bytes(name + MANIFEST_SUFFIX))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"checkpoint copy {source}: not the JSON manifest eyas writes ({err})") from err
    files = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    unsafe = sorted(f for f in files if not _FILE_NAME.match(f))
    if unsafe or COMPLETE_MARKER not in files:
        raise CheckpointError(
            f"checkpoint copy {source}: files {sorted(files)}; expected plain file names including "
            f"{COMPLETE_MARKER} (unsafe: {unsafe}); the manifest was not written by eyas.train.checkpoint_copy"
        )
    listed = store.list(f"{name}/")
    missing = sorted(f for f in files if f"{name}/{f}" not in listed)
    if missing:
        raise CheckpointError(
            f"checkpoint copy {store.url}/{name}: files {missing} of its manifest are missing; the copy was "
            "damaged after it was completed"
        )
    return manifest


def _download(store: Storage, name: str, file: str, checksum: str, output_dir: Path) -> bytes:
    try:
        return store.get_bytes(f"{name}/{file}", checksum=checksum)
    except ChecksumMismatchError as e:
        raise CheckpointError(
            f"checkpoint copy {store.url}/{name}/{file}: its bytes do not match the checksum {checksum} "
            f"recorded when it was copied; the copy is corrupt and was not restored ({output_dir} is unchanged)"
        ) from e


def _check_against_record(store: Storage, name: str, temp: Path, marker: str) -> None:
    """The downloaded files against the completion record the copy carries (a copy of a checkpoint from before
    checksums carries none: the manifest's checksums were checked)."""
    try:
        record = parse_completion_record(marker, temp)
        if record is not None:
            verify_files(temp, record, record["files"])
    except CheckpointDamagedError as err:
        raise CheckpointError(
            f"checkpoint copy {store.url}/{name}: {err.file} {err.problem}; the checkpoint was damaged before it "
            "was copied, and the copy was not restored"
        ) from err


def restore_copy(store: Storage, step: int, output_dir: str | Path) -> Path:
    """Download the complete copy of `step` into `output_dir/checkpoints/`, every file checked against its
    manifest, committed like a local save (COMPLETE last); returns the local step dir."""
    output_dir, name = Path(output_dir), step_dir_name(step)
    manifest = _read_manifest(store, name)
    root = output_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    temp = temp_path(root / name)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        for file, entry in sorted(manifest["files"].items()):
            data = _download(store, name, file, entry["checksum"], output_dir)
            if file == COMPLETE_MARKER:
                marker = data.decode()
            else:
                (temp / file).write_bytes(data)
        _check_against_record(store, name, temp, marker)
        commit_step_dir(temp, root / name, marker)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return root / name


def restore_latest(store: Storage, output_dir: str | Path, *, log: Log = print) -> Path | None:
    """Restore the newest complete copy that verifies when it is newer than the newest local checkpoint that
    verifies (a fresh machine, a lost disk, a damaged local checkpoint: that one is set aside first); returns the
    restored dir, or None when the local checkpoints are as new. A damaged copy is skipped for the next older one,
    and `log` names both."""
    try:
        local, all_damaged = resume_checkpoint(output_dir, log=log), None
    except AllCheckpointsDamagedError as err:  # every local one set aside: a copy may still serve
        local, all_damaged = None, err
    local_step = int(local.name.removeprefix("step-")) if local is not None else -1
    damaged: list[str] = []
    for step in reversed([s for s in copy_steps(store) if s > local_step]):
        try:
            restored = restore_copy(store, step, output_dir)
        except CheckpointError as err:  # the copy's content, never a storage error: those propagate
            damaged.append(str(err))
            continue
        for problem in damaged:
            log(f"{problem}; restoring {restored.name} from {store.url} instead, the newest older copy that verifies")
        return restored
    for problem in damaged:
        fallback = f"resuming from the local {local.name}" if local is not None else "no older copy verifies"
        log(f"{problem}; {fallback}")
    if all_damaged is not None:
        raise all_damaged
    if damaged and local is None and not list_checkpoints(output_dir):
        raise CheckpointError(
            f"checkpoint copy {store.url}: every copy is damaged and {Path(output_dir) / CHECKPOINTS_DIR} holds no "
            "checkpoint; delete the damaged copies' manifests (NAME.complete.json) to start from step 0"
        )
    return None


def sync_at_start(store: Storage, output_dir: str | Path, keep_last: int, *, log: Log = print) -> str | None:
    """Bring the local checkpoints and the copy in line before training (rank 0): restore the copy's newest
    that verifies when it is newer, else copy the local newest when the copy lacks it (a run that stopped before
    copying). Returns what was done, for the log; `log` names every damaged checkpoint or copy met."""
    restored = restore_latest(store, output_dir, log=log)
    if restored is not None:
        return f"restored {restored.name} from the checkpoint copy {store.url}"
    local = [(step, path) for step, path, complete in list_checkpoints(output_dir) if complete]
    if local and local[-1][0] not in copy_steps(store):
        copy_checkpoint(store, local[-1][1])
        rotate_copies(store, keep_last)
        return f"copied {local[-1][1].name} to {store.url} (it was not copied before the last run stopped)"
    return None
