"""The machine: torch, CUDA and NCCL versions, the device and its free memory; and the repository's gpu-marked
tests, run by file (the other test files import prefect, which such a machine lacks)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import torch

from gpu_checks.runner import CheckContext
from gpu_checks.shapes import REPO

# the test files holding gpu-marked tests; test_bench_sglang and test_extract_sglang skip without sglang
GPU_TEST_FILES = ("tests/test_train_gpu.py", "tests/test_attention.py", "tests/test_bench_sglang.py",
                  "tests/test_extract_sglang.py")  # fmt: skip


def environment(ctx: CheckContext) -> dict:
    """Versions, the device's name, capability, memory and multiprocessors."""
    figures = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": ctx.device,
    }
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        figures.update(
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            device_name=props.name,
            device_count=torch.cuda.device_count(),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            total_memory_bytes=total,
            free_memory_bytes=free,
        )
    else:
        figures.update(device_name=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    for name, value in figures.items():
        ctx.log(f"  {name:20s} {value}")
    return figures


def pytest_counts(output: str) -> dict:
    """{outcome: count} from pytest's summary line ('2 passed, 3 skipped, 1 deselected in 4.1s')."""
    last = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ \w+.* in [\d.]+s", line)), "")
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed)", last)}


def gpu_tests(ctx: CheckContext) -> dict:
    """`pytest -m gpu` over GPU_TEST_FILES, in a process of its own, under what is left of the check's limit."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    path = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.subprocess_timeout())
    output = done.stdout + done.stderr
    ctx.log(output.rstrip())
    counts = pytest_counts(output)
    failures = []
    if done.returncode != 0:
        failures.append(f"pytest -m gpu exited {done.returncode}: {counts or output.strip().splitlines()[-1:]}")
    if ctx.device == "cuda" and not counts.get("passed"):
        failures.append(f"pytest -m gpu passed no test on a CUDA device: {counts}")
    return {"files": list(GPU_TEST_FILES), "returncode": done.returncode, "counts": counts, "failures": failures}
