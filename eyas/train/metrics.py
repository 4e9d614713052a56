"""The trainer's metric line: one JSON record per optimizer step, written and read only here.

Rank 0 appends each record to `output_dir/metrics.jsonl` and prints it to stdout as
`EYAS_METRIC {...}`, which the train task reads from torchrun's output to show progress. Keys: step,
epoch, samples_consumed, loss, loss_k, acc_k, lr, grad_norm, num_tokens, elapsed_s, sample_ids.
A resumed run first cuts the file back to the checkpoint it resumed from (`truncate_metrics`): the steps
after it are trained again, so the file holds exactly one record per step after any number of resumes.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def read_metrics(path: Path) -> list[dict]:
    """Every complete record of metrics.jsonl in file order (a torn last line is left out)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the line a kill cut short
    return records


def truncate_metrics(output_dir: Path, step: int) -> int:
    """Keep the records of steps <= `step` (the checkpoint a run resumes from); returns how many were dropped."""
    path = Path(output_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    records = read_metrics(path)
    kept = [r for r in records if int(r.get("step", 0)) <= step]
    if len(kept) != len(records) or not path.read_text().endswith("\n") and path.stat().st_size:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)
