"""Find or start the local Prefect server (SQLite, 127.0.0.1) before `prefect` is imported.

eyas uses PREFECT_API_URL when it is set. Otherwise it uses the server it started itself for this state
directory (`.eyas/prefect/server.json` names its process: PID and kernel start time), and starts one when
none runs: on 127.0.0.1:4200, or, when another Prefect server already answers there (somebody else's, or
one of another checkout), on a free port, saying so. It never uses a server it did not start without
being told to.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_API_URL = "http://127.0.0.1:4200/api"
REPO = Path(__file__).resolve().parents[1]
SERVER_RECORD = "server.json"


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# How long the server keeps a crash-detection window that ended without being evaluated (Prefect's default: 60 s).
# A server restarted later than that after the runs' machine died (eyas's own server dies with it) dropped their
# windows before evaluating them, and the runs stayed Running; kept, they are marked Crashed at the restart.
EXPIRED_BUCKET_BUFFER = "P1D"


def server_environment(state_dir: Path, port: str) -> dict[str, str]:
    """The environment of the Prefect server eyas starts (its own settings win over the caller's)."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(state_dir),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_PORT": port,  # the UI finds the API through this, not through --port
        "PREFECT_SERVER_EVENTS_EXPIRED_BUCKET_BUFFER": EXPIRED_BUCKET_BUFFER,
    }
    env.pop("PREFECT_API_URL", None)
    return env


def start_server(api_url: str, state_dir: Path, wait_s: float = 120.0) -> subprocess.Popen:
    """Start `prefect server start` detached (it outlives this command); wait until healthy."""
    host, port = api_url.split("//")[1].split("/")[0].split(":")
    state_dir.mkdir(parents=True, exist_ok=True)
    env = server_environment(state_dir, port)
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
            from eyas.fsio import atomic_write_text
            from eyas.train.preflight import process_start_time

            record = {"pid": proc.pid, "start_time": process_start_time(proc.pid), "api_url": api_url}
            atomic_write_text(state_dir / SERVER_RECORD, json.dumps(record) + "\n")
            return proc
        time.sleep(1.0)
    proc.terminate()
    raise TimeoutError(f"prefect server at {api_url} not healthy after {wait_s:.0f} s; see {state_dir / 'server.log'}")


def own_server(state_dir: Path) -> str | None:
    """The API URL of the server eyas started for this state directory, when that very process still runs and
    answers; None otherwise."""
    from eyas.train.preflight import process_start_time

    path = Path(state_dir) / SERVER_RECORD
    if not path.is_file():
        return _adopt_pid_file(Path(state_dir))
    try:
        record = json.loads(path.read_text())
    except ValueError:
        from eyas_cli.errors import UserError

        raise UserError(
            f"{path}: not the JSON record eyas writes (pid, start_time, api_url); stop the Prefect server it named, "
            "if one runs, and delete the file"
        ) from None
    if process_start_time(int(record["pid"])) != record["start_time"] or not healthy(record["api_url"]):
        return None
    return record["api_url"]


def _adopt_pid_file(state_dir: Path) -> str | None:
    """A server started by an earlier eyas, which recorded only `server.pid` (on the default port): still ours
    when that process is a Prefect server and the default port answers; its record is then written."""
    from eyas.fsio import atomic_write_text
    from eyas.train.preflight import process_start_time

    try:
        pid = int((state_dir / "server.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if b"server" not in cmdline or not any(b"prefect" in part for part in cmdline) or not healthy(DEFAULT_API_URL):
        return None
    record = {"pid": pid, "start_time": process_start_time(pid), "api_url": DEFAULT_API_URL}
    atomic_write_text(state_dir / SERVER_RECORD, json.dumps(record) + "\n")
    return DEFAULT_API_URL


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_server(state_dir: Path, default_api_url: str = DEFAULT_API_URL) -> str:
    """Use PREFECT_API_URL if set (it must answer), else eyas's own server for state_dir, starting it if needed;
    sets PREFECT_API_URL and returns it."""
    configured = os.environ.get("PREFECT_API_URL")
    if configured:
        if not healthy(configured):
            from eyas_cli.errors import UserError

            raise UserError(
                f"PREFECT_API_URL={configured} does not answer /health; start that server or unset the "
                f"variable to let eyas start a local one"
            )
        return configured
    api = own_server(state_dir)
    if api is None:
        api = default_api_url
        if healthy(default_api_url):
            api = f"http://127.0.0.1:{free_port()}/api"
            print(
                f"a Prefect server that eyas did not start for {state_dir} answers at {default_api_url}: not "
                f"using it; starting eyas's own at {api} (state in {state_dir}). To use that server instead, "
                f"set PREFECT_API_URL={default_api_url}",
                flush=True,
            )
        else:
            print(f"starting a local Prefect server at {api} (state in {state_dir}) ...", flush=True)
        start_server(api, state_dir)
    os.environ["PREFECT_API_URL"] = api
    return api


def ui_url(api_url: str) -> str:
    return api_url.rstrip("/").removesuffix("/api")


def connect() -> str:
    """The server every eyas command uses: PREFECT_API_URL, or the local one (state in EYAS_STATE_DIR, default
    .eyas/ in the repository), started when none answers."""
    api = ensure_server(Path(os.environ.get("EYAS_STATE_DIR", REPO / ".eyas")) / "prefect")
    check_prefect_points_at(api)
    return api


def check_prefect_points_at(api_url: str) -> None:
    """Prefect reads PREFECT_API_URL once, when it is imported: a command that imported it before choosing the
    server would talk to another one (without a URL, a throw-away server Prefect starts itself). A bug in eyas,
    raised at once rather than answered by the wrong server."""
    if "prefect.context" not in sys.modules:
        return  # not imported yet: it reads the variable just set
    from prefect.settings import get_current_settings

    reads = get_current_settings().api.url
    if (reads or "").rstrip("/") != api_url.rstrip("/"):
        raise RuntimeError(
            f"prefect was imported before eyas chose its server: it reads PREFECT_API_URL={reads}, not {api_url}; "
            "import prefect only after eyas_cli.server.connect() (or known_api_url()) has set the variable"
        )


def known_api_url() -> str | None:
    """The server a read-only command (`eyas status`) asks: PREFECT_API_URL, else eyas's own if it runs; None
    when neither (it starts nothing)."""
    return os.environ.get("PREFECT_API_URL") or own_server(
        Path(os.environ.get("EYAS_STATE_DIR", REPO / ".eyas")) / "prefect"
    )
