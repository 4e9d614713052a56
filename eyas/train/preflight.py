"""Device preflight before a training launch, and the registry of processes eyas started.

Before the smoke run and the gate, for a CUDA (nccl) run: torch, asked in a subprocess that inherits
CUDA_VISIBLE_DEVICES (eyas.train.devices), sees a device for every process; each device a rank uses runs bf16 when
the run trains in bf16, is idle (memory in use below train.max_idle_gpu_memory_mib) and has the memory plan's peak
free (eyas.train.memory_plan, planned against the smallest of them unless train.device_memory_gib is set); NCCL is
available. On CPU (gloo) it reports the cores and the process count, refuses more trainer processes than the
cores this process may use (each gloo rank computes on its own core; more ranks than cores share them and every
step waits on the slowest), and records the plan. Either way no process that an
earlier eyas launch recorded is still alive: eyas records each launcher it starts (PID and kernel start time, so a
reused PID is never mistaken for it) in `processes.json` of the train directory, and `stop_recorded` stops those
and only those. `stop_job` (`eyas stop`) first asks every rank of the job, on every node, to stop after its current
step (eyas.train.nodes) and gives this machine's launchers the time to end on their own.

    report = preflight_run(config, facts)     # raises PreflightFailed listing every problem
    report.to_dict()                          # backend, devices (torch's rows), torch, plan, problems, ok
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from eyas.config import RunConfig, TrainConfig
from eyas.fsio import atomic_write_text
from eyas.train.devices import MIB, DeviceQueryFailed, query_devices, usable_cores
from eyas.train.nodes import SILENT_AFTER_S, job_nodes, process_start_time, request_stop

if TYPE_CHECKING:
    from eyas.facts import RunFacts

REGISTRY = "processes.json"
STOP_WAIT_S = 600.0  # the longest `eyas stop` waits for a job that still reports: a step and a checkpoint save


@dataclass
class PreflightReport:
    backend: str
    num_processes: int
    devices: list[dict] = field(default_factory=list)  # eyas.train.devices' rows, with `used` and `busy`
    torch: dict = field(default_factory=dict)  # torch, cuda, nccl_version, cuda_visible_devices (CUDA runs)
    plan: dict | None = None  # MemoryPlan.to_dict() of the run on these devices; None without the run's facts
    alive_recorded: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def record_launch(train_dir: Path, pid: int, cmd: list[str]) -> None:
    """Add a started launcher to the registry (read-modify-write; one launcher per train dir)."""
    entries = read_registry(train_dir)
    entries.append(
        {
            "pid": pid,
            "host": socket.gethostname(),  # on several nodes the registry is shared: a PID means this host's
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
    """Recorded launchers of this host still running: same PID and the same kernel start time (another node's
    launchers are that node's: `eyas stop` stops them through the job's stop request)."""
    here = socket.gethostname()
    return [
        e
        for e in read_registry(train_dir)
        if e.get("host", here) == here
        and e["start_time"] is not None
        and process_start_time(e["pid"]) == e["start_time"]
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


def stop_job(train_dir: Path, *, wait_s: float = STOP_WAIT_S, grace_s: float = 10.0) -> dict:
    """Stop the job training in `train_dir` on every node: write the stop request (every rank stops after the same
    step and saves a checkpoint there), wait while this machine's recorded launchers live and their job's nodes
    still report (at most wait_s), then stop those still alive as `stop_recorded` does: a launcher whose job has
    no node reporting (still starting, or hung) is signalled at once.

    Returns {"request", "nodes": the newest launch's nodes alive when asked, "exited": recorded launchers that
    ended on their own, "killed": those stopped by a signal}."""
    request = request_stop(train_dir)
    launchers = [e["pid"] for e in alive_recorded(train_dir)]
    nodes = [n for n in job_nodes(train_dir)["nodes"] if n["alive"]]
    deadline = time.monotonic() + wait_s
    while alive_recorded(train_dir) and time.monotonic() < deadline and job_reports(train_dir):
        time.sleep(0.5)
    killed = stop_recorded(train_dir, grace_s=grace_s)
    return {"request": request, "nodes": nodes, "exited": [p for p in launchers if p not in killed], "killed": killed}


def job_reports(train_dir: Path) -> bool:
    """A node of the newest launch is alive, is saving a checkpoint (which may outlast SILENT_AFTER_S at scale), or
    said it stopped within SILENT_AFTER_S (its launcher is ending)."""
    nodes = job_nodes(train_dir)["nodes"]
    recent = [n for n in nodes if n["state"] == "stopped" and n["seen_s_ago"] <= SILENT_AFTER_S]
    return bool(recent) or any(n["alive"] or n["state"] == "saving" for n in nodes)


def device_preflight(train: TrainConfig, train_dir: Path, found: dict | None = None) -> PreflightReport:
    """Check the devices and the process registry; `found` (eyas.train.devices' query) is queried when None."""
    report = PreflightReport(backend=train.backend, num_processes=train.num_processes)
    if train.backend == "gloo":
        report.devices = [{"device": "cpu", "cores": usable_cores(), "processes": train.num_processes}]
        report.problems += cpu_process_problems(train, report.devices[0]["cores"])
    else:
        check_gpus(report, train, found)
    report.alive_recorded = alive_recorded(train_dir)
    for entry in report.alive_recorded:
        report.problems.append(
            f"process {entry['pid']} started by an earlier eyas launch at {entry['started_at']} is still running "
            f"({' '.join(entry['cmd'][:6])} ...); stop it with `eyas stop {train_dir}` (it stops only processes eyas recorded)"
        )
    return report


def label(row: dict) -> str:
    return f"{row['device']} ({row['name']})"


def check_gpus(report: PreflightReport, train: TrainConfig, found: dict | None) -> None:
    """The visible devices, as torch numbers them: enough of them, and each one a rank uses bf16-capable (when the
    run trains in bf16), readable and idle; NCCL available."""
    try:
        found = query_devices() if found is None else found
    except DeviceQueryFailed as err:
        report.problems.append(str(err))
        return
    report.torch = {k: found[k] for k in ("torch", "cuda", "nccl_version", "cuda_visible_devices")}
    report.devices = [{**row, "used": i < train.num_processes} for i, row in enumerate(found["devices"])]
    report.problems += gpu_count_problems(train, found)
    for row in report.devices:
        row["busy"] = row["used"] and (row["memory_used_mib"] or 0) > train.max_idle_gpu_memory_mib
        if row["used"]:
            report.problems += device_problems(row, train, found["device_errors"].get(row["device"], ""))


def cpu_process_problems(train: TrainConfig, cores: int) -> list[str]:
    """A gloo run starting more trainer processes than this process's usable cores (one rank a core at most)."""
    if train.num_processes <= cores:
        return []
    return [
        f"train.num_processes={train.num_processes} with train.backend='gloo' starts {train.num_processes} trainer "
        f"processes, but this process may use {cores} CPU core(s); expected at most one process per core (more share "
        f"the cores, and every step waits on the slowest); lower train.num_processes to {cores} or fewer, or train "
        f"on GPUs (train.backend='nccl')"
    ]


def gpu_count_problems(train: TrainConfig, found: dict) -> list[str]:
    """A CUDA run's devices as torch sees them (eyas.train.devices' query): none visible, no NCCL, or fewer than
    train.num_processes. The same problems before the first expensive step (eyas.run_inputs) and here."""
    devices = found["devices"]
    if not devices:
        return [no_device_problem(found)]
    problems = []
    if not found["nccl_available"]:
        problems.append(
            f"torch {found['torch']} reports no NCCL (torch.distributed.is_nccl_available() is False), expected for "
            f"train.backend='nccl'; install torch's CUDA build for Linux (its wheels bundle NCCL), or use "
            f"train.backend='gloo'"
        )
    if len(devices) < train.num_processes:
        problems.append(
            f"train.num_processes={train.num_processes} but torch sees {len(devices)} GPU(s) "
            f"({visible_setting(found)}): {', '.join(label(r) for r in devices)}; expose more GPUs with "
            f"CUDA_VISIBLE_DEVICES or lower train.num_processes"
        )
    return problems


def device_problems(row: dict, train: TrainConfig, error: str) -> list[str]:
    """What keeps a rank's device from training: bf16 unsupported, memory unreadable, or another job on it."""
    problems = []
    if train.mixed_precision != "off" and not row["bf16"]:  # auto and bf16 both mean bf16 autocast on CUDA
        problems.append(
            f"{label(row)}: compute capability {row['capability']}, expected 8.0 or higher for bf16 "
            f"(train.mixed_precision={train.mixed_precision!r} trains in bf16 on CUDA); use bf16-capable GPUs "
            f"(Ampere or newer: A100, H100, H200) via CUDA_VISIBLE_DEVICES, or set train.mixed_precision='off' "
            f"(fp32: slower, and a larger memory plan)"
        )
    if error:
        problems.append(
            f"{label(row)}: torch could not read its free memory ({error}), expected a device this run can use; "
            f"another process may hold it in exclusive mode (`nvidia-smi` shows it): stop it, or expose other GPUs "
            f"with CUDA_VISIBLE_DEVICES"
        )
    elif row["busy"]:
        problems.append(
            f"{label(row)}: {row['memory_used_mib']} MiB of {row['memory_total_mib']} MiB already in use, expected "
            f"at most train.max_idle_gpu_memory_mib={train.max_idle_gpu_memory_mib}; another job holds this GPU: "
            f"stop it, or expose idle GPUs with CUDA_VISIBLE_DEVICES"
        )
    return problems


def visible_setting(found: dict) -> str:
    value = found["cuda_visible_devices"]
    return (
        "CUDA_VISIBLE_DEVICES unset: every GPU of this machine" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"
    )


def no_device_problem(found: dict) -> str:
    """The one problem of a CUDA run where torch sees no device, with the fix that applies."""
    versions = f"torch {found['torch']}" + (f" (CUDA {found['cuda']})" if found["cuda"] else "")
    reason = f": {found['unavailable_reason']}" if found["unavailable_reason"] else ""
    if found["cuda"] is None:
        return (
            f"no CUDA device is visible to torch: {versions} is a CPU-only build, expected a CUDA build for "
            f"train.backend='nccl'; install torch's CUDA build on a machine with NVIDIA GPUs, or use "
            f"train.backend='gloo' on CPU"
        )
    if found["cuda_visible_devices"] is not None:
        return (
            f"no CUDA device is visible to {versions} with CUDA_VISIBLE_DEVICES={found['cuda_visible_devices']!r}"
            f"{reason}; list the GPUs to train on there (their indices or UUIDs, as `nvidia-smi -L` shows them), "
            f"or unset it"
        )
    return (
        f"no CUDA device is visible to {versions}{reason}; check that `nvidia-smi` lists the GPUs and that the "
        f"driver supports CUDA {found['cuda']}, or use train.backend='gloo' on CPU"
    )


def check_plan(report: PreflightReport, config: RunConfig, target) -> None:
    """The memory plan against the devices found (the smallest a rank uses, unless train.device_memory_gib is set),
    then each used device's free memory against the plan's peak (CUDA runs only; a CPU run's plan is recorded)."""
    from eyas.train.memory_plan import GIB, PlanDoesNotFit, check_run_plan, plan_fixes, run_plan  # imports torch

    if config.train.backend == "gloo":
        report.plan = run_plan(config, target).to_dict()
        return
    used = [r for r in report.devices if r["used"]]
    smallest = min(used, key=lambda r: r["memory_total_mib"], default=None)
    try:
        plan = check_run_plan(config, target, device_bytes_found=smallest["memory_total_mib"] * MIB if smallest else 0)
    except PlanDoesNotFit as err:
        if config.train.device_memory_gib:
            against = f" against train.device_memory_gib={config.train.device_memory_gib:g}"
        else:
            against = f" against {label(smallest)}, the smallest device a rank uses" if smallest else ""
        report.problems.append(f"memory plan{against}: {err}")
        return
    report.plan = plan.to_dict()
    for row in used:
        if row["busy"] or row["memory_free_mib"] is None or row["memory_free_mib"] * MIB >= plan.peak_bytes:
            continue  # a busy or unreadable device already has its problem
        fixes = plan_fixes(config, plan)
        if config.train.device_memory_gib * GIB > row["memory_total_mib"] * MIB:
            fixes.insert(0, f"train.device_memory_gib=0 (now {config.train.device_memory_gib:g}, more than this GPU)")
        report.problems.append(
            f"{label(row)}: {row['memory_free_mib'] * MIB / GIB:.1f} GiB free of {row['memory_total_mib'] * MIB / GIB:.1f} "
            f"GiB, expected at least the memory plan's peak of {plan.peak_bytes / GIB:.1f} GiB per device (micro-batches "
            f"of {plan.micro_batch_tokens:,} tokens); free the {row['memory_used_mib']} MiB in use, expose GPUs with "
            f"more memory via CUDA_VISIBLE_DEVICES, or shrink the plan: " + "; ".join(fixes)
        )


class PreflightFailed(RuntimeError):
    """A device the run needs is missing, unsuitable or busy, its plan does not fit, or an earlier launch is still
    running."""


def preflight_run(config: RunConfig, facts: RunFacts | None = None, *, found: dict | None = None) -> PreflightReport:
    """The stage entry before the smoke run and the gate: the run's devices, its memory plan on them (given its
    facts) and the process registry; raises PreflightFailed with every problem. `found`: the device query's
    result (queried when None)."""
    report = device_preflight(config.train, config.paths.train_dir, found)
    if facts is not None:
        check_plan(report, config, facts.target)
    if not report.ok:
        raise PreflightFailed("device preflight failed:\n" + "\n".join(f"- {p}" for p in report.problems))
    return report
