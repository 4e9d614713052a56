"""Test double of an SGLang (>= 0.5.23) server in aux-capture mode (SGLang cannot run on CPU).

It is NOT SGLang: it speaks the HTTP protocol eyas.extract_sglang documents and computes REAL hidden
states of a small Hugging Face target with transformers (eyas.target.target_features), so that the
backend's features can be compared with the hf backend's.

    python -m tests.sglang_extract_double --model-path TARGET --host 127.0.0.1 --port 30000 [aux-capture flags]
    with serve_extract_double(TARGET, flags=aux_capture_flags(cfg, engine_ids), mode="ok") as url: ...

Routes, as SGLang names them: GET /health (200 once the model is loaded); GET /server_info (the server
args + "version"); POST /generate {"input_ids", "sampling_params": {"max_new_tokens"}, "return_hidden_states"}
-> {"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens", "cached_tokens",
"finish_reason", "hidden_states", "last_hidden_states"}}. Like SGLang it refuses return_hidden_states
without --enable-return-hidden-states (HTTP 400), captures the aux layers only under
--speculative-algorithm EAGLE3 (otherwise hidden_states are the final layer's, H wide), reads the layer
ids from --json-model-override-args eagle_config and captures hidden_states[id + 1] (default
[2, N//2, N-3]), and appends one row per generated token after the prompt's rows.

Modes that misbehave (argument `mode`, or EYAS_SGLANG_EXTRACT_DOUBLE_MODE for the command line):
ok; h_wide (claims aux-capture mode but returns the final layer's H-wide states as hidden_states);
old_version (reports version 0.5.22); truncated (drops each prompt's last row); http_500 (every /generate
fails); slow (answers /generate after 3 s).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from eyas.target import load_target, target_features

MODES = ("ok", "h_wide", "old_version", "truncated", "http_500", "slow")
VERSION, OLD_VERSION = "0.5.23", "0.5.22"
NOT_CONFIGURED = (
    "The server is not configured to return the hidden states. "
    "Please set `--enable-return-hidden-states` to enable this feature."
)  # SGLang's own message


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang_extract_double")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.9)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--enable-return-hidden-states", action="store_true")
    p.add_argument("--enable-return-aux-hidden-states", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--json-model-override-args", default="{}")
    return p.parse_args(argv)


@functools.lru_cache(maxsize=4)
def _target(model_path: str):
    return load_target(model_path, "float32")


class HiddenStateModel:
    """What the server computes: greedy tokens and, per position, the captured and the final states."""

    def __init__(self, args: argparse.Namespace, mode: str):
        self.args, self.mode, self.lock = args, mode, threading.Lock()
        self.model = _target(args.model_path).model
        n = self.model.config.num_hidden_layers
        eagle = json.loads(args.json_model_override_args).get("eagle_config") or {}
        configured = eagle.get("eagle_aux_hidden_state_layer_ids")
        # SGLang Llama: layers_to_capture = [id + 1 for id in configured], or [2, N//2, N-3] without ids
        self.capture = [i + 1 for i in configured] if configured is not None else [2, n // 2, n - 3]
        self.aux_mode = args.speculative_algorithm == "EAGLE3" and args.enable_return_aux_hidden_states

    @torch.no_grad()
    def run(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(generated ids, stored rows [t + n - 1, W], final rows [t + n - 1, H])."""
        tokens = list(ids)
        with self.lock:
            for step in range(max(1, max_new_tokens)):  # the last pass sees the prompt and all but the last token
                aux, last, logits = target_features(self.model, torch.tensor([tokens]), self.capture)
                if step < max_new_tokens:
                    tokens.append(int(logits[0, -1].argmax()))
        stored = aux[0] if self.aux_mode and self.mode != "h_wide" else last[0]
        return tokens[len(ids) :], stored, last[0]

    def answer(self, ids: list[int], max_new_tokens: int) -> dict:
        generated, stored, last = self.run(ids, max_new_tokens)
        t = len(ids) - (self.mode == "truncated")

        def layout(rows: torch.Tensor) -> list:  # prompt block, then one row per decode step
            return [rows[:t].tolist()] + [rows[len(ids) + k].tolist() for k in range(max_new_tokens - 1)]

        meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": len(generated)}
        meta.update(cached_tokens=0, finish_reason={"type": "length", "length": len(generated)})
        meta["hidden_states"] = layout(stored)
        if self.aux_mode:
            meta["last_hidden_states"] = layout(last)
        return {"text": " ".join(map(str, generated)), "output_ids": generated, "meta_info": meta}


def server_info(args: argparse.Namespace, mode: str) -> dict:
    info = dict(vars(args))
    info["version"] = OLD_VERSION if mode == "old_version" else VERSION
    return info


def make_handler(args: argparse.Namespace, mode: str, model: HiddenStateModel):
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
            if self.path == "/health":
                return self._send(200, {})
            if self.path in ("/server_info", "/get_server_info"):
                return self._send(200, server_info(args, mode))
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            if self.path != "/generate":
                return self._send(404, {"detail": "Not Found"})
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, params = body.get("input_ids"), body.get("sampling_params", {})
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                return self._send(400, {"error": {"message": "input_ids: expected a non-empty list of token ids"}})
            if body.get("return_hidden_states") and not args.enable_return_hidden_states:
                return self._send(400, {"error": {"message": NOT_CONFIGURED}})
            if mode == "http_500":
                return self._send(500, {"error": {"message": "CUDA out of memory (double told to fail: http_500)"}})
            if mode == "slow":
                time.sleep(3)
            answer = model.answer(ids, int(params.get("max_new_tokens", 128)))
            if not body.get("return_hidden_states"):
                for key in ("hidden_states", "last_hidden_states"):
                    answer["meta_info"].pop(key, None)
            self._send(200, answer)

    return Handler


def make_server(args: argparse.Namespace, mode: str) -> ThreadingHTTPServer:
    if mode not in MODES:
        raise ValueError(f"double mode {mode!r}: expected one of {MODES}")
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args, mode, HiddenStateModel(args, mode)))
    server.daemon_threads = True
    return server


@contextlib.contextmanager
def serve_extract_double(model_path, *, flags: list[str], mode: str = "ok"):
    """The double on a free port of 127.0.0.1, in a thread; yields its base URL."""
    server = make_server(parse(["--model-path", str(model_path), "--port", "0", *flags]), mode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    server = make_server(args, os.environ.get("EYAS_SGLANG_EXTRACT_DOUBLE_MODE", "ok"))
    print(f"double of sglang.launch_server (aux capture) serving {args.model_path} on {args.host}:{args.port}")
    sys.stdout.flush()
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
