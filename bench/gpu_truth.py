"""What eyas does on a GPU, measured in one prepared run of at most 9 minutes on one H100/H200.

Usage (scripts/gpu_wheels.py prepares the packages such a machine lacks and prints the device command):
    python3 bench/gpu_truth.py --out "$OUT"             # CUDA, the Kimi-K2.5 draft's shape
    .venv/bin/python bench/gpu_truth.py --quick          # every check at tiny shapes on the CPU (seconds)

Checks, in order, each under its own time budget (runner.py; none is started past --stop-after-s, 510 s):
1. environment: torch, CUDA and NCCL versions, the device, its free memory.
2. gpu_tests: the repository's gpu-marked tests (pytest -m gpu over the files that hold them).
3. decode: the draft's KV-cached decoding on the device against the uncached path and the CPU (decode.py).
4. parity: DDP and FSDP2 at world size 1 on the device against a CPU run: fp32 weights, bf16 loss gap (parity.py).
5. memory: peak memory at the Kimi draft's shape for several (micro-batch, length) points against the memory
   plan, out-of-memory caught (memory.py).
6. speed: the trainer against a bare loop at the Kimi draft's shape; tokens/s and MFU (speed.py).

Writes gpu-truth.json (every check's status, seconds, figures or error; what was skipped and why) and
gpu-truth.log (everything the checks printed) under --out; prints a table, and as its last line one JSON object
of the headline figures. Exit status 1 when a check failed; 2 without a CUDA device (full run) or a usable --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # eyas, where the project is not installed

from gpu_checks.decode import decode  # noqa: E402
from gpu_checks.environment import environment, gpu_tests  # noqa: E402
from gpu_checks.memory import memory  # noqa: E402
from gpu_checks.parity import parity  # noqa: E402
from gpu_checks.runner import FAILED, SKIPPED, Check, CheckContext, run_checks  # noqa: E402
from gpu_checks.speed import speed  # noqa: E402

STOP_AFTER_S = 510  # no check starts past 8.5 minutes; the budgets below add up to it
PLAN = [
    Check("environment", 15, 30, environment, "torch, CUDA, NCCL, the device and its memory"),
    Check("gpu_tests", 75, 120, gpu_tests, "the gpu-marked tests"),
    Check("decode", 40, 120, decode, "KV-cached draft decoding against the uncached path and the CPU"),
    Check("parity", 80, 180, parity, "DDP and FSDP2 at world size 1 against the CPU"),
    Check("memory", 130, 180, memory, "peak memory at the Kimi draft's shape against the memory plan"),
    Check("speed", 170, 180, speed, "the trainer against a bare loop at the Kimi draft's shape; MFU"),
]
JSON_FILE, LOG_FILE = "gpu-truth.json", "gpu-truth.log"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/gpu_truth.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="output folder (default: $OUT)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, seconds; on the CPU unless --device cuda")
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda, or cpu with --quick")
    ap.add_argument("--stop-after-s", type=float, default=STOP_AFTER_S, help="no check starts after this")
    ap.add_argument("--only", nargs="+", choices=[c.name for c in PLAN], help="run only these checks")
    args = ap.parse_args(argv)
    args.device = args.device or ("cpu" if args.quick else "cuda")
    return args


def refusal(args: argparse.Namespace) -> str | None:
    """Why the run cannot start, in one line (None: it can)."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return (f"gpu_truth: no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda}); run it "
                "on a GPU machine, or with --quick for every check at tiny shapes on the CPU")  # fmt: skip
    if args.device == "cpu" and not args.quick:
        return "gpu_truth: --device cpu runs only with --quick (the Kimi draft's shape needs a GPU)"
    if not args.quick and not args.out:
        return "gpu_truth: no output folder: pass --out DIR or set $OUT"
    return None


def headline(results: dict) -> dict:
    """The figures of the last line: what failed and was skipped, and the numbers the issue asks for."""

    def figure(check: str, *keys):
        value = results.get(check, {}).get("figures", {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    return {
        "checks_failed": sorted(n for n, r in results.items() if r["status"] == FAILED),
        "checks_skipped": sorted(n for n, r in results.items() if r["status"] == SKIPPED),
        "device_name": figure("environment", "device_name"),
        "gpu_tests": figure("gpu_tests", "counts"),
        "kv_cache_rounds_equal": figure("decode", "fp32_cached_equals_uncached_rounds"),
        "ddp_fp32_max_rel_error": figure("parity", "ddp_fp32_max_rel_error"),
        "fsdp2_fp32_max_rel_error": figure("parity", "fsdp2_fp32_max_rel_error"),
        "peak_vs_plan_max": figure("memory", "peak_vs_plan_max"),
        "tokens_per_s": figure("speed", "tokens_per_s"),
        "trainer_vs_bare": figure("speed", "trainer_vs_bare"),
        "mfu": figure("speed", "mfu"),
        "mfu_vs_gemm": figure("speed", "mfu_vs_gemm"),
    }


def table(results: dict) -> str:
    lines = [f"{'check':12s} {'status':8s} {'seconds':>8s}  note"]
    for name, r in results.items():
        note = r.get("reason") or (
            r["error"][-1] if r.get("error") else "; ".join(r.get("figures", {}).get("failures", []))
        )
        lines.append(f"{name:12s} {r['status']:8s} {r.get('seconds', 0):8.1f}  {note[:100]}")
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(out / LOG_FILE, "w") as log, tempfile.TemporaryDirectory(prefix="gpu-truth-") as work:

        def say(line: str) -> None:
            print(line, file=log, flush=True)
            print(line, file=sys.__stdout__, flush=True)

        ctx = CheckContext(device=args.device, quick=args.quick, work=Path(work), log=say)
        with contextlib.redirect_stdout(log):  # the trainer's own lines go to the log only
            results = run_checks(PLAN, ctx, stop_after_s=args.stop_after_s, only=set(args.only) if args.only else None)
    summary = headline(results)
    report = {"quick": args.quick, "device": args.device, "started_unix": started,
              "elapsed_s": round(time.time() - started, 1), "stop_after_s": args.stop_after_s, **summary,
              "checks": results}  # fmt: skip
    (out / JSON_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table(results))
    print(f"wrote {out / JSON_FILE} and {out / LOG_FILE}")
    print(json.dumps(summary, default=str))
    return 1 if summary["checks_failed"] else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = refusal(args)
    if why:
        print(why, file=sys.stderr)
        return 2
    if args.out:
        return run(args, Path(args.out))
    with tempfile.TemporaryDirectory(prefix="gpu-truth-out-") as out:  # --quick without a folder: nothing stays
        return run(args, Path(out))


if __name__ == "__main__":
    sys.exit(main())
