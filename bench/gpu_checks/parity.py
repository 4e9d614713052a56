"""DDP and FSDP2 at world size 1 on the device against the CPU: the repository's tiny run (tests/run_fixtures.py)
trained by eyas's Trainer for a few steps on a one-process group (nccl on CUDA), against `python -m eyas.train`
on the CPU (gloo, fp32) in a process of its own. fp32 (mixed_precision off): every tensor of the final weights
within a relative error of 1e-4 (max |a - b| / max |b|, as tests/test_attention.py measures); bf16 autocast: the
loss gap per step is reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from gpu_checks.runner import CheckContext
from gpu_checks.shapes import REPO, sizes

sys.path.insert(0, str(REPO / "tests"))

from run_fixtures import tiny_job, write_tiny_run  # noqa: E402

from eyas.train.checkpoint import latest_complete  # noqa: E402
from eyas.train.metrics import METRICS_FILE  # noqa: E402
from eyas.train.parallel import Dist  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402

FP32_TOLERANCE = 1e-4


@contextmanager
def one_process_group(device: torch.device):
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Dist(rank=0, world=1, device=device)
    finally:
        dist.destroy_process_group()


def outcome(job) -> tuple[dict, list[float]]:
    """The final checkpoint's weights (float32) and the loss of every step."""
    weights = load_file(latest_complete(job.output_dir) / "model.safetensors")
    lines = (Path(job.output_dir) / METRICS_FILE).read_text().splitlines()
    return {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, [
        json.loads(line)["loss"] for line in lines
    ]


def cpu_reference(run: dict, ctx: CheckContext, steps: int):
    """`python -m eyas.train` on the CPU (gloo, fp32, one process)."""
    job = tiny_job(run, ctx.work / "parity-cpu", num_processes=1, max_steps=steps, mixed_precision="off")
    path = ctx.work / "parity-cpu.json"
    path.write_text(job.model_dump_json())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    cmd = [sys.executable, "-m", "eyas.train", "--config", str(path)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.subprocess_timeout())
    if done.returncode != 0:
        raise RuntimeError(f"the CPU reference run exited {done.returncode}:\n{done.stderr[-2000:]}")
    return outcome(job)


def relative_errors(weights: dict, reference: dict) -> dict:
    """{tensor: max |a - b| / max |b|} over the reference's tensors."""
    return {
        name: float((weights[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        for name, ref in reference.items()
        if ref.is_floating_point()
    }


def parity(ctx: CheckContext) -> dict:
    steps, device = sizes(ctx.quick).parity_steps, torch.device(ctx.device)
    run = write_tiny_run(ctx.work / "parity-run", num_samples=16)
    reference, reference_losses = cpu_reference(run, ctx, steps)
    backend = "nccl" if device.type == "cuda" else "gloo"
    figures, failures = {"steps": steps, "cpu_losses": reference_losses}, []
    # bf16 autocast is CUDA only (eyas.train.step.use_bf16): the CPU (--quick) runs fp32 alone
    precisions = {"fp32": "off", "bf16": "bf16"} if device.type == "cuda" else {"fp32": "off"}
    for parallelism in ("ddp", "fsdp2"):
        for label, precision in precisions.items():
            out = ctx.work / f"parity-{parallelism}-{label}"
            job = tiny_job(run, out, backend=backend, num_processes=1, max_steps=steps, parallelism=parallelism,
                           mixed_precision=precision)  # fmt: skip
            with one_process_group(device) as rank:
                Trainer(job, rank).run()
            weights, losses = outcome(job)
            key = f"{parallelism}_{label}"
            if label == "fp32":
                errors = relative_errors(weights, reference)
                worst = max(errors, key=errors.get)
                figures[f"{key}_max_rel_error"], figures[f"{key}_worst_tensor"] = errors[worst], worst
                if errors[worst] > FP32_TOLERANCE:
                    failures.append(f"{parallelism} fp32 on {device}: {worst} is {errors[worst]:.2e} from the CPU run's "
                                    f"(relative), expected <= {FP32_TOLERANCE}")  # fmt: skip
            else:
                figures[f"{key}_losses"] = losses
                figures[f"{key}_loss_gap"] = [
                    abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True)
                ]
    figures["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    ctx.log(f"  {figures}")
    return {**figures, "failures": failures}
