"""The `eyas` commands that ran a workdir's flows in their own process: one record per launch.

`eyas run`, `eyas demo` and the stage verbs execute their flow runs in the command's own process,
with no worker to watch it. When that process dies (kill -9, an OOM, a closed laptop) the server
still says Running until the crash automation (eyas_cli.automation) marks the run Crashed, a window
after its last heartbeat. So each such command tags its flow runs `eyas-XXXXXXXX` and records,
before it starts them, who runs them:

    RUN/launches/eyas-XXXXXXXX.json   {tag, pid, start_time, host, boot_id, argv, started_at}

`eyas status` matches a flow run's tag with its record and asks this machine whether that very
process still lives (same boot, same PID, same kernel start time: a reused PID is never mistaken
for it), so a dead process is never shown as running, even before the server knows.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from eyas.fsio import atomic_write_text
from eyas.train.preflight import process_start_time

LAUNCHES_DIR = "launches"
TAG_PREFIX = "eyas-"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
ALIVE, GONE, ELSEWHERE, UNKNOWN = "alive", "gone", "elsewhere", "unknown"


def boot_id() -> str:
    """This boot of this machine (a reboot changes it); '' where the kernel does not say."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def record_launch(workdir: str | Path, tag: str, argv: list[str] | None = None) -> Path:
    """Record that this process runs the flow runs tagged `tag` for `workdir`."""
    if not tag.startswith(TAG_PREFIX):
        raise ValueError(f"launch tag {tag!r}: expected one starting with {TAG_PREFIX!r}")
    pid = os.getpid()
    record = {
        "tag": tag,
        "pid": pid,
        "start_time": process_start_time(pid),
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "argv": list(sys.argv if argv is None else argv),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    path = Path(workdir) / LAUNCHES_DIR / f"{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def read_launches(workdir: str | Path) -> dict[str, dict]:
    """The launch records of a workdir by tag; one that cannot be read is kept as {"tag", "error"} (UNKNOWN)."""
    found = {}
    for path in sorted((Path(workdir) / LAUNCHES_DIR).glob(f"{TAG_PREFIX}*.json")):
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict) or record.get("tag") != path.stem:
                raise ValueError(f"expected a launch record for tag {path.stem}, found {str(record)[:80]}")
        except (OSError, ValueError) as err:
            record = {"tag": path.stem, "error": f"{path}: {err}"}
        found[path.stem] = record
    return found


def liveness(record: dict) -> str:
    """ALIVE or GONE when the process ran on this machine (this boot or an earlier one), ELSEWHERE when it ran on
    another one, UNKNOWN when its record could not be read."""
    if "error" in record:
        return UNKNOWN
    if record.get("host") != socket.gethostname():
        return ELSEWHERE
    if record.get("boot_id") != boot_id() or record.get("start_time") is None:
        return GONE
    return ALIVE if process_start_time(int(record["pid"])) == record["start_time"] else GONE


def launch_of(flow_run: dict, launches: dict[str, dict]) -> dict | None:
    """The launch record of a flow run (by its eyas-* tag), or None (a worker's run, or another workdir's)."""
    return next((launches[t] for t in flow_run.get("tags", []) if t in launches), None)
