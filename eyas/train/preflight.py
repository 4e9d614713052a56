"""Device preflight before a training launch, and the registry of processes eyas started.

Before the gate: the devices the run needs are visible and idle (GPU memory in use below a
threshold), and no process that an earlier eyas launch recorded is still alive. eyas records
each launcher it starts (PID and kernel start time, so a reused PID is never mistaken for it)
in `processes.json` of the train directory, and `stop_recorded` stops those and only those.
On CPU (gloo) the preflight reports the cores and the process count and passes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from eyas.config import RunConfig, TrainConfig
from eyas.fsio import atomic_write_text

REGISTRY = "processes.json"


@dataclass
class PreflightReport:
    backend: str
    num_processes: int
    devices: list[dict] = field(default_factory=list)
    alive_recorded: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks (field 22 of /proc/PID/stat); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def record_launch(train_dir: Path, pid: int, cmd: list[str]) -> None:
    """Add a started launcher to the registry (read-modify-write; one launcher per train dir)."""
    entries = read_registry(train_dir)
    entries.append(
        {
            "pid": pid,
            "start_time": process_start_time(pid),
            "cmd": cmd,
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    )
    atomic_write_text(Path(train_dir) / REGISTRY, json.dumps(entries, indent=2))


def read_registry(train_dir: Path) -> list[dict]:
    path = Path(train_dir) / REGISTRY
    return json.loads(path.read_text()) if path.exists() else []


def alive_recorded(train_dir: Path) -> list[dict]:
    """Recorded launchers still running: same PID and the same kernel start time."""
    return [
        e
        for e in read_registry(train_dir)
        if e["start_time"] is not None and process_start_time(e["pid"]) == e["start_time"]
    ]


def stop_recorded(train_dir: Path, *, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the recorded launchers still alive (they stop their workers), SIGKILL after grace_s."""
    targets = alive_recorded(train_dir)
    for entry in targets:
        os.killpg(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive_recorded(train_dir):
        time.sleep(0.2)
    for entry in alive_recorded(train_dir):
        os.killpg(entry["pid"], signal.SIGKILL)
    return [e["pid"] for e in targets]


def parse_nvidia_smi(text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`."""
    rows = []
    for line in text.strip().splitlines():
        index, used, total = (part.strip() for part in line.split(","))
        rows.append({"device": f"cuda:{index}", "memory_used_mib": int(used), "memory_total_mib": int(total)})
    return rows


def query_gpus() -> list[dict]:
    if shutil.which("nvidia-smi") is None:
        raise FileNotFoundError("nvidia-smi not found on PATH; train.backend='nccl' needs NVIDIA GPUs and their driver")
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return parse_nvidia_smi(out)


def device_preflight(train: TrainConfig, train_dir: Path, gpus: list[dict] | None = None) -> PreflightReport:
    """Check the devices and the process registry; `gpus` (nvidia-smi rows) is queried when None."""
    report = PreflightReport(backend=train.backend, num_processes=train.num_processes)
    if train.backend == "gloo":
        report.devices = [{"device": "cpu", "cores": os.cpu_count(), "processes": train.num_processes}]
    else:
        report.devices = query_gpus() if gpus is None else gpus
        check_gpus(report, train)
    report.alive_recorded = alive_recorded(train_dir)
    for entry in report.alive_recorded:
        report.problems.append(
            f"process {entry['pid']} started by an earlier eyas launch at {entry['started_at']} is still running "
            f"({' '.join(entry['cmd'][:6])} ...); stop it with `eyas stop {train_dir}` (it stops only processes eyas recorded)"
        )
    return report


def check_gpus(report: PreflightReport, train: TrainConfig) -> None:
    visible = len(report.devices)
    if visible < train.num_processes:
        report.problems.append(
            f"train.num_processes={train.num_processes} but {visible} GPU(s) are visible; expose more GPUs "
            f"(CUDA_VISIBLE_DEVICES) or lower train.num_processes"
        )
    for row in report.devices[: train.num_processes]:
        row["busy"] = row["memory_used_mib"] > train.max_idle_gpu_memory_mib
        if row["busy"]:
            report.problems.append(
                f"{row['device']}: {row['memory_used_mib']} MiB of {row['memory_total_mib']} MiB already in use, "
                f"expected at most train.max_idle_gpu_memory_mib={train.max_idle_gpu_memory_mib}; another job holds "
                f"this GPU: stop it or pick other devices"
            )


class PreflightFailed(RuntimeError):
    """A device the run needs is missing or busy, or an earlier launch is still running."""


def preflight_run(config: RunConfig, facts=None) -> PreflightReport:
    """The stage entry right before the gate: the run's devices and process registry; raises PreflightFailed
    with every problem."""
    report = device_preflight(config.train, config.paths.train_dir)
    if not report.ok:
        raise PreflightFailed("device preflight failed:\n" + "\n".join(f"- {p}" for p in report.problems))
    return report
