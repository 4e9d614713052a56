"""The trainer's metric line: one JSON record per optimizer step, written and read only here.

Rank 0 appends each record to `output_dir/metrics.jsonl` and prints it to stdout as
`EYAS_METRIC {...}`, which the train task reads from torchrun's output to show progress. Keys: step,
epoch, samples_consumed, loss, loss_k, acc_k, lr, grad_norm, num_tokens, elapsed_s, sample_ids.
"""

from __future__ import annotations

import json
from pathlib import Path

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
