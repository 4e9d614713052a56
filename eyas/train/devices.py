"""The CUDA devices torch sees, queried in a short subprocess that prints one JSON object and exits.

    python -m eyas.train.devices          # what `query_devices()` returns, as JSON

The flow process never initialises CUDA itself: a CUDA context there would hold memory on every device it
touched for the whole training run. The subprocess inherits CUDA_VISIBLE_DEVICES, so its `cuda:i` are the
devices torchrun's rank i will use. The object (the contract eyas.train.preflight reads):

    cuda_visible_devices  the variable as the subprocess saw it (None: unset, every GPU of the machine)
    torch, cuda           torch.__version__ and torch.version.cuda (None: a CPU-only build of torch)
    cuda_available        torch.cuda.is_available(); unavailable_reason: torch's warning when it is False
    nccl_available        torch.distributed.is_nccl_available(); nccl_version: "2.27.3" ("" without NCCL)
    devices               one row per visible device, in torch's order:
        device "cuda:0", name, capability "9.0", bf16 (capability >= 8.0), memory_total_mib,
        memory_free_mib (torch.cuda.mem_get_info), memory_used_mib (total - free, this query's own CUDA
        context of a few hundred MiB included); the memory fields are None where the query failed
    device_errors         {"cuda:i": torch's error} for devices whose memory could not be read
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

MIB = 1 << 20
QUERY_TIMEOUT_S = 120  # importing torch and creating a context per device; a hung driver must not hang the flow
BF16_CAPABILITY = (8, 0)  # Ampere and newer run bf16 natively


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every core of the machine
        return os.cpu_count() or 1


class DeviceQueryFailed(RuntimeError):
    """The subprocess that asks torch about the devices crashed, hung, or printed no JSON."""


def describe() -> dict:
    """What torch sees from this process (it initialises CUDA here: run it only in the query subprocess)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    found = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": available,
        "unavailable_reason": "" if available else " ".join(str(w.message) for w in caught).strip(),
        "nccl_available": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "nccl_version": "",
        "devices": [],
        "device_errors": {},
    }
    if found["nccl_available"]:
        version = torch.cuda.nccl.version()
        found["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    for index in range(torch.cuda.device_count() if available else 0):
        row, error = device_row(torch, index)
        found["devices"].append(row)
        if error:
            found["device_errors"][row["device"]] = error
    return found


def device_row(torch, index: int) -> tuple[dict, str]:
    """One visible device's row, and torch's error when its memory could not be read ("" otherwise)."""
    props = torch.cuda.get_device_properties(index)
    row = {
        "device": f"cuda:{index}",
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "bf16": (props.major, props.minor) >= BF16_CAPABILITY,
        "memory_total_mib": props.total_memory // MIB,
        "memory_free_mib": None,
        "memory_used_mib": None,
    }
    try:
        free, total = torch.cuda.mem_get_info(index)
    except RuntimeError as err:  # e.g. a GPU in exclusive-process mode held by another process
        return row, str(err).strip().splitlines()[0]
    row["memory_free_mib"], row["memory_used_mib"] = free // MIB, (total - free) // MIB
    return row, ""


def query_devices(*, timeout_s: float = QUERY_TIMEOUT_S) -> dict:
    """`describe()` from a subprocess of this interpreter with this environment (CUDA_VISIBLE_DEVICES included);
    raises DeviceQueryFailed with the subprocess's last error line when it fails."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "eyas.train.devices"]
    shown = f"`{' '.join(command)}`"
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DeviceQueryFailed(
            f"the device query {shown} did not finish within {timeout_s:g} s, expected a few seconds; the NVIDIA "
            f"driver may be hung: check `nvidia-smi`, then retry"
        ) from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise DeviceQueryFailed(
            f"the device query {shown} exited with {done.returncode} and no result, expected one JSON line: "
            f"{errors[-1] if errors else 'no error output'}; run it by hand to see the whole error (does torch "
            f"import in this environment?)"
        )
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        raise DeviceQueryFailed(
            f"the device query {shown} printed {lines[-1][:200]!r}, expected one JSON line; run it by hand to see "
            f"what else writes to its output"
        ) from None


if __name__ == "__main__":
    print(json.dumps(describe()))
