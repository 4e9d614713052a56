"""SGLang 0.5.23's own server-argument code as a small loopback service, for the tests and the doubles.

    python tests/sglang_kit/resolver.py --port-file F      # in the sglang-0.5.23 kit's environment
    POST /server_info {"argv": [...launch_server flags...]}
      -> {"ok": true, "server_info": {...}}     what GET /server_info of that server would answer
      -> {"ok": false, "error": "..."}          SGLang's own refusal (argparse, resolution or validation)

It imports SGLang once (about 15 s), then answers each command in about 0.2 s. Each answer is what
sglang/srt/entrypoints/http_server.py `get_server_info` builds: `build_server_info(server_args, {})`
(sglang/srt/utils/common.py: `server_args.resolved_dict()` + `launch_command`) plus "version", after
`ServerArgs.resolve_once()` and `check_server_args()`, the two steps `Engine._launch_subprocesses` runs
before it starts anything (sglang/srt/entrypoints/engine.py). The scheduler's part (scheduler_info,
internal_states, startup_time) comes from live processes: {} / [] / None here. `--device cuda` is added
when the command names no device: it is what a GPU host detects (values that depend on the GPU, such as
attention_backend or chunked_prefill_size when unset, are therefore this machine's, not an H200's).
Resolution sets SGLANG_* / NCCL_* environment variables (sglang/srt/arg_groups/serving_hook.py): the
environment is restored after each command, so one answer does not leak into the next.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stand_ins  # noqa: E402


def server_info(argv: list[str]) -> dict:
    """{"ok": True, "server_info": ...} or {"ok": False, "error": SGLang's message} for one command."""
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import build_server_info
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins
    from sglang.version import __version__

    argv = list(argv) + ([] if "--device" in argv else ["--device", "cuda"])
    saved_env, stderr = dict(os.environ), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = prepare_server_args(argv)
        args.resolve_once()
        args.check_server_args()
        info = {**build_server_info(args, {}), "startup_time": None, "internal_states": []}
        info.update(version=__version__, frontend="python")
        return {"ok": True, "server_info": msgspec_to_builtins(redact_watermark_secrets(info))}
    except SystemExit:  # argparse: the message is the last line it printed
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return {"ok": False, "error": lines[-1] if lines else "argparse exited without a message"}
    except Exception as err:  # noqa: BLE001 -- SGLang refuses with ValueError, TypeError, OSError, ...
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        if self.path != "/server_info":
            return self._send(404, {"error": f"no route {self.path}"})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200, server_info([str(a) for a in body["argv"]]))

    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {})

    def _send(self, code: int, body) -> None:
        data = json.dumps(body, default=repr).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    ap = argparse.ArgumentParser(prog="tests/sglang_kit/resolver.py")
    ap.add_argument("--port-file", required=True, help="written with the port once SGLang is imported")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model path that is not a folder fails at once
    stand_ins.install()
    import sglang.srt.server_args  # noqa: F401 -- the slow import, before the port is announced

    server = HTTPServer(("127.0.0.1", 0), Handler)
    Path(args.port_file).write_text(str(server.server_address[1]))
    server.serve_forever()


if __name__ == "__main__":
    main()
