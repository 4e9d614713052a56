"""The shard set as a whole: `extract.json` (the run's parameters), the coordinator's lock, the quarantine,
and whether the set is complete. The shard files are eyas.shards.format's, the rows eyas.shards.manifest's.

    shards/                      a local directory, or the same names under s3://bucket/prefix
      extract.json               ExtractRunMeta: every field must match for a run to resume into the set
      manifest.parquet, rows/    the manifest (eyas.shards.manifest)
      shard-00000.safetensors    the shards (eyas.shards.format)
      .extract.lock              held by the one coordinator of a local directory (flock)
      quarantine/                shards set aside by verification, each beside NAME.STAMP.reason.txt
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Mapping

from eyas.fsio import TMP_MARKER
from eyas.shards.encoding import ShardEncoding
from eyas.shards.format import ShardMeta, ShardPlan
from eyas.shards.manifest import ManifestRow, drop_manifest_rows, read_manifest
from eyas.storage import Storage, as_storage

RUN_META_NAME = "extract.json"
LOCK_NAME = ".extract.lock"
QUARANTINE_DIR = "quarantine"


class ExtractConfigMismatchError(ValueError):
    """The shards directory holds an extraction made with other parameters."""


@dataclass(frozen=True)
class ExtractRunMeta:
    """What `extract.json` records; every field must match for a run to resume into the directory."""

    format_version: str
    target_fingerprint: str
    aux_layer_ids: list[int]
    layer_id_convention: str
    hidden_size: int
    num_aux: int
    dtype: str
    target_dtype: str
    backend: str
    dataset_hash: str
    shard_bytes: int
    num_shards: int
    aux_dtype: str
    teacher: str
    teacher_topk: int

    @property
    def encoding(self) -> ShardEncoding:
        return ShardEncoding(self.aux_dtype, self.teacher, self.teacher_topk, self.dtype)

    def shard_meta(self, plan: ShardPlan) -> ShardMeta:
        return ShardMeta(
            target_fingerprint=self.target_fingerprint,
            aux_layer_ids=tuple(self.aux_layer_ids),
            layer_id_convention=self.layer_id_convention,
            hidden_size=self.hidden_size,
            num_aux=self.num_aux,
            dtype=self.dtype,
            backend=self.backend,
            dataset_hash=self.dataset_hash,
            shard_index=plan.index,
            sample_start=plan.sample_start,
            sample_end=plan.sample_end,
            aux_dtype=self.aux_dtype,
            teacher=self.teacher,
            teacher_topk=self.teacher_topk,
        )


def read_run_meta(where: "str | Path | Storage") -> ExtractRunMeta | None:
    """The recorded `extract.json`, every field checked; None when no extraction was recorded."""
    store = as_storage(where)
    if not store.exists(RUN_META_NAME):
        return None
    source = f"{store.url}/{RUN_META_NAME}"
    try:
        data = json.loads(store.get_bytes(RUN_META_NAME))
    except json.JSONDecodeError as e:
        raise ExtractConfigMismatchError(
            f"{source}: not valid JSON ({e}); the run's parameters are unknown; move {store.url} aside and extract again"
        ) from e
    names = [f.name for f in fields(ExtractRunMeta)]
    if not isinstance(data, dict) or sorted(data) != sorted(names):
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ExtractConfigMismatchError(
            f"{source}: keys {found}, expected {sorted(names)}; it was not written by this version of eyas: move "
            f"{store.url} aside and extract again"
        )
    return ExtractRunMeta(**data)


def check_run_meta(store: Storage, current: ExtractRunMeta) -> None:
    """Write `extract.json` for a fresh shard set, or refuse to resume with different parameters."""
    recorded = read_run_meta(store)
    if recorded is None:
        if read_manifest(store):
            raise ExtractConfigMismatchError(
                f"{store.url}: manifest has rows but {RUN_META_NAME} is missing, so the shards' parameters are "
                f"unknown; move the shards aside and extract again"
            )
        store.put_bytes(RUN_META_NAME, json.dumps(asdict(current), indent=1, sort_keys=True).encode())
        return
    there, wanted = asdict(recorded), asdict(current)
    diffs = [f"{k}={there[k]!r} there, {wanted[k]!r} now" for k in sorted(wanted) if there[k] != wanted[k]]
    if diffs:
        raise ExtractConfigMismatchError(
            f"{store.url}/{RUN_META_NAME}: the shards there were extracted with other parameters: {'; '.join(diffs)}. "
            f"Resuming would mix shards; use a new shards_dir, or move {store.url} aside to start over"
        )


@contextmanager
def extraction_lock(store: Storage):
    """One coordinator per local shards directory at a time (the kernel drops the lock if the process dies).
    S3 has no such lock: run one coordinator per prefix."""
    root = store.local_path()
    if root is None:
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise RuntimeError(
                f"shards dir {root}: another extraction holds {LOCK_NAME}; wait for it to finish or stop it "
                f"(two coordinators would delete each other's temporaries and both write the missing shards)"
            ) from e
        yield


def extraction_lock_held(lock_path: Path) -> bool:
    """Whether a process on this machine holds the extraction lock, read from /proc/locks (taking the
    lock to find out would race a starting coordinator). A holder on another machine is not seen."""
    try:
        st, locks = lock_path.stat(), Path("/proc/locks").read_text()
    except OSError:
        return False
    lock_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(lock_id in line.split() for line in locks.splitlines() if "->" not in line)


QUARANTINE_REASON_SUFFIX = ".reason.txt"


def quarantine_shards(where: "str | Path | Storage", reasons: Mapping[str, str]) -> list[str]:
    """Move each named shard (a key of `reasons`) into `quarantine/` as `NAME.STAMP`, beside
    `NAME.STAMP.reason.txt` holding its reason, and drop its manifest row, so that the next extraction
    re-extracts it. A local directory renames the file; S3 copies it on the server, then deletes it. A shard
    already gone still gets its reason. Returns the reason objects' names (under the storage)."""
    written = set_aside_shards(where, reasons)
    drop_manifest_rows(where, list(reasons))
    return written


def set_aside_shards(where: "str | Path | Storage", reasons: Mapping[str, str]) -> list[str]:
    """The first half of `quarantine_shards`: each shard moved into `quarantine/` beside its reason; the manifest
    rows are left to the caller. Returns the reason objects' names."""
    store = as_storage(where)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    present, taken = store.list(), set(store.list(QUARANTINE_DIR + "/"))
    written = []
    for name, reason in sorted(reasons.items()):
        if not reason:
            raise ValueError(f"quarantine {store.url}/{name}: empty reason; say why the shard is set aside")
        dst, k = f"{QUARANTINE_DIR}/{name}.{stamp}", 1
        while dst in taken or dst + QUARANTINE_REASON_SUFFIX in taken:
            dst, k = f"{QUARANTINE_DIR}/{name}.{stamp}-{k}", k + 1
        found = name in present
        if found:
            store.move(name, dst)
        note = dst + QUARANTINE_REASON_SUFFIX
        store.put_bytes(note, (reason + "\n" + ("" if found else "(the file was already missing)\n")).encode())
        taken |= {dst, note}
        written.append(note)
    return written


@dataclass
class ShardSetState:
    """What a local shard set holds now, read from its files (for eyas status)."""

    run: ExtractRunMeta | None  # None: no extraction recorded here
    rows: list[ManifestRow] = field(default_factory=list)
    interrupted_writes: int = 0  # temporaries a crash left; the next extraction removes them
    quarantine_reasons: list[str] = field(default_factory=list)  # oldest first
    running_here: bool = False  # a process on this machine holds the coordinator's lock

    @property
    def num_planned(self) -> int:
        return self.run.num_shards if self.run else 0

    @property
    def complete(self) -> bool:
        return self.run is not None and len(self.rows) == self.run.num_shards


def shard_set_state(where: "str | Path | Storage") -> ShardSetState:
    """The state of the shard set in a local directory or a storage. On S3 no lock is seen and interrupted
    writes (unfinished uploads, removed by the next extraction) are not counted."""
    store = as_storage(where)
    root = store.local_path()
    if root is not None and not root.is_dir():
        return ShardSetState(run=None)
    notes = sorted(n for n in store.list(QUARANTINE_DIR + "/") if n.endswith(QUARANTINE_REASON_SUFFIX))
    return ShardSetState(
        run=read_run_meta(store),
        rows=read_manifest(store),
        interrupted_writes=sum(1 for p in root.rglob(f".*{TMP_MARKER}*") if p.is_file()) if root else 0,
        quarantine_reasons=[store.get_bytes(n).decode().strip() for n in notes],
        running_here=extraction_lock_held(root / LOCK_NAME) if root else False,
    )
