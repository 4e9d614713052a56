"""What a browser test of the Prefect UI needs: a password-protected local server, the CLI steps a user
runs (work pool, deploy, worker), a REST client to wait on states, and headless Chromium with numbered
screenshots.

Every process is started in its own session and stopped with all its descendants (flow runs started by
a worker run in sessions of their own, and torchrun under them), by process id.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = Path(os.environ.get("EYAS_CHROMIUM", "/usr/bin/chromium"))
WAITING_FOR_INPUT = ("Paused", "Suspended")  # pause_flow_run / suspend_flow_run: both are PAUSED-type states


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Direct children of pid, read from /proc (no psutil)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def stop_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process and every descendant, SIGKILL what is left after grace_s."""
    pids = [proc.pid, *descendants(proc.pid)] if proc.poll() is None else descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in pids):
            proc.poll()
            time.sleep(0.2)
    proc.wait(timeout=5)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@dataclass
class LocalPrefect:
    """A `prefect server start` on a free loopback port with Basic auth, and the environment its clients need.

    The server reads PREFECT_SERVER_API_AUTH_STRING ("user:password"); clients (CLI, worker, flow runs)
    send PREFECT_API_AUTH_STRING, the same string; the UI asks for it on a login page and keeps it in
    the browser's localStorage. The UI's API address comes from PREFECT_SERVER_API_PORT (or
    PREFECT_SERVER_UI_API_URL), not from `--port`: both are set, or the UI would call port 4200.
    """

    home: Path
    auth_string: str
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.ui_url}/api"

    def client_env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_HOME=str(self.home / "client"),
            PREFECT_API_URL=self.api_url,
            PREFECT_API_AUTH_STRING=self.auth_string,
            PREFECT_UI_URL=self.ui_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            **extra,
        )
        return env

    def start_server(self, wait_s: float = 180.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_HOME=str(self.home / "server"),
            PREFECT_SERVER_API_AUTH_STRING=self.auth_string,
            PREFECT_SERVER_API_HOST="127.0.0.1",
            PREFECT_SERVER_API_PORT=str(self.port),
            PREFECT_SERVER_UI_API_URL=self.api_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
        )
        proc = self.spawn(
            "server",
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
            env,
        )
        deadline = time.monotonic() + wait_s
        while not self._healthy():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prefect server did not start; see {self.home / 'server.log'}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200  # health needs no auth
        except httpx.HTTPError:
            return False

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def cli(self, *args: str, timeout_s: float = 180.0) -> str:
        """Run `prefect ARGS` as a user would, against this server; returns its output, raises on failure."""
        proc = subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            cwd=REPO,
            env=self.client_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"`prefect {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def stop(self) -> None:
        for proc in reversed(self.procs):  # worker first, server last
            stop_tree(proc)
        self.procs.clear()

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else f"(no {path})"

    # --- the REST API, with the same credentials -------------------------------------------------

    def api(self, method: str, path: str, **kwargs) -> dict | list:
        token = base64.b64encode(self.auth_string.encode()).decode()
        resp = httpx.request(
            method, f"{self.api_url}{path}", headers={"Authorization": f"Basic {token}"}, timeout=30, **kwargs
        )
        resp.raise_for_status()
        return resp.json()

    def flow_run(self, run_id: str) -> dict:
        return self.api("GET", f"/flow_runs/{run_id}")

    def wait_for_state(
        self,
        run_id: str,
        names: tuple[str, ...],
        timeout_s: float,
        stuck_in: tuple[str, ...] = (),
        stuck_s: float = 120,
    ) -> dict:
        """Poll the run until its state name is one of names; fail at once on a final state that is not, and
        after stuck_s seconds spent without a break in one of the `stuck_in` states."""
        deadline = time.monotonic() + timeout_s
        stuck_since = None
        while True:
            run = self.flow_run(run_id)
            state = run.get("state") or {}
            if state.get("name") in names:
                return run
            stuck_since = (stuck_since or time.monotonic()) if state.get("name") in stuck_in else None
            if stuck_since is not None and time.monotonic() - stuck_since > stuck_s:
                raise AssertionError(
                    f"flow run {run_id} has been {state.get('name')} for {stuck_s:.0f} s while waiting for "
                    f"{'/'.join(names)}; worker log:\n{self.log_tail('worker')}"
                )
            if state.get("type") in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                raise AssertionError(
                    f"flow run {run_id} ended {state.get('name')} ({state.get('message')}) while waiting for "
                    f"{'/'.join(names)}; worker log:\n{self.log_tail('worker')}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"flow run {run_id} still {state.get('name')} after {timeout_s:.0f} s, waiting for "
                    f"{'/'.join(names)}; worker log:\n{self.log_tail('worker')}"
                )
            time.sleep(2.0)


class Screens:
    """Numbered full-window screenshots of each step: 01-login.png, 02-dashboard.png, ..."""

    def __init__(self, page, out_dir: Path):
        self.page, self.out_dir, self.count = page, out_dir, 0
        out_dir.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, full_page: bool = False) -> Path:
        self.count += 1
        path = self.out_dir / f"{self.count:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=full_page)
        return path


FORM_PROBLEMS_JS = """() => [...document.querySelectorAll('[aria-invalid=true], [role=alert], .text-destructive')]
  .map(el => (el.getAttribute('aria-label') || el.name || '') + ': ' + (el.innerText || '').trim()).slice(0, 20)"""


def submit_custom_run(page, shot, *, timeout_ms: float = 60_000) -> str:
    """Click the custom-run form's Submit and return the id of the flow run the UI created.

    The UI validates the parameters against the schema (a request to the server), then POSTs
    /deployments/{id}/create_flow_run. When no such request follows a click within timeout_ms (the
    click was lost, or the form refused), the screenshot, the form's error texts and the browser's console
    errors name what happened; a lost click is retried once (no run exists yet, so none is doubled)."""
    console: list[str] = []
    page.on("console", lambda msg: console.append(msg.text) if msg.type == "error" else None)

    def is_create(response) -> bool:
        return response.request.method == "POST" and response.url.split("?")[0].endswith("/create_flow_run")

    for attempt in (1, 2):
        try:
            with page.expect_response(is_create, timeout=timeout_ms) as created:
                page.get_by_role("button", name="Submit").click()
        except Exception as exc:  # playwright's TimeoutError: no create request followed the click
            if "Timeout" not in type(exc).__name__:
                raise
            path = shot(f"submit-{attempt}-no-run-created", full_page=True)
            problems = page.evaluate(FORM_PROBLEMS_JS)
            if attempt == 2 or problems:
                raise AssertionError(
                    f"Submit created no flow run in {timeout_ms / 1000:.0f} s (try {attempt}); the form shows "
                    f"{problems or 'no errors'}; browser console errors: {console[-5:] or 'none'}; "
                    f"screenshot {path}"
                ) from None
            continue
        response = created.value
        assert response.ok, f"create_flow_run answered {response.status}: {response.text()[:2000]}"
        return response.json()["id"]
    raise AssertionError("unreachable")


def launch_chromium(playwright):
    """Debian's Chromium (make install puts it at /usr/bin/chromium); Playwright's own builds are not used."""
    if not CHROMIUM.exists():
        raise RuntimeError(
            f"{CHROMIUM} is missing: `make install` installs Debian's chromium package "
            f"(or set EYAS_CHROMIUM to a Chromium binary)"
        )
    return playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)


def local_only(route) -> None:
    """Serve the loopback server, refuse everything else (the UI's analytics would wait on DNS)."""
    if re.match(r"^https?://127\.0\.0\.1[:/]", route.request.url):
        route.continue_()
    else:
        route.abort()


def tensorboard_screenshot(logdir: Path, out: Path, *, timeout_s: float = 90.0) -> Path:
    """Serve `logdir` with TensorBoard on loopback, open its scalars page in headless Chromium once the
    held-out estimate's chart is drawn, and save a full-page screenshot to `out`."""
    from playwright.sync_api import sync_playwright

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(logdir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{url}/data/runs", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tensorboard on {url} did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        with sync_playwright() as p:
            browser = launch_chromium(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.route("**/*", local_only)
            page.goto(f"{url}/?pinnedCards=&smoothing=0#scalars&tagFilter=tau_estimate%7Cacc_k%7Closs")
            page.get_by_text("eval/tau_estimate").first.wait_for(timeout=timeout_s * 1000)
            page.wait_for_load_state("networkidle")
            time.sleep(3)  # the charts draw after their data arrive
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        return out
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
