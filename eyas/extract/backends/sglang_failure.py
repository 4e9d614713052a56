"""Why an extraction request to SGLang failed, in the server's own words: the capture hook's error, the log's lines.

    try:
        answer = request_json(...)
    except SglangServerError as err:
        raise explain_failure(err, where=where, url=url, capture_dir=capture_dir, log_path=log, proc=proc) from err

When eyas's capture hook raises inside the server (a CaptureError: this SGLang passes the hook something other
than what it reads), SGLang's scheduler logs "Scheduler hit an exception: <traceback>" and sends SIGQUIT to the
server, whose handler kills the whole process tree (managers/scheduler.py `run_scheduler_process`,
entrypoints/engine.py `launch_phase_sigquit_handler`, tokenizer_manager.py `running_phase_sigquit_handler`).
The request in flight then gets no answer at all; on its own that reads "cannot reach" or an HTTP 5xx. This
module asks what happened instead: whether the server is still there (the launched process's exit code, or
GET /health of a server started by hand), the hook's error (the hook writes it to `<capture dir>/capture-error.txt`,
eyas.extract.capture_hook), and the lines of the server's log that name the failure, when eyas launched the
server and so has its log.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from eyas.engines.sglang import SglangServerError, http_status
from eyas.extract.capture_hook import ERROR_FILE

SERVER_EXIT_WAIT_S = 10.0  # after a hook error: SGLang kills its process tree right after logging it
SERVER_CHECK_S = 2.0  # otherwise: a server that died with the request is gone by then
FAILURE_MARKERS = ("Scheduler hit an exception", "Traceback (most recent call last)")
MAX_LOG_LINES = 40
TAIL_LINES = 15


def hook_error(capture_dir: str | Path) -> str | None:
    """The capture hook's last error in this capture folder, if it wrote one."""
    path = Path(capture_dir) / ERROR_FILE
    try:
        return path.read_text(errors="replace").strip() or None
    except FileNotFoundError:
        return None


def log_excerpt(log_path: str | Path, *, max_lines: int = MAX_LOG_LINES) -> list[str]:
    """The lines of a server log that name its failure: from the last "Scheduler hit an exception" (else the last
    traceback) to the end, its middle elided past `max_lines`; the last lines when there is no traceback."""
    lines = Path(log_path).read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if any(marker in line for marker in FAILURE_MARKERS)]
    if not starts:
        return lines[-TAIL_LINES:]
    scheduler = [i for i in starts if FAILURE_MARKERS[0] in lines[i]]
    block = lines[scheduler[-1] if scheduler else starts[-1] :]
    if len(block) <= max_lines:
        return block
    head = 4
    return block[:head] + [f"... ({len(block) - max_lines + 1} lines) ..."] + block[-(max_lines - head - 1) :]


def server_state(url: str, proc: subprocess.Popen | None, *, wait_s: float) -> str | None:
    """How the server ended ("exited with code -9", "no longer answers GET /health"), or None while it is still
    up after `wait_s` seconds: the launched process's exit, else GET /health of a server started by hand."""
    deadline = time.monotonic() + wait_s
    while True:
        if proc is not None and proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        if proc is None and http_status(f"{url}/health", timeout_s=2) != 200:
            return "no longer answers GET /health"
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def explain_failure(
    err: SglangServerError,
    *,
    where: str,
    url: str,
    capture_dir: str | Path,
    log_path: str | Path | None = None,
    proc: subprocess.Popen | None = None,
) -> SglangServerError:
    """The error to raise for a failed request: `err` itself while the server is up and its hook has not failed,
    else what stopped the server, quoted from the hook and the log."""
    hook = hook_error(capture_dir)
    state = server_state(url, proc, wait_s=SERVER_EXIT_WAIT_S if hook is not None else SERVER_CHECK_S)
    if state is None and hook is None:
        return err
    if state is not None:
        lines = [f"{where}: the SGLang server at {url} {state} during this request."]
    else:
        lines = [f"{where}: the SGLang server at {url} is up, but eyas's capture hook failed in it."]
    if hook is not None:
        lines.append(f"eyas's capture hook raised in the server ({Path(capture_dir) / ERROR_FILE}):")
        lines += [f"  {line}" for line in hook.splitlines()]
    if log_path is not None and Path(log_path).is_file():
        lines.append(f"The server's log {log_path}, where it failed:")
        lines += [f"  {line}" for line in log_excerpt(log_path)]
    elif log_path is None:
        lines.append("eyas did not launch this server: its log (where it was started) has the full traceback.")
    if hook is not None:
        lines.append(
            "A CaptureError stops the server on purpose, so that no wrong features are written: the hook names "
            "what this SGLang passed it; check eyas.extract.capture_hook against the server's SGLang version "
            "(eyas checks 0.5.23), then start the extraction again (it resumes)."
        )
    else:
        lines.append("Fix what the log names, then start the extraction again (it resumes).")
    return SglangServerError("\n".join(lines))
