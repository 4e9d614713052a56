"""A Prefect worker as a subprocess, and the crash of the machine it runs on (every process under it killed
at once), for tests/test_crash_vm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def children_by_parent() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        found.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    return found


def process_tree(root: int) -> set[int]:
    """root and all its descendants (whatever their session or process group)."""
    children, tree, stack = children_by_parent(), set(), [root]
    while stack:
        pid = stack.pop()
        tree.add(pid)
        stack += children.get(pid, [])
    return tree


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def crash_machine(root: int) -> dict[int, str]:
    """SIGKILL root and every descendant together, as a VM crash would: all are stopped first (a stopped
    process starts no other), until no new one appears, then killed. Returns {pid: kernel start time} of
    the processes killed."""
    stopped: dict[int, str] = {}
    while tree := {pid: start for pid in process_tree(root) if (start := start_time(pid)) and pid not in stopped}:
        _signal(tree, signal.SIGSTOP)
        stopped |= tree
    _signal(stopped, signal.SIGKILL)
    return stopped


def start_time(pid: int) -> str | None:
    """The kernel's start time of pid (field 22 of /proc/PID/stat): with the pid, names one process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def start_worker(pool: str, env: dict, log_path: Path, cwd: Path) -> subprocess.Popen:
    """`prefect worker start` for a process pool, polling the server every second."""
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool, "--type", "process"]
    env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}
    log = open(log_path, "ab")
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def alive(processes: dict[int, str]) -> set[int]:
    """The pids of `processes` ({pid: start time}) still running (a zombie awaiting its parent counts as gone)."""
    running = set()
    for pid, start in processes.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[19] == start and fields[0] != "Z":
            running.add(pid)
    return running
