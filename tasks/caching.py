"""Caching of finished work across runs: keys from the config, the content of the task's inputs and the
evidence of its outputs.

A task decorated with `**cached_by(sections, inputs, outputs)` is skipped (state Cached, its result read
back) when a task of the same name and source already ran for the same workdir, with the same
config sections, the same content of the durable inputs it reads and the same other arguments, AND its
outputs are still the files that run wrote. The key never contains the flow run id, so a run resumed after
the approval gate (the worker re-runs it from the top), a run retried after a crash, and a new run of the
same deployment all find the work done.

Outputs: a key is computed before the task runs, so a run that writes outputs records their evidence
beside them once its result is stored (`.eyas-cache/<task>.json`: the inputs' key, the key its result
is stored under, each output's evidence). The next key is the recorded one only while the inputs' key and
every output's evidence still match the record; an output deleted, damaged or written by something else
gives a key no result is stored under, so the stage runs again and rebuilds it. A task whose library code
reuses its own outputs (the dataset stage) calls `discard_changed_outputs` first, so that the rebuild
starts from nothing instead of reading the damaged file.

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
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from prefect.cache_policies import TASK_SOURCE, CachePolicy
from prefect.context import TaskRunContext
from prefect.utilities.hashing import hash_objects

from eyas.checksum import checksum_bytes, checksum_file
from eyas.config import RunConfig
from eyas.dataset.build import REPORT_FILE, RESPONSES_FILE, dataset_cache_key
from eyas.facts import shard_source
from eyas.fsio import atomic_write_text
from eyas.shards.manifest import MANIFEST_NAME, ROWS_DIR
from eyas.shards.shard_set import LOCK_NAME, RUN_META_NAME
from eyas.storage import Storage

WORKDIR_ID = ".eyas-workdir-id"
RECORDS_DIR = ".eyas-cache"  # in the workdir: what each cached task's last run wrote (OutputRecord)


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
    parts = [
        f"{path.name}:{file_evidence(path, full=full)}"
        for path in sorted(p for p in shards_dir.iterdir() if p.is_file() and p.name not in bookkeeping)
    ]
    return checksum_bytes("\n".join(parts).encode())


def file_evidence(path: Path, *, full: bool) -> str:
    """One file's size, mtime and ctime (ctime cannot be set back by hand: any write or touch moves it) and the
    XXH3 of its first MiB; with `full`, the XXH3-128 of the whole file as well."""
    st = path.stat()
    with open(path, "rb") as f:
        head = checksum_bytes(f.read(1 << 20))
    whole = f":{checksum_file(path)}" if full else ""
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{head}{whole}"


def output_evidence(path: Path) -> str:
    """Evidence of one output: a file's whole checksum (the outputs named so are small next to what they cost
    to build: tables, mappings, reports); a directory's file_evidence of every file under it, by relative path
    (a smoke run's checkpoint is gigabytes at the real shape); "absent" when there is nothing."""
    if path.is_file():
        return checksum_file(path)
    if not path.is_dir():
        return "absent"
    files = sorted(p for p in path.rglob("*") if p.is_file())
    parts = [f"{p.relative_to(path)}:{file_evidence(p, full=False)}" for p in files]
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


# The durable outputs a task writes, as paths in the run's workdir: each group is written as a whole by its task.
OUTPUT_PATHS: dict[str, Callable[[RunConfig], list[Path]]] = {
    # the table, its report (read back when the table is reused) and the responses for people to read
    "tokenized": lambda c: [c.paths.tokenized, c.paths.dataset_dir / REPORT_FILE, c.paths.dataset_dir / RESPONSES_FILE],
    "vocab": lambda c: [c.paths.vocab],
    "verify_report": lambda c: [c.paths.verify_report],
    # the smoke checkpoint, smoke.json and a GPU smoke's job, config and log
    "smoke": lambda c: [c.paths.smoke_dir],
}


@dataclass
class Pending:
    """A key that missed, kept from its computation until its run completes (and records its outputs)."""

    task_name: str
    config: RunConfig
    base: str
    key: str  # this policy's key (the stored result's key also holds the task's source)
    outputs: tuple[str, ...]
    changed: list[str]  # outputs that differ from what the task's last run recorded (empty when it recorded none)


_PENDING: dict[Any, Pending] = {}  # by task run id


def _pending() -> Pending | None:
    ctx = TaskRunContext.get()
    return _PENDING.get(ctx.task_run.id) if ctx is not None else None


def record_path(config: RunConfig, task_name: str) -> Path:
    return config.paths.root / RECORDS_DIR / f"{task_name}.json"


def outputs_now(config: RunConfig, outputs: tuple[str, ...]) -> dict[str, str]:
    """{output path relative to the workdir: its evidence} of the named output groups."""
    root = config.paths.root
    return {str(p.relative_to(root)): output_evidence(p) for name in outputs for p in OUTPUT_PATHS[name](config)}


def read_output_record(path: Path) -> dict | None:
    """A task's output record, or None when there is none or it is not one (then the task runs again)."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        print(f"{path}: not an output record ({e}); the task runs again and writes it anew")
        return None
    return record if isinstance(record, dict) else None


@dataclass
class ConfigAndInputs(CachePolicy):
    """Key = task name + workdir (path and id) + the named `config` sections + content hashes of the named
    inputs + the task's other arguments (the base). Never the run id. With `outputs`: the key the task's last
    run recorded while the base and every output's evidence match that record, else a key never used before."""

    sections: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()

    def __post_init__(self):
        for kind, names, known in (("inputs", self.inputs, INPUT_HASHES), ("outputs", self.outputs, OUTPUT_PATHS)):
            unknown = sorted(set(names) - set(known))
            if unknown:
                raise ValueError(f"cache {kind} {unknown} are unknown; expected some of {sorted(known)}")

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs):
        config: RunConfig = inputs["config"]
        root = config.paths.root.resolve()
        base = hash_objects(
            task_ctx.task.name,
            str(root),
            workdir_id(root),
            config.fingerprint(*self.sections),
            {name: INPUT_HASHES[name](config) for name in self.inputs},
            {name: value for name, value in inputs.items() if name != "config"},
            raise_on_failure=True,
        )
        if not self.outputs:
            return base
        now = outputs_now(config, self.outputs)
        record = read_output_record(record_path(config, task_ctx.task.name))
        if record and record.get("base") == base and record.get("outputs") == now:
            return record["key"]
        # a key no result is stored under (Prefect computes it once per attempt): the run writes the outputs anew
        key = hash_objects(base, uuid.uuid4().hex, raise_on_failure=True)
        recorded = (record or {}).get("outputs", {})
        changed = sorted(p for p in recorded if recorded[p] != now.get(p, "absent"))
        _PENDING[task_ctx.task_run.id] = Pending(task_ctx.task.name, config, base, key, self.outputs, changed)
        return key


def record_outputs(task, task_run, state) -> None:
    """Completion hook of a task cached by its outputs: after its result is stored, record the evidence of what
    it wrote beside the key the result is stored under (a kill between the two only makes the next run miss).
    A result that came back from the cache has nothing pending: its record stands."""
    pending = _PENDING.pop(task_run.id, None)
    if pending is None:
        return
    record = {"base": pending.base, "key": pending.key, "outputs": outputs_now(pending.config, pending.outputs)}
    path = record_path(pending.config, pending.task_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def discard_changed_outputs() -> list[str]:
    """Called first by a task whose library reuses its own outputs: when any output differs from what the task's
    last run recorded (deleted, damaged, written by something else), every output of the task is removed, so
    that the stage rebuilds the set from nothing instead of reading a damaged file. Each removal is printed.
    Returns the outputs found changed."""
    pending = _pending()
    if pending is None or not pending.changed:
        return []
    name = pending.task_name
    print(f"{name}: {', '.join(pending.changed)} changed since this stage wrote them (deleted or damaged): rebuilding")
    for output in pending.outputs:
        for path in OUTPUT_PATHS[output](pending.config):
            if path.is_dir():
                shutil.rmtree(path)
                print(f"{name}: removed {path}")
            elif path.exists():
                path.unlink()
                print(f"{name}: removed {path}")
    return pending.changed


def cached_by(sections: tuple[str, ...], inputs: tuple[str, ...] = (), outputs: tuple[str, ...] = ()) -> dict:
    """Task decorator arguments: cache by config sections + input hashes + the task's source, and while the
    named outputs are what the task's last run wrote (recorded when it completes); persist results."""
    policy = ConfigAndInputs(sections=sections, inputs=inputs, outputs=outputs) + TASK_SOURCE
    return {"cache_policy": policy, "persist_result": True, "on_completion": [record_outputs] if outputs else []}
