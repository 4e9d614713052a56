"""Test double of `python -m sglang.launch_server` (SGLang cannot run on CPU): same flags, same HTTP protocol.

    python -m tests.sglang_double --model-path TARGET --host 127.0.0.1 --port 30000 \
        [--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT --speculative-num-steps 3 ...]

Its server arguments are SGLang 0.5.23's own: the flags go to SGLang's parser and resolution
(tests/sglang_conformance.py, the `sglang_kit` fixture); a command SGLang refuses makes the double exit with
SGLang's message, as a launch fails, and the speculative shape it serves is the resolved one (for example
--speculative-num-draft-tokens rewritten to steps + 1 for a chain). GET /health answers 503 while "loading"
(a short delay), then 200; GET /server_info answers the resolution. POST /generate takes
{"input_ids": [...], "sampling_params": {"temperature": 0, "max_new_tokens": N}} and answers {"text",
"output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "finish_reason", "e2e_latency"}}.
As managers/tokenizer_manager.py `_calculate_spec_decoding_metrics` does, it adds "spec_verify_ct" (with
spec_accept_length) only when the resolved speculative_algorithm is set and the count is > 0: an answer that
ended at prefill has none. Outputs are a deterministic function of the prompt, not a model's.
Environment: EYAS_SGLANG_DOUBLE_ACCEPT_LENGTH (tokens per verify step, default 2.5, at most steps + 1),
EYAS_SGLANG_DOUBLE_STOP_AT_PREFILL (comma-separated token ids: a prompt ending in one stops after its first
token, as at an end-of-sequence token), EYAS_SGLANG_DOUBLE_EXIT=1 (exit at start-up with an error).
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from http.server import ThreadingHTTPServer

from tests.json_handler import JsonHandler
from tests.sglang_conformance import SglangRefused, resolved_server_info

STEP_S = 0.002  # one simulated forward


def parse_port(argv: list[str]) -> tuple[str, int]:
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    return host, int(argv[argv.index("--port") + 1]) if "--port" in argv else 30000


def make_handler(info: dict, ready_at: float):
    speculative = info.get("speculative_algorithm") is not None
    longest = (info.get("speculative_num_steps") or 0) + 1  # a chain accepts at most steps + 1 tokens a step
    accept_length = min(float(os.environ.get("EYAS_SGLANG_DOUBLE_ACCEPT_LENGTH", "2.5")), max(longest, 1))
    stop_ids = {int(t) for t in os.environ.get("EYAS_SGLANG_DOUBLE_STOP_AT_PREFILL", "").split(",") if t}

    class Handler(JsonHandler):
        def do_GET(self):
            if self.path in ("/server_info", "/get_server_info"):
                return self._send(200, info)
            if self.path != "/health":
                return self._send(404, {"error": f"no route {self.path}"})
            self._send(200 if time.monotonic() >= ready_at else 503, {})

        def do_POST(self):
            if self.path != "/generate":
                return self._send(404, {"error": f"no route {self.path}"})
            start = time.monotonic()
            body = self._body()
            ids, params = body.get("input_ids"), body.get("sampling_params", {})
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                return self._send(400, {"error": "input_ids: expected a non-empty list of token ids"})
            n = int(params.get("max_new_tokens", 128))
            if ids[-1] in stop_ids:
                n = 1  # the first token, sampled at prefill, ends the answer
            output = [(sum(ids) + 7 * i) % 2048 for i in range(n)]
            meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": n}
            meta["finish_reason"] = {"type": "stop" if n == 1 else "length", "length": n}
            verify = math.ceil((n - 1) / accept_length) if speculative else 0  # the prefill makes token 1
            if verify > 0:  # tokenizer_manager.py adds the spec fields only for spec_verify_ct > 0
                meta["spec_verify_ct"] = verify
                meta["spec_accept_length"] = n / verify
            time.sleep(STEP_S * (verify or n))
            meta["e2e_latency"] = time.monotonic() - start
            self._send(200, {"text": " ".join(map(str, output)), "output_ids": output, "meta_info": meta})

    return Handler


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if os.environ.get("EYAS_SGLANG_DOUBLE_EXIT") == "1":
        print("RuntimeError: double told to fail at start-up (EYAS_SGLANG_DOUBLE_EXIT=1)", file=sys.stderr)
        return 1
    try:
        info = resolved_server_info(argv)
    except SglangRefused as err:
        print(err, file=sys.stderr)
        return 1
    server = ThreadingHTTPServer(parse_port(argv), make_handler(info, time.monotonic() + 0.5))
    print(f"double of sglang.launch_server serving {info['model_path']} on {server.server_address}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
