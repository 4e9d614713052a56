"""A rank's durable note of a wait for data in progress, read by `eyas status` (eyas.status.stream) to say which
shard a trainer waits for now, why, and since when.

    record = WaitRecord(job.output_dir, rank)                      # OUTPUT/waits/rank-R.WHAT.TID.json while waiting
    with record.waiting("shard-00007", shard=7, log=log) as say:   # `say` logs and refreshes the note
        wait_verified(store, 7, mode="full", timeout_s=math.inf, log=say)

A note is written at the wait's first word (a shard that is there at once leaves none), written again at each later
word (the reader's heartbeat, every SAY_EVERY_S), and removed when the wait ends, however it ends. A rank killed
meanwhile leaves its note behind: the note names the process (pid, its kernel start time, host, boot), so a reader
on the same machine tells a live wait from a stale one (eyas.status.launches.liveness), and one elsewhere goes by
the age of the last word (`beat_at`).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from eyas.fsio import atomic_write_text

WAITS_DIR = "waits"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _own_identity() -> dict:
    """This process as eyas.status.launches.liveness identifies one: pid, kernel start time (field 22 of
    /proc/PID/stat, None where there is no /proc), host, boot."""
    pid = os.getpid()
    try:
        start_time = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = BOOT_ID.read_text().strip()
    except OSError:
        start_time, boot = None, ""
    return {"pid": pid, "start_time": start_time, "host": socket.gethostname(), "boot_id": boot}


class WaitRecord:
    """The notes of one rank's waits, under OUTPUT/waits/: one file per thing waited for and waiting thread."""

    def __init__(self, output_dir: str | Path, rank: int):
        self.dir, self.rank = Path(output_dir) / WAITS_DIR, rank
        self._identity = _own_identity()

    def path(self, what: str) -> Path:
        """The note of `what` waited for by this thread (two threads of a rank may wait for one shard at once)."""
        return self.dir / f"rank-{self.rank}.{what}.{threading.get_native_id()}.json"

    @contextmanager
    def waiting(self, what: str, *, shard: int | None, log: Callable[[str], None]):
        """Yield a log function for the wait: each message goes to `log` and into the note of `what` (`shard`: the
        shard index waited for, None for extract.json); the note is removed when the block ends."""
        path, since = self.path(what), None

        def say(message: str) -> None:
            nonlocal since
            log(message)
            now = time.time()
            since = now if since is None else since
            note = {"rank": self.rank, "what": what, "shard": shard, "since": since, "beat_at": now,
                    "said": message, **self._identity}  # fmt: skip
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(note) + "\n")

        try:
            yield say
        finally:
            if since is not None:
                path.unlink(missing_ok=True)


def read_wait_records(output_dir: str | Path) -> list[dict]:
    """Every wait note under OUTPUT/waits/, by file name, each with its `path`; one that does not parse raises
    ValueError naming it."""
    records = []
    for path in sorted((Path(output_dir) / WAITS_DIR).glob("rank-*.json")):
        try:
            text = path.read_text()
        except FileNotFoundError:  # the wait ended between the listing and the read
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}: not a wait note ({err}); ranks write these whole, so something else changed it: delete it"
            ) from err
        records.append({**record, "path": str(path)})
    return records
