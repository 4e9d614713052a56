"""The local Prefect server eyas uses (eyas_cli.server): its own, never somebody else's without being told.
A real `prefect server start` is started; the "other" server on the default port is a plain HTTP server
answering /health as Prefect's does."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading

import pytest


@pytest.fixture
def other_server():
    """Something answering /api/health with 200 on a loopback port, as a Prefect server eyas did not start."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/health" else 404)
            self.end_headers()
            self.wfile.write(b"true")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()


def test_a_server_eyas_did_not_start_is_never_used_silently(other_server, tmp_path, monkeypatch, capsys):
    from eyas_cli.server import SERVER_RECORD, ensure_server, healthy, known_api_url

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("EYAS_STATE_DIR", str(tmp_path))
    state = tmp_path / "prefect"
    assert known_api_url() is None  # nothing set, nothing of eyas's running: status asks nobody
    api = ensure_server(state, default_api_url=other_server)
    record = json.loads((state / SERVER_RECORD).read_text())
    try:
        said = capsys.readouterr().out
        assert api != other_server and healthy(api) and record["api_url"] == api
        assert f"a Prefect server that eyas did not start for {state} answers at {other_server}: not using it" in said
        assert f"set PREFECT_API_URL={other_server}" in said
        os.environ.pop("PREFECT_API_URL")
        assert ensure_server(state, default_api_url=other_server) == api  # its own, found again: none started
        assert "starting" not in capsys.readouterr().out
        assert known_api_url() == api
    finally:
        os.killpg(record["pid"], signal.SIGTERM)


def test_a_record_that_is_not_eyas_s_is_refused_with_the_fix(tmp_path, monkeypatch):
    from eyas_cli.errors import UserError
    from eyas_cli.server import SERVER_RECORD, ensure_server

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    (tmp_path / SERVER_RECORD).write_text('{"pid": 12')
    with pytest.raises(UserError, match="not the JSON record eyas writes .*delete the file"):
        ensure_server(tmp_path)


def test_prefect_api_url_is_used_when_set_and_must_answer(other_server, tmp_path, monkeypatch):
    from eyas_cli.errors import UserError
    from eyas_cli.server import ensure_server

    monkeypatch.setenv("PREFECT_API_URL", other_server)
    assert ensure_server(tmp_path) == other_server  # told to: used, whoever started it
    monkeypatch.setenv("PREFECT_API_URL", other_server.replace("/api", "/nothing"))
    with pytest.raises(UserError, match="does not answer /health"):
        ensure_server(tmp_path)


def test_the_server_eyas_starts_keeps_windows_that_ended_while_it_was_down(tmp_path, monkeypatch):
    """Prefect drops a crash-detection window 60 s after it ended when it was not evaluated: a server restarted
    later than that after the runs' machine died left them Running (0 of 4 Crashed; with a day, 4 of 4 at the
    restart). Prefect must read the value eyas sets as a day."""
    from datetime import timedelta

    from prefect.settings.models.server.events import ServerEventsSettings

    from eyas_cli.server import server_environment

    monkeypatch.setenv("PREFECT_SERVER_EVENTS_EXPIRED_BUCKET_BUFFER", "PT60S")
    env = server_environment(tmp_path, "4200")
    monkeypatch.setenv(
        "PREFECT_SERVER_EVENTS_EXPIRED_BUCKET_BUFFER", env["PREFECT_SERVER_EVENTS_EXPIRED_BUCKET_BUFFER"]
    )
    assert ServerEventsSettings().expired_bucket_buffer == timedelta(days=1)
    assert "PREFECT_API_URL" not in env and env["PREFECT_HOME"] == str(tmp_path)
