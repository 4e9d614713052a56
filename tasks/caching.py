"""Caching of finished work across runs: keys from the config and the content of the task's inputs.

A task decorated with `**cached_by(sections, inputs)` is skipped (state Cached, its result read
back) when a task of the same name and source already ran for the same workdir, with the same
config sections, the same content of the durable inputs it reads and the same other arguments.
The key never contains the flow run id, so a run resumed after the approval gate (the worker
re-runs it from the top), a run retried after a crash, and a new run of the same deployment all
find the work done.

Results are persisted to Prefect's default result storage, `PREFECT_RESULTS_LOCAL_STORAGE_PATH`
(default `$PREFECT_HOME/storage`); `eyas worker` points it at durable storage beside
the server's database. An entry belongs to one workdir: the key holds the workdir's path and a
random id written into it once (`.eyas-workdir-id`), so a deleted or recreated workdir never hits
entries that describe outputs which are gone.

Tasks that are the resume logic themselves (plan the missing shards, relaunch the trainer), live
checks (device preflight) and measurements (benchmark) are not cached: `NO_CACHE` says so where
they are declared.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects

from eyas.checksum import checksum_bytes, checksum_file
from eyas.config import RunConfig
from eyas.dataset.build import dataset_cache_key
from eyas.facts import shard_source
from eyas.shards.manifest import MANIFEST_NAME, ROWS_DIR
from eyas.shards.shard_set import LOCK_NAME, RUN_META_NAME
from eyas.storage import Storage

WORKDIR_ID = ".eyas-workdir-id"


def file_content(path: Path) -> str:
    return checksum_file(path) if path.is_file() else "absent"


def workdir_id(root: Path) -> str:
    """The workdir's random id, created on first use (O_EXCL: concurrent first uses agree)."""
    path = Path(root) / WORKDIR_ID
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(uuid.uuid4().hex)
                f.flush()
                os.fsync(f.fileno())
    return path.read_text().strip()


def manifest_content(store: Storage) -> str:
    """The manifest's content hash (local), or on S3 its objects' versions (ETag and LastModified change with
    every write): the manifest lists every shard with its checksum, so it stands for the shards' bytes."""
    root = store.local_path()
    if root is not None:
        return file_content(root / MANIFEST_NAME)
    found = {n: v for n, v in store.versions().items() if n == MANIFEST_NAME} | store.versions(ROWS_DIR + "/")
    return checksum_bytes(json.dumps(found, sort_keys=True).encode()) if found else "absent"


def shard_files(shards: Path | Storage, *, full: bool = False) -> str:
    """Evidence that every file of the shard set is the one a cached result saw: for each file in the shard
    directory (shards and strays alike), its name, size, mtime and ctime (ctime cannot be set back by hand:
    any write or touch moves it) and the XXH3 of its first MiB (the safetensors header and the first data);
    with `full` (verify.mode = "full"), the XXH3-128 of the whole file as well, so that bytes changed without
    the file system knowing (bit rot, a device written under it) are verified again. A damaged, truncated,
    deleted, swapped or added file changes it, so the task runs again. The set's own bookkeeping is left out:
    the manifest (an input of its own), extract.json and the coordinator's lock file, which every extraction
    run opens again. On S3 every object's size, ETag and LastModified stand for it: any write changes them,
    and the store checks its own bytes (reading terabytes back to key a cache would cost what verifying does)."""
    bookkeeping = {MANIFEST_NAME, LOCK_NAME, RUN_META_NAME}
    if not isinstance(shards, Path) and shards.local_path() is None:
        found = {n: v for n, v in shards.versions().items() if n not in bookkeeping}
        return checksum_bytes(json.dumps(found, sort_keys=True).encode()) if found else "absent"
    shards_dir = Path(shards) if isinstance(shards, Path) else shards.local_path()
    if not shards_dir.is_dir():
        return "absent"
    parts = []
    for path in sorted(p for p in shards_dir.iterdir() if p.is_file() and p.name not in bookkeeping):
        st = path.stat()
        with open(path, "rb") as f:
            head = checksum_bytes(f.read(1 << 20))
        whole = f":{checksum_file(path)}" if full else ""
        parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{head}{whole}")
    return checksum_bytes("\n".join(parts).encode())


# The durable inputs a task may read, each by a content hash (cheap: small files or headers).
INPUT_HASHES: dict[str, Callable[[RunConfig], str]] = {
    # prompts file bytes + dataset config + target fingerprint: the dataset's own cache key
    "prompts": lambda c: dataset_cache_key(c.dataset, c.target.model_path),
    "tokenized": lambda c: file_content(c.paths.tokenized),
    "vocab": lambda c: file_content(c.paths.vocab),
    # the manifest of the shards the later stages read (eyas.facts.shard_source): it stands for their bytes
    "manifest": lambda c: manifest_content(shard_source(c)),
    # the shard files themselves: a result is reused only for the very files it saw (shard_files)
    "shard_files": lambda c: shard_files(shard_source(c), full=c.verify.mode == "full"),
}


@dataclass
class ConfigAndInputs(CachePolicy):
    """Key = task name + workdir (path and id) + the named `config` sections + content hashes of the named
    inputs + the task's other arguments. Never the run id."""

    sections: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = sorted(set(self.inputs) - set(INPUT_HASHES))
        if unknown:
            raise ValueError(f"cache inputs {unknown} are unknown; expected some of {sorted(INPUT_HASHES)}")

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs):
        config: RunConfig = inputs["config"]
        root = config.paths.root.resolve()
        return hash_objects(
            task_ctx.task.name,
            str(root),
            workdir_id(root),
            config.fingerprint(*self.sections),
            {name: INPUT_HASHES[name](config) for name in self.inputs},
            {name: value for name, value in inputs.items() if name != "config"},
            raise_on_failure=True,
        )


def cached_by(sections: tuple[str, ...], inputs: tuple[str, ...] = ()) -> dict:
    """Task decorator arguments: cache by config sections + input hashes + the task's source; persist results."""
    return {"cache_policy": ConfigAndInputs(sections=sections, inputs=inputs) + TASK_SOURCE, "persist_result": True}
