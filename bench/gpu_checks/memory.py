"""Peak memory of training steps at the Kimi draft's shape against the memory plan (eyas.train.memory_plan), for
several (micro-batch, length) points, DDP and FSDP2, and once with the allocator's expandable segments. Each point
runs `python -m eyas.train.peak_memory CASE` in a process of its own (two optimizer steps; an out-of-memory error
ends only that process) and is held against the plan for the same shape and the device's memory: a point the
plan says fits must not run out of memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import torch

from eyas.train.memory_plan import GIB, PlanShape, device_bytes, plan_memory
from gpu_checks.runner import CheckContext
from gpu_checks.shapes import REPO, MemoryPoint, kimi_config, sizes

MIN_POINT_S = 20  # a point is not started with less than this left of the check's limit (on a GPU)


def point_case(point: MemoryPoint, ctx: CheckContext) -> dict:
    """The case eyas.train.peak_memory runs: the sizes' draft, bf16 autocast on CUDA, the preset's unroll."""
    s, train = sizes(ctx.quick), kimi_config().train
    return {
        **s.arch.to_dict(),
        "lengths": [point.length] * point.batch,
        "parallelism": point.parallelism,
        "device": ctx.device,
        "bf16": ctx.device == "cuda",
        "attention": "fused",
        "num_ttt_steps": train.num_ttt_steps,
        "checkpointing": train.activation_checkpointing,
        "encoding": asdict(s.encoding),
    }


def planned(point: MemoryPoint, ctx: CheckContext) -> dict:
    """The plan's peak for the point (one micro-batch of the point's samples) and whether it fits the device."""
    s, case = sizes(ctx.quick), point_case(point, ctx)
    shape = PlanShape(arch=s.arch, num_ttt_steps=case["num_ttt_steps"], bf16=case["bf16"],
                      parallelism=point.parallelism, world=1, checkpointing=case["checkpointing"],
                      encoding=s.encoding, longest_sample=point.length,
                      share_tokens=point.batch * point.length)  # fmt: skip
    plan = plan_memory(shape, shape.share_tokens, device_bytes(torch.device(ctx.device)))
    return {"planned_bytes": plan.peak_bytes, "plan_fits": plan.fits, "device_bytes": plan.device_bytes}


def run_point(point: MemoryPoint, ctx: CheckContext) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if point.expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = [sys.executable, "-m", "eyas.train.peak_memory", json.dumps(point_case(point, ctx))]
    result = {"point": point.name, **planned(point, ctx)}
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=ctx.subprocess_timeout())
    except subprocess.TimeoutExpired:
        return {**result, "oom": False, "timed_out": True}
    if done.returncode == 0:
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        result.update(measured_bytes=measured["measured_bytes"], oom=False)
        result["measured_vs_planned"] = measured["measured_bytes"] / result["planned_bytes"]
    elif "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr:
        result.update(oom=True)
    else:
        raise RuntimeError(f"memory point {point.name} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return result


def memory(ctx: CheckContext) -> dict:
    points, results, skipped, failures = sizes(ctx.quick).memory_points, [], [], []
    for point in points:
        if results and results[-1].get("timed_out") or not ctx.quick and ctx.seconds_left() < MIN_POINT_S:
            skipped.append(point.name)
            continue
        result = run_point(point, ctx)
        results.append(result)
        if result.get("timed_out"):
            ctx.log(f"  {point.name:32s} stopped at the check's limit")
            continue
        shown = f"{result['measured_bytes'] / GIB:.2f} GiB" if not result["oom"] else "out of memory"
        ctx.log(f"  {point.name:32s} measured {shown:>14s}, planned {result['planned_bytes'] / GIB:.2f} GiB "
                f"({'fits' if result['plan_fits'] else 'does not fit'} the device)")  # fmt: skip
        if result["oom"] and result["plan_fits"]:
            failures.append(f"{point.name}: ran out of memory where the plan says it fits")
    ratios = [r["measured_vs_planned"] for r in results if "measured_vs_planned" in r]
    return {
        "points": results,
        "skipped_points": skipped,
        "peak_vs_plan_max": max(ratios, default=None),
        "peak_vs_plan_min": min(ratios, default=None),
        "failures": failures,
    }
