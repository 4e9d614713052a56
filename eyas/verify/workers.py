"""How shard verification spreads over the cores: threads, processes or one thread, by what the work holds.

    rows, workers = run_batches(verify_batch, names, holds_gil=True, num_workers=0, on_batch=report)

`verify_batch(names) -> rows` is called on contiguous batches of `names`; the rows come back in order, and
`workers` says what ran them ("one thread", "2 threads", "2 processes").
- Work that releases the GIL (full mode: preads, XXH3 and numpy over 512 KiB chunks) or waits on the network
  (cheap mode over S3 range requests) runs on threads, `num_workers` of them (0 = one per usable core).
- Work that holds it (cheap mode over local files: about 80 us of Python a shard for the JSON header, the
  metadata and the layout) never runs on threads. Each open and pread releases the GIL, the other thread takes
  it, and the two then take turns at the interpreter's switch interval: 2 threads verified 40,000 headers in
  6.3 s where one took 3.2 s. So the first batch is timed on one thread; when the rest would take that thread
  longer than PROCESS_MIN_S (which covers the pool's start and the rows' trip back), fork is available and
  more than one core is usable, the rest runs on forked processes, one per usable core (at most
  `num_workers`). They inherit `verify_batch` and everything it closes over: only the names go out and only
  the rows come back through pipes. Otherwise the rest runs on the same thread.
  Usable cores are not free cores: when other work holds them (and the kernel shares the CPU between sessions,
  not processes), the processes run no faster than one thread and their start-up and pickling are a loss. So
  their rate over the first rounds of batches, start-up included, is compared with the one-thread rate: below
  PROCESS_GAIN times it, the batches in flight are collected and the rest runs on this thread.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Callable, TypeVar

Row = TypeVar("Row")
VerifyBatch = Callable[[list[str]], list[Row]]

PROCESS_MIN_S = 0.5  # below this much one-thread work left, a process pool's start-up and pickling cost more
PROCESS_GAIN = 1.2  # processes must beat one thread by this factor over their first rounds, or one thread goes on
FIRST_BATCH = 512  # names timed on one thread before choosing (about 40 ms of headers)
PROCESS_BATCH = 1024  # names a process takes at a time (about 0.1 s of headers)
ONE_THREAD_BATCH = 1024  # names between progress reports on one thread

_inherited: VerifyBatch | None = None  # a forked worker's verify_batch, set by its initializer, never pickled


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def choose_workers(
    *, holds_gil: bool, num_workers: int, cores: int, seconds_left: float, fork: bool
) -> tuple[str, int]:
    """("one thread" | "threads" | "processes", how many) for work that does or does not hold the GIL, with
    `seconds_left` of it measured on one thread."""
    if num_workers < 0:
        raise ValueError(f"verify num_workers={num_workers}: expected >= 0 (0 = one per usable core)")
    wanted = num_workers or cores
    if wanted == 1:
        return "one thread", 1
    if not holds_gil:
        return "threads", wanted
    processes = min(wanted, cores)
    if fork and processes > 1 and seconds_left > PROCESS_MIN_S:
        return "processes", processes
    return "one thread", 1


def run_batches(
    verify_batch: VerifyBatch,
    names: list[str],
    *,
    holds_gil: bool,
    num_workers: int = 0,
    on_batch: Callable[[list[Row]], None] | None = None,
) -> tuple[list[Row], str]:
    """Every name's row, in order, and what ran them; `on_batch(rows so far)` after each batch."""
    rows: list[Row] = []

    def take(done: list[Row]) -> None:
        rows.extend(done)
        if on_batch is not None:
            on_batch(rows)

    if not names:
        return rows, "one thread"
    rest, seconds_left, rate = names, float("inf"), 0.0
    if holds_gil:
        t0 = time.perf_counter()
        take(verify_batch(names[:FIRST_BATCH]))
        rest = names[FIRST_BATCH:]
        rate = len(rows) / max(time.perf_counter() - t0, 1e-9)
        seconds_left = len(rest) / rate
    how, count = choose_workers(holds_gil=holds_gil, num_workers=num_workers, cores=usable_cores(),
                                seconds_left=seconds_left, fork=can_fork())  # fmt: skip
    if how == "processes":
        rest = _on_processes(verify_batch, rest, count, rate, take)
        if not rest:
            return rows, f"{count} processes"
        how = "one thread (processes were slower)"
    if how.startswith("one thread"):
        for i in range(0, len(rest), ONE_THREAD_BATCH):
            take(verify_batch(rest[i : i + ONE_THREAD_BATCH]))
        return rows, how
    # a few contiguous batches per thread: few hand-offs for tiny shards, balanced for big ones
    size = max(1, min(64, len(rest) // (4 * count)))
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="verify") as pool:
        for done in pool.map(verify_batch, [rest[i : i + size] for i in range(0, len(rest), size)]):
            take(done)
    return rows, f"{count} threads"


def _on_processes(
    verify_batch: VerifyBatch, names: list[str], count: int, one_thread_rate: float, take: Callable[[list], None]
) -> list[str]:
    """Verify `names` on `count` forked processes, two batches in flight each, rows taken in order. Once the first
    two rounds are back, no more batches are handed out when they ran below PROCESS_GAIN x `one_thread_rate`
    (names/s, start-up included). Returns the names no process was given."""
    size = max(1, min(PROCESS_BATCH, len(names) // (4 * count)))
    batches = [names[i : i + size] for i in range(0, len(names), size)]
    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(count, mp_context=fork, initializer=_inherit, initargs=(verify_batch,)) as pool:
        t0 = time.perf_counter()
        in_flight = deque(pool.submit(_run_inherited, b) for b in batches[: 2 * count])
        handed, last, done_names, judged = len(in_flight), len(batches), 0, False
        while in_flight:
            done = in_flight.popleft().result()
            take(done)
            done_names += len(done)
            if not judged and done_names >= 2 * count * size:
                judged = True
                if done_names / (time.perf_counter() - t0) < PROCESS_GAIN * one_thread_rate:
                    last = handed  # other work holds the cores: what is not handed out yet stays on this thread
            if handed < last:
                in_flight.append(pool.submit(_run_inherited, batches[handed]))
                handed += 1
    return [n for b in batches[handed:] for n in b]


def _inherit(verify_batch: VerifyBatch) -> None:
    """A forked worker's start: keep `verify_batch`, and move every object inherited from the parent out of the
    collector's sight (a full collection would otherwise walk and write to all of them, copying the parent's
    heap page by page: 40,000 headers took 6 s on 2 processes with it, 2.7 s without)."""
    global _inherited
    _inherited = verify_batch
    gc.freeze()


def _run_inherited(names: list[str]) -> list:
    return _inherited(names)
