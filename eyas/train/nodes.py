"""The nodes of a running training job, and a stop that reaches every one of them, through the train directory
that all nodes share (a shared volume: the same path on every node).

Node records: each node's local rank 0 writes `nodes/node-NNN.json` (host, node rank, the global ranks on it,
world size, torch elastic's run id and restart count, its pid, the step, its state, and when it wrote), at start,
at most every WRITE_EVERY_S as steps go, and when it stops or finishes; a plain file write, no collective. Every
record carries the launch's id, which rank 0 draws at the start of each launch (and each elastic restart) and
broadcasts once, so the records of an earlier launch, restart or world are never taken for this job's nodes:
`job_nodes` returns the nodes of the newest launch only, each `alive` unless it has not written for
SILENT_AFTER_S (or, on this host, its process is gone).

The stop: `eyas stop RUN/train` writes `stop.json` (who, when, from which host: `request_stop`); every rank looks
for it after each step and the ranks agree through one all_reduce of a flag (`StopWatch`), so all of them stop
after the same step, save a checkpoint there and exit 0, which torch's elastic agent takes for success (no
restart). Rank 0 then adds the step and checkpoint to `stop.json` (`record_stopped`), and the launcher, seeing it
instead of final.json, raises TrainingStopped (`raise_if_stopped`). A launch clears the request when it starts
(`clear_stop`): a stop asked for while no job ran never stops the next launch.

    recorder = NodeRecorder(train_dir, launch_id)   # every rank; only local rank 0 writes
    recorder.update(step)                           # at most every WRITE_EVERY_S
    nodes = job_nodes(train_dir)                    # the newest launch's nodes, each with alive / seen_s_ago
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from eyas.fsio import atomic_write_text

NODES_DIR = "nodes"
STOP_FILE = "stop.json"
WRITE_EVERY_S = 10.0  # a record per node at most this often while steps run: cheap on a shared volume
SILENT_AFTER_S = 3 * WRITE_EVERY_S  # a node that has not written for this long is reported as not seen


def _now_iso(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds")


def elastic_env(env: dict | None = None) -> dict:
    """What torchrun tells a worker of its place (one process without torchrun: node 0 of a world of 1)."""
    env = os.environ if env is None else env
    rank, local_rank = int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))
    return {
        "node_rank": int(env.get("GROUP_RANK", 0)),
        "local_rank": local_rank,
        "rank": rank,
        "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1)),
        "world_size": int(env.get("WORLD_SIZE", 1)),
        "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "run_id": env.get("TORCHELASTIC_RUN_ID", ""),
    }


def agree_launch_id(rank: int) -> str:
    """A new id for this launch (or elastic restart), drawn by rank 0 and broadcast to every rank (one collective,
    at start)."""
    import torch.distributed as dist

    chosen = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def node_path(train_dir: Path, node_rank: int) -> Path:
    return Path(train_dir) / NODES_DIR / f"node-{node_rank:03d}.json"


class NodeRecorder:
    """This node's record, written by its local rank 0 (on the other ranks every call does nothing)."""

    def __init__(self, train_dir: Path, launch_id: str, *, env: dict | None = None, every_s: float = WRITE_EVERY_S):
        place = elastic_env(env)
        first = place["rank"] - place["local_rank"]  # torchrun numbers a node's ranks contiguously
        self.active, self.every_s, self.last_write, self.state = place["local_rank"] == 0, every_s, None, None
        self.path = node_path(train_dir, place["node_rank"])
        self.record = {
            "launch_id": launch_id,
            "run_id": place["run_id"],
            "restart_count": place["restart_count"],
            "host": socket.gethostname(),
            "node_rank": place["node_rank"],
            "ranks": list(range(first, first + place["local_world_size"])),
            "world_size": place["world_size"],
            "pid": os.getpid(),
            "process_start": process_start_time(os.getpid()),
        }

    def write(self, step: int, state: str) -> None:
        """Write the record now: the step and the state (training, saving, stopped, finished)."""
        if not self.active:
            return
        now = time.time()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {**self.record, "step": step, "state": state, "written_at": now, "written_at_iso": _now_iso(now)}
        atomic_write_text(self.path, json.dumps(record, indent=1) + "\n")
        self.last_write, self.state = time.monotonic(), state

    def update(self, step: int) -> None:
        """Write the record (state training) if WRITE_EVERY_S has passed since the last write, or it said another
        state (a save that has ended)."""
        due = self.last_write is None or time.monotonic() - self.last_write >= self.every_s
        if self.active and (due or self.state != "training"):
            self.write(step, "training")


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks (field 22 of /proc/PID/stat); None if gone, or exited and not
    yet reaped by its parent (a zombie, state Z: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def read_node_records(train_dir: Path) -> list[dict]:
    """Every node record in the train directory, of any launch (a record that does not parse raises ValueError
    naming it)."""
    records = []
    for path in sorted((Path(train_dir) / NODES_DIR).glob("node-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"node record {path}: not JSON ({err}); expected what a trainer's local rank 0 writes; delete it, "
                "the node writes it again within seconds while it trains"
            ) from None
    return records


def job_nodes(train_dir: Path, *, now: float | None = None, host: str | None = None) -> dict:
    """The nodes of the newest launch: {"launch_id", "nodes": [record + seen_s_ago, alive, why], "ignored": the
    number of records of earlier launches}. A node is alive while it trains and has written within SILENT_AFTER_S;
    on this host (`host`, this machine's name by default) its process must also be running."""
    records = read_node_records(train_dir)
    if not records:
        return {"launch_id": None, "nodes": [], "ignored": 0}
    now, host = time.time() if now is None else now, socket.gethostname() if host is None else host
    newest = max(records, key=lambda r: r["written_at"])
    mine = [r for r in records if r["launch_id"] == newest["launch_id"]]
    nodes = [{**r, **_liveness(r, now, host)} for r in sorted(mine, key=lambda r: r["node_rank"])]
    return {"launch_id": newest["launch_id"], "nodes": nodes, "ignored": len(records) - len(mine)}


def _liveness(record: dict, now: float, host: str) -> dict:
    seen = max(0.0, now - record["written_at"])
    if record["state"] in ("stopped", "finished"):
        alive, why = False, f"{record['state']} at step {record['step']}"
    elif seen > SILENT_AFTER_S:
        alive, why = False, f"not seen for {seen:.0f} s (last {record['state']} at step {record['step']})"
    elif record["host"] == host and process_start_time(record["pid"]) != record.get("process_start"):
        alive, why = False, f"process {record['pid']} is gone (last {record['state']} at step {record['step']})"
    else:
        alive, why = True, f"{record['state']}, seen {seen:.0f} s ago"
    return {"seen_s_ago": round(seen, 1), "alive": alive, "why": why}


def describe_node(node: dict) -> str:
    """One line: `node 1 on HOST (ranks 2-3 of 4, pid P): step 7, training, seen 3 s ago`."""
    ranks = node["ranks"]
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    return (
        f"node {node['node_rank']} on {node['host']} ({span} of {node['world_size']}, pid {node['pid']}): "
        f"step {node['step']}, {node['why']}"
    )


def request_stop(train_dir: Path, *, now: float | None = None) -> dict:
    """Ask every rank of the job training in `train_dir` to stop after its current step (writes STOP_FILE)."""
    now = time.time() if now is None else now
    request = {
        "requested_by": getpass.getuser(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "requested_at": _now_iso(now),
    }
    atomic_write_text(Path(train_dir) / STOP_FILE, json.dumps(request, indent=1) + "\n")
    return request


def read_stop(train_dir: Path) -> dict | None:
    path = Path(train_dir) / STOP_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"stop request {path}: not JSON ({err}); expected what `eyas stop` writes; run `eyas stop` again"
        ) from None


def clear_stop(train_dir: Path) -> None:
    """A launch starts: a stop requested before it is not for it."""
    (Path(train_dir) / STOP_FILE).unlink(missing_ok=True)


def record_stopped(train_dir: Path, *, step: int, checkpoint: str | None) -> None:
    """Rank 0, once every rank stopped: the step and the checkpoint saved there, added to the request."""
    stopped = {"stopped_at_step": step, "checkpoint": checkpoint, "stopped_on": socket.gethostname(),
               "stopped_at": _now_iso(time.time())}  # fmt: skip
    atomic_write_text(Path(train_dir) / STOP_FILE, json.dumps({**(read_stop(train_dir) or {}), **stopped}) + "\n")


class StopWatch:
    """Whether the ranks agree that a stop was requested: each rank looks for STOP_FILE, then one all_reduce
    (MAX) of the flag, so a rank that sees it first waits for the others instead of leaving them in a
    collective."""

    def __init__(self, train_dir: Path, device):
        self.path, self.device = Path(train_dir) / STOP_FILE, device

    def agreed(self) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.path.exists())], dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class TrainingStopped(RuntimeError):
    """The trainer stopped on `eyas stop`, every rank at the same step, a checkpoint saved there."""


def raise_if_stopped(train_dir: Path, returncode: int) -> None:
    """After a launch: raise TrainingStopped when a stop was requested during it, either honoured by its ranks
    (exit 0, the step recorded) or enforced by killing its launcher (`eyas stop` after its wait); else nothing."""
    stop = read_stop(train_dir)
    if stop is None or (returncode == 0 and "stopped_at_step" not in stop):
        return  # no request, or the run reached its last step before any rank saw it
    asked = f"requested by {stop['requested_by']} on {stop['host']} at {stop['requested_at']}"
    if "stopped_at_step" in stop:
        how, checkpoint = f"at step {stop['stopped_at_step']} ({asked})", stop["checkpoint"]
    else:
        from eyas.train.checkpoint import latest_complete

        how = f"({asked}): torchrun exited with {returncode} before its ranks stopped (torchrun.log says how)"
        checkpoint = latest_complete(train_dir)
    resume = f"resume from {checkpoint}" if checkpoint else "start again from step 0 (no complete checkpoint)"
    raise TrainingStopped(
        f"training stopped by `eyas stop` {how}; the request: {Path(train_dir) / STOP_FILE}; run `eyas train CONFIG` "
        f"with this run's config to {resume}"
    )
