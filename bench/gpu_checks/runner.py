"""The plan of checks and how it runs: each check has its own time budget, the run stops starting checks past a
deadline, and every check's outcome (figures, failure or skip, and why) is recorded.

    results = run_checks(PLAN, context, stop_after_s=510)
    results["environment"] == {"status": "passed", "seconds": 2.1, "budget_s": 15, "figures": {...}}

A check is a function of the CheckContext returning its figures (a dict); a figure `failures` (a list of
sentences) that is not empty marks it failed, as does an exception, which is recorded with its traceback's last
lines. A check runs under a time limit of its budget (SIGALRM raises CheckTimedOut inside it); a check whose budget does
not fit in what is left before the deadline is skipped.
"""

from __future__ import annotations

import signal
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


class CheckTimedOut(Exception):
    """A check ran past its time limit."""


@dataclass(frozen=True)
class Check:
    name: str
    budget_s: float  # on a GPU at the real shape
    quick_budget_s: float  # --quick: tiny shapes
    run: Callable[["CheckContext"], dict]
    what: str

    def budget(self, quick: bool) -> float:
        return self.quick_budget_s if quick else self.budget_s


@dataclass
class CheckContext:
    """What a check runs with: the device, the size (quick: tiny shapes), a scratch folder and the log."""

    device: str  # cuda | cpu
    quick: bool
    work: Path  # scratch: removed after the run
    log: Callable[[str], None] = print
    ends_at: float = float("inf")  # time.monotonic() when this check's limit is reached
    partial: dict = field(default_factory=dict)  # figures so far: kept when the check fails or is stopped

    def seconds_left(self) -> float:
        return self.ends_at - time.monotonic()

    def subprocess_timeout(self, margin_s: float = 2.0) -> float:
        """A child process's timeout: what is left of the check's limit, less a margin to record the outcome."""
        return max(min(self.seconds_left() - margin_s, 3600.0), 1.0)


@contextmanager
def time_limit(seconds: float, name: str):
    """Raise CheckTimedOut in the block once `seconds` have passed (main thread only: SIGALRM)."""

    def expired(signum, frame):
        raise CheckTimedOut(f"check {name}: still running after its limit of {seconds:.0f} s; stopped")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def error_lines(exc: BaseException, limit: int = 6) -> list[str]:
    """The exception and the last frames that raised it, as lines for the JSON."""
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).rstrip().splitlines()
    return text[-limit:] if len(text) > limit else text


def run_one(check: Check, ctx: CheckContext, limit_s: float) -> dict:
    """Run a check under its limit; its result (status, seconds, figures, error)."""
    started = time.monotonic()
    ctx.ends_at, ctx.partial = started + limit_s, {}
    ctx.log(f"--- {check.name}: {check.what} (limit {limit_s:.0f} s)")
    result: dict = {"budget_s": check.budget(ctx.quick), "limit_s": round(limit_s, 1)}
    try:
        with time_limit(limit_s, check.name):
            figures = check.run(ctx)
        failures = figures.get("failures", [])
        result.update(status=FAILED if failures else PASSED, figures=figures)
    except Exception as exc:  # recorded for the JSON, and the run goes on to the next check
        result.update(status=FAILED, error=error_lines(exc))
        if ctx.partial:
            result["partial_figures"] = dict(ctx.partial)
        ctx.log("\n".join(result["error"]))
    result["seconds"] = round(time.monotonic() - started, 2)
    ctx.log(f"--- {check.name}: {result['status']} in {result['seconds']} s")
    return result


def run_checks(checks: list[Check], ctx: CheckContext, *, stop_after_s: float, only: set[str] | None = None) -> dict:
    """Every check in order, each under its budget; a check whose budget no longer fits in the time left before
    `stop_after_s` from now is skipped (recorded with why), as is one `only` leaves out."""
    start, results = time.monotonic(), {}
    for check in checks:
        budget, left = check.budget(ctx.quick), stop_after_s - (time.monotonic() - start)
        if only is not None and check.name not in only:
            results[check.name] = {"status": SKIPPED, "reason": f"not among --only {sorted(only)}"}
        elif budget > left:
            reason = f"its budget of {budget:.0f} s does not fit in the {max(left, 0):.0f} s left before the deadline"
            results[check.name] = {"status": SKIPPED, "reason": reason, "budget_s": budget}
            ctx.log(f"--- {check.name}: skipped, {reason}")
        else:
            results[check.name] = run_one(check, ctx, budget)
    return results
