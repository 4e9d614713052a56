"""eyas.extract.backends.sglang_failure: a failed extraction request explained by the hook's error and the server log.

The end-to-end cases (a double of the server whose hook fails at the start-up canary) are in
tests/test_extract_sglang.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from eyas.engines.sglang import SglangServerError
from eyas.extract.backends import sglang_failure
from eyas.extract.backends.sglang_failure import explain_failure, log_excerpt
from eyas.extract.capture_hook import ERROR_FILE

# What SGLang 0.5.23 logs when a forward hook raises (managers/scheduler.py run_scheduler_process, then
# entrypoints/engine.py launch_phase_sigquit_handler), after the lines of a normal start.
SERVER_LOG = """[2026-12-01 10:00:00] server_args=ServerArgs(model_path='/models/Kimi-K2.5', ...)
[2026-12-01 10:40:00] The server is fired up and ready to roll!
[2026-12-01 10:40:02] Scheduler hit an exception: Traceback (most recent call last):
  File "/opt/sglang/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 6366, in run_scheduler_process
    scheduler.run_event_loop()
  File "/opt/eyas/eyas/extract/capture_hook.py", line 88, in __call__
    raise error from err
eyas.extract.capture_hook.CaptureError: capture hook: AttributeError: 'NoneType' object has no attribute 'shape'

[2026-12-01 10:40:02] Received sigquit from a child process. It usually means the child failed.
"""
HOOK_ERROR = "CaptureError: capture hook: AttributeError: 'NoneType' object has no attribute 'shape'"


def test_the_log_excerpt_is_the_schedulers_exception_to_the_end(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(SERVER_LOG)
    lines = log_excerpt(log)
    assert lines[0].endswith("Scheduler hit an exception: Traceback (most recent call last):")
    assert lines[-1].endswith("Received sigquit from a child process. It usually means the child failed.")
    assert len(lines) == 8
    log.write_text(SERVER_LOG.replace("    scheduler.run_event_loop()\n", "    frame\n" * 100))
    long = log_excerpt(log, max_lines=10)
    assert len(long) == 10 and long[4] == "... (98 lines) ..." and long[-1] == lines[-1]
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert log_excerpt(log) == [f"line {i}" for i in range(15, 30)]  # no traceback: the last lines


def test_a_launched_server_that_died_is_explained_by_the_hook_error_and_its_log(tmp_path):
    (tmp_path / "capture").mkdir()
    (tmp_path / "capture" / ERROR_FILE).write_text(HOOK_ERROR + "\n")
    (tmp_path / "server.log").write_text(SERVER_LOG)
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    proc.wait()
    request = SglangServerError("w: cannot reach http://127.0.0.1:1/generate (RemoteProtocolError: ...)")
    err = explain_failure(request, where="canary", url="http://127.0.0.1:1", capture_dir=tmp_path / "capture",
                          log_path=tmp_path / "server.log", proc=proc)  # fmt: skip
    lines = str(err).splitlines()
    assert lines[0] == "canary: the SGLang server at http://127.0.0.1:1 exited with code -9 during this request."
    assert lines[1] == f"eyas's capture hook raised in the server ({tmp_path / 'capture' / ERROR_FILE}):"
    assert lines[2] == f"  {HOOK_ERROR}"
    assert lines[3] == f"The server's log {tmp_path / 'server.log'}, where it failed:"
    assert lines[4].endswith("Scheduler hit an exception: Traceback (most recent call last):")
    assert lines[-1].startswith("A CaptureError stops the server on purpose, so that no wrong features are written")
    assert "cannot reach" not in str(err)


def test_a_server_started_by_hand_that_died_is_explained_by_the_hook_error(tmp_path):
    (tmp_path / ERROR_FILE).write_text(HOOK_ERROR + "\n")
    err = explain_failure(SglangServerError("w: HTTP 502"), where="sample 3", url="http://127.0.0.1:9",
                          capture_dir=tmp_path)  # fmt: skip
    assert str(err).splitlines()[:3] == [
        "sample 3: the SGLang server at http://127.0.0.1:9 no longer answers GET /health during this request.",
        f"eyas's capture hook raised in the server ({tmp_path / ERROR_FILE}):",
        f"  {HOOK_ERROR}",
    ]
    assert "eyas did not launch this server: its log (where it was started) has the full traceback." in str(err)


def test_a_server_still_up_without_a_hook_error_keeps_the_requests_own_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_failure, "SERVER_CHECK_S", 0.3)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        request = SglangServerError("w: HTTP 500 from http://127.0.0.1:1/generate: out of memory")
        assert explain_failure(request, where="w", url="http://127.0.0.1:1", capture_dir=tmp_path, proc=proc) is request
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("log_exists", [True, False])
def test_a_server_that_died_without_a_hook_error_quotes_its_log(tmp_path, log_exists):
    log = tmp_path / "server.log"
    if log_exists:
        log.write_text("loading\nCUDA error: an illegal memory access was encountered\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    proc.wait()
    err = str(
        explain_failure(SglangServerError("w"), where="w", url="u", capture_dir=tmp_path, log_path=log, proc=proc)
    )
    assert err.startswith("w: the SGLang server at u exited with code 1 during this request.")
    assert ("  CUDA error: an illegal memory access was encountered" in err) is log_exists
    assert err.endswith("Fix what the log names, then start the extraction again (it resumes).")
