"""torchrun agents for the several-node tests: each "node" is one agent on loopback, in a process group of its own
so that a test can kill it, with its workers, like a machine that is lost, and none outlives a failing test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AGENT_TIMEOUT_S = 300  # a hang guard only: the tiny jobs take seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_agent(cmd: list[str], log: Path) -> subprocess.Popen:
    """One agent (a torchrun command) writing its output to `log`, in a session of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def children(pid: int) -> list[int]:
    """The processes `pid` started (its workers, for an agent), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended while we looked
            continue
    return found


def kill_agent(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers at once, as a lost machine loses them: torchrun starts each worker in a
    session (and process group) of its own, so the agent's group and each worker's group are killed."""
    if proc.poll() is not None:
        return
    groups = {os.getpgid(proc.pid)}
    for pid in children(proc.pid):
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            continue
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            continue
    proc.wait()


@contextmanager
def agents_killed_at_exit(procs: list[subprocess.Popen]):
    """Whatever happens in the block, no agent (nor a worker of one) is left running after it."""
    try:
        yield procs
    finally:
        for p in procs:
            kill_agent(p)


def run_agents(commands: list[list[str]], logs: list[Path]) -> list[str]:
    """Start every agent at once (one per "node"), wait for all, and return their output; any agent still running
    when one fails or the guard expires is killed with its workers."""
    with agents_killed_at_exit([]) as procs:
        for cmd, log in zip(commands, logs):
            procs.append(start_agent(cmd, log))
        codes = [p.wait(timeout=AGENT_TIMEOUT_S) for p in procs]
    outputs = [log.read_text() for log in logs]
    assert codes == [0] * len(procs), "\n\n".join(f"{' '.join(c)}\n{o[-4000:]}" for c, o in zip(commands, outputs))
    return outputs
