"""A real S3 API server on 127.0.0.1 for tests (moto's server mode), and a fault-injecting proxy.

`start_s3_server()` runs `python -m moto.server` as a subprocess. `FaultProxy` is an HTTP proxy on
127.0.0.1 in front of it that forwards every request unchanged, except those matching a `Fault`:
it answers them with an S3 error (503 SlowDown, 500 InternalError), answers late (a client read
timeout), cuts the connection (before the answer, or halfway through its body), or flips a byte of the
response or the request body; a fault may match one range of a ranged GET (its Range header). It logs every request as it arrives, so a
test can count the client's retries.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "eyas-test",
    "AWS_SECRET_ACCESS_KEY": "eyas-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3_server(log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, **CREDENTIALS}
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto server did not start; see {log_path}")
            time.sleep(0.3)


@dataclass
class Fault:
    """Requests with this method whose path+query contains `match` get `action`, `times` times."""

    method: str
    match: str
    action: str  # "503" | "500" | "delay" | "drop" | "cut" (half the body, then close) | "corrupt" (response body)
    # | "corrupt_request" (request body)
    times: int = 1
    delay_s: float = 3.0
    hits: int = 0
    range: str = ""  # when set, only requests whose Range header contains it (one part of a ranged read)


@dataclass
class FaultProxy:
    upstream: str
    faults: list[Fault] = field(default_factory=list)
    log: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request, on arrival

    def __post_init__(self):
        self.lock = threading.Lock()
        host, port = self.upstream.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                proxy._record(self.command, self.path)
                fault = proxy._take_fault(self.command, self.path, self.headers.get("Range", ""))
                action = fault.action if fault else None
                if action in ("503", "500"):
                    code, name = (
                        ("SlowDown", "Please reduce your request rate.")
                        if action == "503"
                        else (
                            "InternalError",
                            "We encountered an internal error. Please try again.",
                        )
                    )
                    xml = f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{name}</Message></Error>'
                    return self._reply(int(action), {"Content-Type": "application/xml"}, xml.encode())
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "delay":
                    time.sleep(fault.delay_s)
                if action == "corrupt_request" and body:
                    body = body[:-1] + bytes([body[-1] ^ 0xFF])
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                out_headers = {
                    k: v for k, v in resp.getheaders() if k.lower() not in ("transfer-encoding", "connection")
                }
                conn.close()
                if action == "corrupt" and data:
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])
                self._reply(resp.status, out_headers, data, cut=action == "cut")

            def _reply(self, status, headers, data, cut=False):
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() != "content-length" or self.command == "HEAD":  # a HEAD's is the object's size
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data[: len(data) // 2] if cut else data)
                if cut:  # the full length announced, half of it sent: the client's stream breaks mid-body
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _take_fault(self, method: str, path: str, range_header: str = "") -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.method == method and f.match in path and f.range in range_header and f.hits < f.times:
                    f.hits += 1
                    return f
        return None

    def _record(self, method: str, path: str) -> None:
        with self.lock:
            self.log.append((method, path))

    def count(self, method: str, match: str) -> int:
        with self.lock:
            return sum(1 for m, p in self.log if m == method and match in p)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
