"""Find or start the local Prefect server (SQLite, 127.0.0.1) before `prefect` is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_API_URL = "http://127.0.0.1:4200/api"


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_server(api_url: str, state_dir: Path, wait_s: float = 120.0) -> subprocess.Popen:
    """Start `prefect server start` detached (it outlives this command); wait until healthy."""
    host, port = api_url.split("//")[1].split("/")[0].split(":")
    state_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(state_dir),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_PORT": port,  # the UI finds the API through this, not through --port
    }
    env.pop("PREFECT_API_URL", None)
    log = open(state_dir / "server.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", port],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {state_dir / 'server.log'}")
        if healthy(api_url):
            (state_dir / "server.pid").write_text(str(proc.pid))
            return proc
        time.sleep(1.0)
    proc.terminate()
    raise TimeoutError(f"prefect server at {api_url} not healthy after {wait_s:.0f} s; see {state_dir / 'server.log'}")


def ensure_server(state_dir: Path) -> str:
    """Use PREFECT_API_URL if set (it must answer), else the local default, starting it if needed."""
    configured = os.environ.get("PREFECT_API_URL")
    if configured:
        if not healthy(configured):
            from eyas_cli.errors import UserError

            raise UserError(
                f"PREFECT_API_URL={configured} does not answer /health; start that server or unset the "
                f"variable to let eyas start a local one"
            )
        return configured
    if not healthy(DEFAULT_API_URL):
        print(f"starting a local Prefect server at {DEFAULT_API_URL} (state in {state_dir}) ...", flush=True)
        start_server(DEFAULT_API_URL, state_dir)
    os.environ["PREFECT_API_URL"] = DEFAULT_API_URL
    return DEFAULT_API_URL


def ui_url(api_url: str) -> str:
    return api_url.rstrip("/").removesuffix("/api")
