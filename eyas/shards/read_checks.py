"""Checked reads that cost once per node: each shard's checksum hashed by one rank of a launch, trusted by the rest.

    checks = NodeReadChecks.for_this_launch()      # node-local, shared by the ranks this torchrun started here
    problem = checks.checksum_problem(row, path)   # None, or "shard FILE: checksum ..., the manifest says ..."
    checks.check_ahead([(row, path), ...])         # optional: hash what no rank has claimed yet, never waiting
    checks.stats                                   # shards and bytes hashed by this process, records trusted

Every rank hashing every whole shard it opens reads the shard set once per rank. Here the first rank to need a
shard takes an exclusive lock on it (fcntl.flock on a file of its own), hashes it, and writes a record of the
checksum it found (atomically: temporary, fsync, rename); a rank that needs the shard meanwhile waits on the
lock, then reads the record. A record holds the checksum found, not a verdict, so every rank compares it with
its own manifest row and a damaged shard is refused, by name, by every rank that needs it.

What a record may be trusted for:
- only by the launch that wrote it: records live in a folder per launch (host, boot, the launcher's process
  and its start time, torchelastic's restart count), so a resumed or relaunched run hashes again, and bytes
  that rotted between two launches are found;
- only for the file it was made from: a record names the file's path and its identity when hashed (device,
  inode, size, mtime_ns, ctime_ns); a file replaced or rewritten since is hashed again;
- only once complete: a rank killed while hashing writes no record (the kernel releases its lock), so the
  next rank hashes the shard itself.

The folder is node-local (the temporary directory, per user): flock on a shared network volume is not
dependable (Lustre refuses it without `-o flock`), and /dev/shm is small in containers and NCCL needs it.
The last process of a launch to close its checks (ShardSamples.close, or at exit) deletes the launch's folder, and
the root with it when nothing else is left there: every process holds a shared flock on the folder's `.users`
for as long as it may read, and the closer deletes only when it can take that lock exclusively. Folders of
launches that ended without closing (killed) are deleted when a new one opens. Where /proc does not name
the launch (not Linux), each process checks alone, as without a record.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from eyas.checksum import checksum_bytes, format_digest, new_hasher, short
from eyas.fsio import atomic_write_text

if TYPE_CHECKING:
    from eyas.shards.manifest import ManifestRow

ROOT_NAME = "eyas-read-checks"
USERS = ".users"  # each process of the launch holds a shared flock on it while it may read
CHUNK_BYTES = 1 << 24


@dataclass
class ReadCheckStats:
    shards_hashed: int = 0  # by this process
    bytes_hashed: int = 0
    shards_trusted: int = 0  # records another process of the launch wrote

    def summary(self) -> str:
        return (
            f"read checks: {self.shards_hashed} shards ({self.bytes_hashed} bytes, {self.bytes_hashed / 1e9:.2f} GB) "
            f"hashed by this process, {self.shards_trusted} trusted from the node's record"
        )


def _proc_start_ticks(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after "pid (comm)": state is field 3, starttime 22


def launch_name() -> str | None:
    """This node's name for the launch: under torchrun the launcher (every local rank's parent) and its restart
    count, else this process alone. None where /proc is missing."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    if not boot.is_file():
        return None
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    pid = os.getppid() if under_torchrun else os.getpid()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if under_torchrun else "0"
    start = _proc_start_ticks(pid)
    if start is None:
        return None
    return f"{socket.gethostname()}_{boot.read_text().strip()[:8]}_{pid}_{start}_{restart}"


def _ended(name: str, host: str, boot: str) -> bool:
    """A launch folder of this host whose launcher has exited (or whose boot is over)."""
    parts = name.rsplit("_", 4)
    if len(parts) != 5 or parts[0] != host or not parts[2].isdigit():
        return False
    return parts[1] != boot or _proc_start_ticks(int(parts[2])) != parts[3]


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class NodeReadChecks:
    """Shard checksums hashed once per launch on a node. `folder` None: no record, every call hashes."""

    def __init__(self, folder: str | Path | None):
        self.folder = None if folder is None else Path(folder)
        self.stats = ReadCheckStats()
        self._root: Path | None = None  # set by for_this_launch: close deletes what the launch leaves there
        self._users_fd: int | None = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_this_launch(cls, root: str | Path | None = None) -> "NodeReadChecks":
        """The launch's folder under `root` (default: TMPDIR/eyas-read-checks-UID), ended launches' folders of
        this host deleted first; `close` (or the process's exit) deletes it after the launch's last process."""
        name = launch_name()
        if name is None:
            return cls(None)
        root = Path(root) if root is not None else Path(tempfile.gettempdir()) / f"{ROOT_NAME}-{os.getuid()}"
        host, boot = name.rsplit("_", 4)[:2]
        with _root_held(root):
            for old in root.iterdir():
                if old.is_dir() and old.name != name and _ended(old.name, host, boot):
                    shutil.rmtree(old)
            checks = cls(root / name)
            checks._root = root
            checks._users_fd = os.open(checks.folder / USERS, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(checks._users_fd, fcntl.LOCK_SH)  # never waits: an exclusive holder holds the root too
        atexit.register(checks.close)
        return checks

    def close(self) -> None:
        """This process reads no more: the last of its launch deletes the launch's folder (and an empty root)."""
        if self._users_fd is None:
            return
        fd, self._users_fd = self._users_fd, None
        os.close(fd)  # releases this process's shared lock
        with _root_held(self._root):
            if self.folder.is_dir():
                with _flocked(self.folder / USERS, what=f"read-check folder {self.folder}", wait=False) as last:
                    if last:
                        shutil.rmtree(self.folder)
            try:
                self._root.rmdir()
            except OSError as e:  # another launch's folder is there
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise

    def checksum_problem(self, row: "ManifestRow", path: str | Path) -> str | None:
        """What is wrong with the shard's bytes against its manifest row (None: its checksum matches),
        from this launch's record on the node, or hashed here when there is none."""
        found = self._checksum(row, Path(path))
        if found == row.checksum:
            return None
        return (
            f"shard {row.file}: checksum {short(found)}, the manifest says {short(row.checksum)}; its bytes "
            "changed after extraction: run eyas verify, which quarantines and re-extracts it"
        )

    def check_ahead(self, shards: Iterable[tuple["ManifestRow", str | Path]]) -> int:
        """Hash and record the shards that have no record and that no process is hashing (never waits); the
        number hashed. A damaged one is recorded, to be refused by whoever needs it."""
        if self.folder is None:
            return 0
        hashed = 0
        for row, path in shards:
            path = Path(path)
            if self._trusted(row, path, count=False) is not None:
                continue
            with _flocked(self._lock_path(path), what=f"read-check folder {self.folder}", wait=False) as held:
                if held and self._trusted(row, path, count=False) is None:
                    self._hash_and_record(path)
                    hashed += 1
        return hashed

    def _checksum(self, row: "ManifestRow", path: Path) -> str:
        if self.folder is None:
            return self._hash(path)[0]
        found = self._trusted(row, path)
        if found is not None:
            return found
        with _flocked(self._lock_path(path), what=f"read-check folder {self.folder}"):
            found = self._trusted(row, path)  # hashed by the rank that held the lock before us
            return found if found is not None else self._hash_and_record(path)

    def _key(self, path: Path) -> str:
        return f"{path.name}-{checksum_bytes(str(path.resolve()).encode()).partition(':')[2][:16]}"

    def _lock_path(self, path: Path) -> Path:
        return self.folder / f"{self._key(path)}.lock"

    def _record_path(self, path: Path) -> Path:
        return self.folder / f"{self._key(path)}.json"

    def _trusted(self, row: "ManifestRow", path: Path, *, count: bool = True) -> str | None:
        """The recorded checksum, when a record of this very file (path and identity now) exists."""
        record_path = self._record_path(path)
        try:
            record = json.loads(record_path.read_text())
            identity = _identity(path.stat())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{record_path}: not a read-check record ({e}); records are written atomically by "
                f"eyas.shards.read_checks: delete the folder {self.folder}"
            ) from e
        if record["path"] != str(path.resolve()) or record["identity"] != identity:
            return None
        self.stats.shards_trusted += count
        return record["checksum"]

    def _hash(self, path: Path) -> tuple[str, list[int]]:
        """The file's checksum and its identity before the read (a change during the read shows as another)."""
        with open(path, "rb") as f:
            identity = _identity(os.fstat(f.fileno()))
            h = new_hasher()
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
                self.stats.bytes_hashed += len(chunk)
        self.stats.shards_hashed += 1
        return format_digest(h), identity

    def _hash_and_record(self, path: Path) -> str:
        found, identity = self._hash(path)
        record = {"path": str(path.resolve()), "identity": identity, "checksum": found, "pid": os.getpid()}
        atomic_write_text(self._record_path(path), json.dumps(record, sort_keys=True))
        return found


@contextmanager
def _flocked(lock: Path, *, what: str, wait: bool = True):
    """An exclusive flock on `lock` (created if missing) for the block; yields whether it is held (always when
    `wait`). The kernel releases it when the process dies."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        yield _lock(fd, lock, what=what, wait=wait)
    finally:
        os.close(fd)


def _lock(fd: int, lock: Path, *, what: str, wait: bool = True) -> bool:
    """An exclusive flock on the open `lock`; False when not `wait` and another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        raise OSError(
            e.errno,
            f"{what}: flock on {lock} failed ({e.strerror}); expected a local filesystem that supports "
            "flock: point TMPDIR at a local directory",
        ) from e


@contextmanager
def _root_held(root: Path):
    """The root folder, made if missing, under an exclusive flock on the folder itself. A closer may delete the
    root while another process waits on its lock: the waiter then holds a lock on a deleted folder and tries again."""
    while True:
        root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue
        try:
            _lock(fd, root, what=f"read-check folder {root}")
            try:
                current = os.stat(root).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield
                return
        finally:
            os.close(fd)
