"""Train an EAGLE-3 draft on extracted hidden-state shards, with DDP or FSDP2 (gloo on CPU, nccl on GPUs).

Usage:
    torchrun --nproc_per_node=2 -m eyas.train --config job.json
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=RUN
        -m eyas.train --config job.json           # one line, the same on every node (train.num_nodes)
    python -m eyas.train --config job.json        # one process, no torchrun needed

`job.json` is an `eyas.config.TrainJob` (written by eyas.train.launch). What a rank does is
eyas.train.trainer; this module is the process around it: the job file, the process group, dying
with the launcher, a record of the exception a rank fails with (eyas.train.failure: the launcher
shows the first failing rank's), and a clean exit.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from eyas.config import TrainJob
from eyas.train.failure import record_failure
from eyas.train.parallel import init_distributed
from eyas.train.trainer import train

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def load_job(path: str | Path) -> TrainJob:
    """The TrainJob in a JSON file (strict: an unknown field is an error)."""
    return TrainJob.model_validate_json(Path(path).read_text())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eyas.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainJob JSON (eyas.config.TrainJob)")
    return parser.parse_args(argv)


def die_with_launcher() -> None:
    """Under torchrun (Linux), have the kernel SIGKILL this worker when the launcher dies.

    torchrun starts each worker in a session of its own, so killing the launcher (a cancelled
    flow, `kill -9`) would otherwise leave orphans that go on training and hold their GPUs.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG, SIGKILL) failed for the eyas.train worker")
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def failure_recorded(output_dir: str):
    """An exception leaving the block is recorded for the launcher (eyas.train.failure) and in torchrun's own
    error file (TORCHELASTIC_ERROR_FILE: its summary in the log then shows the traceback), then raised."""
    errors = get_error_handler()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: a fatal signal's traceback goes to the log too
        errors.initialize()
    try:
        yield
    except Exception as exc:
        record_failure(output_dir, exc)
        errors.record_exception(exc)
        raise


def main(argv: list[str] | None = None) -> int:
    job = load_job(parse_args(argv).config)
    die_with_launcher()
    with failure_recorded(job.output_dir):
        ctx = init_distributed(job.train.backend, job.train.collective_timeout_s)
    try:
        # recorded before this rank leaves the process group: the ranks that fail only because it left come later
        with failure_recorded(job.output_dir):
            train(job, ctx)
    finally:
        dist.destroy_process_group()
    return 0


def exit_without_finalizing(code: int) -> None:
    """Leave at once after a finished run, skipping interpreter finalization.

    A gloo worker thread can still be dropping the last reference to a finished collective (whose tensors
    are Python objects) when the main thread returns; if Python is finalizing by then, the thread aborts the
    process (SIGABRT, "terminate called without an active exception"; 4 of 90 two-rank runs on a loaded
    2-core machine, none of 90 with this exit). Everything the trainer writes is durable before this
    point; stdio is flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalizing(main())  # an exception raised by main() propagates as usual
