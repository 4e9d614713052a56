"""The trainer's metric line: one JSON record per optimizer step, written and read only here.

Rank 0 appends each record to `output_dir/metrics.jsonl` and prints it to stdout as
`EYAS_METRIC {...}`, which the train task reads from torchrun's output to show progress. Keys: step,
epoch, samples_consumed, loss, loss_k, acc_k, lr, grad_norm, num_tokens, elapsed_s, sample_ids, and the input's
stall: data_wait_s (seconds the step waited for its input, eyas.train.input_pipeline) and data_stall_fraction
(that wait over the step's wall time, from asking for the input to the reduced stats).
A run first cuts the file back to the checkpoint it resumed from (`truncate_metrics`): the steps
after it are trained again, so the file holds exactly one record per step after any number of resumes.
A line that is not a record (a write a kill cut short) is reported and cut there, so that appends go on
from a clean line; steps missing before the checkpoint (a file cut by hand) are reported too.
On several nodes global rank 0 may run on any node: the first node's launcher follows the file instead of its own
agent's output (`MetricsFollower`).
"""

from __future__ import annotations

import contextvars
import json
import threading
from pathlib import Path
from typing import Callable

from eyas.fsio import atomic_write_text

METRIC_PREFIX = "EYAS_METRIC "
METRICS_FILE = "metrics.jsonl"
METRICS_TAIL_BYTES = 256 << 10


def emit_metrics(record: dict, output_dir: Path) -> None:
    """Append the record to metrics.jsonl and print it as a metric line."""
    line = json.dumps(record)
    with open(Path(output_dir) / METRICS_FILE, "a") as f:
        f.write(line + "\n")
    print(METRIC_PREFIX + line, flush=True)


def parse_metric_line(line: str) -> dict | None:
    """The record of a metric line of the trainer's output; None for any other line."""
    if not line.startswith(METRIC_PREFIX):
        return None
    return json.loads(line[len(METRIC_PREFIX) :])


def last_metrics(path: Path) -> dict | None:
    """The newest complete line of metrics.jsonl (a crash can cut the last one short)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - METRICS_TAIL_BYTES))
        tail = f.read()
    for line in reversed(tail.splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def scan_metrics(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """(every record of metrics.jsonl in file order, the lines that are not records: (line number, text))."""
    records, torn = [], []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        else:
            torn.append((number, line))
    return records, torn


def torn_line_message(path: Path, number: int, line: str, verb: str) -> str:
    shown = line if len(line) <= 60 else line[:60] + "..."
    return f"{path} line {number}: not a metric record ({len(line)} characters: {shown!r}), {verb}"


def read_metrics(path: Path) -> list[dict]:
    """Every record of metrics.jsonl in file order; a line that is not one (a kill cut it short) is left out and
    reported."""
    records, torn = scan_metrics(path)
    for number, line in torn:
        print(torn_line_message(Path(path), number, line, "left out"), flush=True)
    return records


def truncate_metrics(output_dir: Path, step: int) -> int:
    """Keep the records of steps <= `step` (the checkpoint a run resumes from, 0 for a fresh start) and cut every
    line that is not a record, each reported; a gap before `step` (records that were lost) is reported too.
    Returns how many records were dropped."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    records, torn = scan_metrics(path)
    kept = [r for r in records if int(r["step"]) <= step]
    for number, line in torn:
        print(torn_line_message(path, number, line, "cut (a write a kill interrupted)"), flush=True)
    last = max((int(r["step"]) for r in kept), default=0)
    if last < step:
        print(
            f"{path}: records end at step {last} but the run resumes from step {step}: "
            f"{f'steps {last + 1}-{step} have' if step > last + 1 else f'step {step} has'} no records (the file was "
            "cut or torn), so the loss curve has a gap there",
            flush=True,
        )
    text = path.read_bytes()
    if len(kept) != len(records) or torn or text and not text.endswith(b"\n"):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


class MetricsFollower:
    """Hands every record appended to RUN/train/metrics.jsonl to `on_metric` while a launch runs (a thread reading
    new lines every `poll_s`); records already there when it starts are not handed on. A resumed launch cuts the
    file back to its checkpoint (eyas.train.metrics.truncate_metrics): the follower then reads on from the cut."""

    def __init__(self, train_dir: Path, on_metric: Callable[[dict], None], *, poll_s: float = 1.0):
        self.path, self.on_metric, self.poll_s = Path(train_dir) / METRICS_FILE, on_metric, poll_s
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.stopped = threading.Event()
        context = contextvars.copy_context()  # the caller's (a task run's logger and client) in the thread too
        self.thread = threading.Thread(
            target=context.run, args=(self._follow,), name="eyas-metrics-follower", daemon=True
        )

    def __enter__(self) -> "MetricsFollower":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
        self.read_new()  # what the last step appended after the last poll

    def _follow(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self.read_new()

    def read_new(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < self.offset:  # cut back by a resumed launch
                self.offset = size
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:  # a line a killed rank tore: the next launch cuts it (truncate_metrics)
                print(f"{self.path}: not a metric record, not followed: {line[:120]!r}", flush=True)
                continue
            if record is not None:
                self.on_metric(record)
