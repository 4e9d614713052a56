"""Why a training launch failed: each rank's own exception, recorded where the launcher finds it.

    record_failure(output_dir, exc)     # a rank, in its top-level `except`, before the process group goes
    first_failure(read_failures(output_dir))   # the launcher, after torchrun exited non-zero
    describe_failures(failures)                # "training failed on rank R of W (...): TYPE: MESSAGE [...]"

A rank that raises writes `output_dir/failures/rank-RRRRR.json` (rank, host, pid, the time to the
microsecond, the exception's type and its base classes, its message, where it was raised, the
traceback) before it leaves the process group, so its record is older than those of the ranks that
then lose their peer ("Connection closed by peer" in a collective). The launcher shows the oldest:
the first failing rank, the root cause. torchrun's own error files (`torch.distributed.elastic`'s
`@record`) time a failure to the second and torchrun picks the lowest rank among equal seconds,
which is often a rank that only saw its peer die; they are written as well (the traceback in
torchrun's summary in the log), but the launcher reads these. A rank killed by a signal (the
out-of-memory killer, torchrun stopping the others) writes no record.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from eyas.fsio import atomic_write_text

FAILURES_DIR = "failures"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding the eyas package


@dataclass(frozen=True)
class TrainerFailure:
    """One rank's exception. `kinds`: the exception's class and its bases, most specific first (a launcher
    decides with them whether another launch could end otherwise); `where`: the innermost frame."""

    rank: int
    world_size: int
    host: str
    pid: int
    time: float
    type: str
    kinds: list[str]
    message: str
    where: str
    traceback: str

    def is_a(self, *kinds: str) -> bool:
        return any(kind in self.kinds for kind in kinds)


def failure_path(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / FAILURES_DIR / f"rank-{rank:05d}.json"


def raised_at(exc: BaseException) -> str:
    """`path:line in function` of the frame that raised `exc` (paths inside this checkout relative to it)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "unknown"
    frame = frames[-1]
    path = Path(frame.filename)
    shown = path.relative_to(PACKAGE_ROOT) if path.is_relative_to(PACKAGE_ROOT) else path
    return f"{shown}:{frame.lineno} in {frame.name}"


def failure_of(exc: BaseException) -> TrainerFailure:
    """This process's record of `exc` (its rank and world size from torchrun's environment; 0 and 1 without)."""
    return TrainerFailure(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        host=socket.gethostname(),
        pid=os.getpid(),
        time=time.time(),
        type=type(exc).__name__,
        kinds=[cls.__name__ for cls in type(exc).__mro__],
        message=str(exc),
        where=raised_at(exc),
        traceback="".join(traceback.format_exception(exc)),
    )


def record_failure(output_dir: str | Path, exc: BaseException) -> Path:
    """Write this rank's record of `exc` (atomically: a launcher never reads half of one)."""
    failure = failure_of(exc)
    path = failure_path(Path(output_dir), failure.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(asdict(failure), indent=1))
    return path


def clear_failures(output_dir: str | Path) -> None:
    """Remove the records of an earlier launch (a launcher does, before it starts the ranks)."""
    folder = Path(output_dir) / FAILURES_DIR
    for path in folder.glob("rank-*.json") if folder.is_dir() else ():
        path.unlink()


def read_failures(output_dir: str | Path) -> list[TrainerFailure]:
    """The ranks' records, oldest first (equal times: lowest rank first). A record that does not parse is an
    error naming it: it holds the reason a person needs."""
    folder = Path(output_dir) / FAILURES_DIR
    failures = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else ():
        try:
            failures.append(TrainerFailure(**json.loads(path.read_text())))
        except (ValueError, TypeError) as e:
            raise ValueError(f"trainer failure record {path}: not a record eyas.train.failure writes ({e})") from e
    return sorted(failures, key=lambda f: (f.time, f.rank))


def first_failure(failures: list[TrainerFailure]) -> TrainerFailure | None:
    """The root cause: the oldest record (read_failures sorts them)."""
    return failures[0] if failures else None


def describe_failures(failures: list[TrainerFailure]) -> str:
    """What a failed launch says of its ranks' records (read_failures, not empty): the first failing rank, its
    exception and where it was raised, then the other ranks that failed (the launcher's message and eyas
    status's)."""
    first = failures[0]
    others = [f"rank {f.rank} ({f.type})" for f in failures[1:]]
    also = f"; later also {', '.join(others)}" if others else ""
    return (
        f"training failed on rank {first.rank} of {first.world_size} (the first to fail; {first.host}, pid "
        f"{first.pid}): {first.type}: {first.message} [raised at {first.where}]{also}"
    )
