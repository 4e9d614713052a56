"""Progress and artifact helpers shared by the tasks (Prefect artifacts + a rich bar in the terminal)."""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from eyas.status.stream import stream_brief, stream_progress
from tasks.retry import is_transient, log_to_run

SIDES_EVERY_S = 10.0  # a streamed run's other side is read from storage at most this often (a listing on S3)
LOG_INTERVAL_S = 30.0  # without a terminal, a progress line at most this often (and the first and the last)


class StageProgress:
    """A Prefect progress artifact, and a rich bar on a terminal or a log line at most every LOG_INTERVAL_S
    elsewhere (`make demo` piped, `kubectl logs`, the Prefect UI's log), fed by `eyas` progress callbacks.

    `done_key` / `total_key` name the fields of the callback's dict that measure progress. Updates to the server
    are throttled to one per `min_interval_s`. `terminal` None asks rich whether stdout is a terminal.
    """

    def __init__(
        self,
        key: str,
        title: str,
        done_key: str,
        total_key: str,
        min_interval_s: float = 1.0,
        *,
        terminal: bool | None = None,
        log_interval_s: float = LOG_INTERVAL_S,
    ):
        self.done_key, self.total_key, self.title = done_key, total_key, title
        self.min_interval_s, self.log_interval_s = min_interval_s, log_interval_s
        self.artifact_id = create_progress_artifact(progress=0.0, key=key, description=title)
        self.terminal = Console().is_terminal if terminal is None else terminal
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.bar_task = None
        self.last_sent = 0.0
        self.last_logged: float | None = None
        self.first: tuple[float, int] | None = None  # (time, done) of the first update

    def __enter__(self) -> "StageProgress":
        if self.terminal:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.terminal:
            self.bar.stop()

    def __call__(self, info: dict) -> None:
        done, total = info[self.done_key], max(1, info[self.total_key])
        now = time.monotonic()
        if self.first is None:
            self.first = (now, done)
        elif "eta_s" not in info and done > self.first[1]:  # from this launch's rate, when the callback gives none
            info = {**info, "eta_s": (now - self.first[0]) / (done - self.first[1]) * max(total - done, 0)}
        if self.terminal:
            if self.bar_task is None:
                self.bar_task = self.bar.add_task(self.title, total=total)
            self.bar.update(self.bar_task, completed=done, total=total)
        elif self.last_logged is None or now - self.last_logged >= self.log_interval_s or done >= total:
            log_to_run(self.describe(info))
            self.last_logged = now
        if now - self.last_sent >= self.min_interval_s or done >= total:
            self.send(100.0 * done / total, self.describe(info))
            self.last_sent = now

    def send(self, percent: float, description: str) -> None:
        """Update the artifact; a server that does not answer for a while costs a progress update (logged),
        not the hours of work the bar measures (the next update sends the current figures again)."""
        try:
            update_progress_artifact(self.artifact_id, progress=percent, description=description)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log_to_run(f"progress update of {self.title!r} not sent ({type(exc).__name__}: {exc}); continuing")

    def describe(self, info: dict) -> str:
        """The title with done/total of every counted quantity, the figures the callback gives (a `pass` name,
        step/total, loss, accuracy, estimated tau) and the ETA."""
        parts = [self.title + (f" ({info['pass']})" if info.get("pass") else "")]
        for name in ("step", "prompts", "shards", "samples", "tokens"):
            if f"{name}_done" in info and f"{name}_total" in info:
                parts.append(f"{name} {info[f'{name}_done']:,}/{info[f'{name}_total']:,}")
        if info.get("loss") is not None:
            parts.append(f"loss {info['loss']:.4f}")
        if info.get("acc_k"):
            parts.append("acc " + "/".join(f"{a:.2f}" for a in info["acc_k"]))
        if info.get("tau_estimate") is not None:
            parts.append(f"est. tau {info['tau_estimate']:.2f}")
        if info.get("tokens_per_s") is not None:
            parts.append(f"{info['tokens_per_s']:,.1f} tokens/s")
        if info.get("data_stall_fraction") is not None:  # the share of the step spent waiting for its input
            parts.append(f"data stall {info['data_stall_fraction']:.1%}")
        if info.get("eta_s") is not None:
            parts.append(f"ETA {info['eta_s']:.0f} s")
        if info.get("sides"):  # a streamed run: both sides (StreamSides)
            parts.append(info["sides"])
        return "; ".join(parts)


class StreamSides:
    """A progress callback that adds both sides of a streamed run (eyas.status.stream: shards extracted and
    verified, the trainer's step, its lead, the time waited, the wait now) under "sides", read from the run's
    durable files at most every `every_s` seconds; a run whose job is not streamed passes through unchanged.
    Wraps the producer's progress (updated on each of its polls, so a waiting trainer shows there) and the
    trainer's."""

    def __init__(self, train_dir: Path, progress, *, every_s: float = SIDES_EVERY_S):
        self.train_dir, self.progress, self.every_s = Path(train_dir), progress, every_s
        self.read_at: float | None = None
        self.brief = ""

    def __call__(self, info: dict) -> None:
        now = time.monotonic()
        if self.read_at is None or now - self.read_at >= self.every_s:
            status = stream_progress(self.train_dir)
            self.brief, self.read_at = (stream_brief(status) if status is not None else ""), now
        self.progress({**info, "sides": self.brief} if self.brief else info)


def table_artifact(key: str, rows: list[dict], description: str) -> None:
    create_table_artifact(key=key, table=rows, description=description)


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    create_markdown_artifact(key=key, markdown=markdown, description=description)


def png_artifact(key: str, figure, description: str) -> None:
    """A matplotlib figure as an inline image artifact (data URI)."""
    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    create_image_artifact(image_url=uri, key=key, description=description)
