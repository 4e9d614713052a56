"""tasks.reporting.StageProgress: a rich bar on a terminal; elsewhere a log line at most every 30 s, with the
figures the stage gives (step/total, loss, accuracy, estimated tau, tokens/s, data stall, ETA), against a real server."""

from __future__ import annotations

import logging

import pytest

import tasks.reporting as reporting
from tasks.reporting import StageProgress


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(reporting.time, "monotonic", clock)
    return clock


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("training")]


def test_without_a_terminal_a_line_every_30_seconds_and_the_last(prefect_server, clock, caplog):
    caplog.set_level(logging.INFO)
    with StageProgress("test-progress", "training", "step_done", "step_total", terminal=False) as progress:
        for step in range(1, 101):  # one step a second
            clock.now += 1.0
            progress(
                {
                    "step_done": step,
                    "step_total": 100,
                    "loss": 5.0 - step / 100,
                    "acc_k": [0.5, 0.25],
                    "tau_estimate": 1.8 if step > 10 else None,
                    "tokens_per_s": 1234.5,
                    "data_stall_fraction": 0.0123,
                }
            )
    lines = progress_lines(caplog)
    assert len(lines) == 5  # steps 1, 31, 61, 91 and the last
    assert lines[1] == (
        "training; step 31/100; loss 4.6900; acc 0.50/0.25; est. tau 1.80; 1,234.5 tokens/s; data stall 1.2%; ETA 69 s"
    )
    assert lines[-1].startswith("training; step 100/100;") and lines[-1].endswith("ETA 0 s")
    assert progress.bar_task is None  # no bar drawn into a log


def test_on_a_terminal_a_bar_and_no_log_lines(prefect_server, clock, caplog):
    caplog.set_level(logging.INFO)
    with StageProgress("test-progress", "training", "step_done", "step_total", terminal=True) as progress:
        for step in range(1, 4):
            clock.now += 40.0
            progress({"step_done": step, "step_total": 3})
    assert progress_lines(caplog) == []
    assert progress.bar.tasks[0].completed == 3 and progress.bar.tasks[0].total == 3
