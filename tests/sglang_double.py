"""Test double of `python -m sglang.launch_server` (SGLang cannot run on CPU): same flags, same HTTP protocol.

    python -m tests.sglang_double --model-path TARGET --host 127.0.0.1 --port 30000 \
        [--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT --speculative-num-steps 3 ...]

GET /health answers 503 while "loading" (a short delay), then 200. POST /generate takes SGLang's
documented body {"input_ids": [...], "sampling_params": {"temperature": 0, "max_new_tokens": N}}
and answers {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens",
"finish_reason", "e2e_latency"}}, adding "spec_verify_ct" only when a speculative algorithm was
given, as SGLang does. Its outputs are a deterministic function of the prompt, not a model's.
Environment: EYAS_SGLANG_DOUBLE_ACCEPT_LENGTH (tokens per verify step, default 2.5),
EYAS_SGLANG_DOUBLE_EXIT=1 (exit at start-up with an error, like a failed launch).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STEP_S = 0.002  # one simulated forward


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    return p.parse_args(argv)


def make_handler(args, ready_at: float):
    accept_length = float(os.environ.get("EYAS_SGLANG_DOUBLE_ACCEPT_LENGTH", "2.5"))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path != "/health":
                return self._send(404, {"error": f"no route {self.path}"})
            self._send(200 if time.monotonic() >= ready_at else 503, {})

        def do_POST(self):
            if self.path != "/generate":
                return self._send(404, {"error": f"no route {self.path}"})
            start = time.monotonic()
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, params = body.get("input_ids"), body.get("sampling_params", {})
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                return self._send(400, {"error": "input_ids: expected a non-empty list of token ids"})
            n = int(params.get("max_new_tokens", 128))
            output = [(sum(ids) + 7 * i) % 2048 for i in range(n)]
            meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": n}
            meta["finish_reason"] = {"type": "length", "length": n}
            steps = n
            if args.speculative_algorithm:
                steps = meta["spec_verify_ct"] = max(1, math.ceil(n / accept_length))
            time.sleep(STEP_S * steps)
            meta["e2e_latency"] = time.monotonic() - start
            self._send(200, {"text": " ".join(map(str, output)), "output_ids": output, "meta_info": meta})

    return Handler


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    if os.environ.get("EYAS_SGLANG_DOUBLE_EXIT") == "1":
        print("RuntimeError: double told to fail at start-up (EYAS_SGLANG_DOUBLE_EXIT=1)", file=sys.stderr)
        return 1
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args, time.monotonic() + 0.5))
    print(f"double of sglang.launch_server serving {args.model_path} on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
