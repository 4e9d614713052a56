"""Test double of a serving engine for regeneration (SGLang cannot run on CPU, vLLM neither): the tiny target's
greedy answers over SGLang's /generate and the OpenAI endpoints. It is NOT SGLang or vLLM.

    python -m tests.generation_double --model-path TARGET --port 30000 [--fail-every 10]

Answers, as the servers' own code builds them:
- POST /generate {"input_ids", "rid", "sampling_params": {"max_new_tokens", "temperature"}}:
  {"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens",
  "finish_reason": {"type": "length", "length": N} or {"type": "stop", "matched": EOS}}}
  (SGLang 0.5.23 managers/tokenizer_manager.py; output_ids only for an input_ids request, io_struct.py);
- POST /v1/completions {"model", "prompt": [token ids], "max_tokens", "return_token_ids"}: {"id", "object":
  "text_completion", "model", "choices": [{"index", "text", "finish_reason", "token_ids"}], "usage"}
  (vLLM's entrypoints/openai completion serving: `token_ids` only when return_token_ids is true);
- POST /v1/chat/completions {"model", "messages"}: {"choices": [{"message": {"role", "content"},
  "finish_reason"}], "usage"} (no token ids); the prompt is the chat template, or the turns' text joined.
A wrong model name is a 404 as vLLM answers it. `--fail-every K` answers every K-th request with a 500
(what a server under memory pressure does), `--delay-s S` waits before each answer; GET /health is 200 once the model is loaded.
`--abort-every K [--abort-times A]` aborts the first A requests of every K-th new prompt (of each endpoint) as
SGLang answers a running request that /abort_request stopped (`aborted_answer`): HTTP 200, the tokens decoded
until then, and finish_reason {"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}
(/v1 endpoints: finish_reason "abort").
"""

from __future__ import annotations

import argparse
import itertools
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer

import torch

from eyas.dataset.prompts import prompt_token_ids
from eyas.target import load_target
from tests.json_handler import JsonHandler

MODEL_NAME = "tiny-target"


class Engine:
    def __init__(self, model_path: str, fail_every: int, delay_s: float = 0.0, abort_every: int = 0,
                 abort_times: int = 1):  # fmt: skip
        self.target = load_target(model_path, "float32")
        self.fail_every, self.counter, self.lock = fail_every, itertools.count(1), threading.Lock()
        self.delay_s = delay_s
        self.abort_every, self.abort_times = abort_every, abort_times
        self.prompts: dict[tuple, list[int]] = {}  # (endpoint, prompt) -> [order of first arrival, requests seen]

    def should_fail(self) -> bool:
        with self.lock:
            n = next(self.counter)
        return bool(self.fail_every) and n % self.fail_every == 0

    def should_abort(self, endpoint: str, prompt: list[int]) -> bool:
        """The first abort_times requests of every abort_every-th new prompt of an endpoint are aborted (an
        operator's /abort_request reaching a running request)."""
        with self.lock:
            mine = sum(1 for key in self.prompts if key[0] == endpoint)
            seen = self.prompts.setdefault((endpoint, *prompt), [mine + 1, 0])
            seen[1] += 1
        return bool(self.abort_every) and seen[0] % self.abort_every == 0 and seen[1] <= self.abort_times

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new: int) -> tuple[list[int], str]:
        eos = self.target.eos_token_id
        with self.lock:
            out = self.target.model.generate(
                input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new, do_sample=False, pad_token_id=eos if eos is not None else 0, eos_token_id=eos,
            )[0, len(ids) :].tolist()  # fmt: skip
        if eos is not None and eos in out:
            return out[: out.index(eos) + 1], "stop"
        return out, "length"

    def decode(self, ids: list[int]) -> str:
        return self.target.tokenizer.decode(ids, skip_special_tokens=True)


def aborted_answer(out: list[int]) -> tuple[list[int], dict]:
    """(output_ids, finish_reason) of a running request stopped by /abort_request, as SGLang 0.5.23 answers it:
    Scheduler.abort_request (managers/scheduler.py) sets `req.to_finish = FINISH_ABORT()`, so the request ends
    after one more decode step with the tokens decoded so far (here the first half of the answer, one at least);
    its finish_reason is FINISH_ABORT().to_json() (managers/schedule_batch.py), and
    TokenizerManager._handle_abort_finish_reason passes an abort without status_code on as a normal answer
    (HTTP 200)."""
    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return out[: max(1, len(out) // 2)], finish


def make_handler(engine: Engine):
    class Handler(JsonHandler):
        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, {})

        def do_POST(self):
            body = self._body()
            time.sleep(engine.delay_s)
            if engine.should_fail():
                return self._send(500, {"error": {"message": "CUDA out of memory (double told to fail)"}})
            if self.path == "/generate":
                return self._send(200, self.generate(body))
            if self.path in ("/v1/completions", "/v1/chat/completions"):
                if body.get("model") != MODEL_NAME:
                    return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return self._send(200, self.openai(body, chat=self.path.endswith("chat/completions")))
            self._send(404, {"detail": "Not Found"})

        def generate(self, body: dict) -> dict:
            ids, params = body["input_ids"], body.get("sampling_params", {})
            out, reason = engine.greedy(ids, int(params.get("max_new_tokens", 128)))
            finish = (
                {"type": "stop", "matched": out[-1]} if reason == "stop" else {"type": "length", "length": len(out)}
            )
            if engine.should_abort(self.path, ids):
                out, finish = aborted_answer(out)
            meta = {"id": body.get("rid") or uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": len(out),
                    "cached_tokens": 0, "finish_reason": finish}  # fmt: skip
            return {"text": engine.decode(out), "output_ids": out, "meta_info": meta}

        def openai(self, body: dict, chat: bool) -> dict:
            ids = prompt_token_ids(engine.target.tokenizer, body["messages"]) if chat else list(body["prompt"])
            out, reason = engine.greedy(ids, int(body.get("max_tokens", 16)))
            if engine.should_abort(self.path, ids):  # serving_completions: finish_reason = meta_info's ["type"]
                out, finish = aborted_answer(out)
                reason = finish["type"]
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": engine.decode(out)},
                          "finish_reason": reason}  # fmt: skip
                return {"id": uuid.uuid4().hex, "object": "chat.completion", "model": MODEL_NAME, "choices": [choice],
                        "usage": usage}  # fmt: skip
            choice = {"index": 0, "text": engine.decode(out), "finish_reason": reason}
            if body.get("return_token_ids"):
                choice["token_ids"] = out
            return {"id": uuid.uuid4().hex, "object": "text_completion", "model": MODEL_NAME, "choices": [choice],
                    "usage": usage}  # fmt: skip

    return Handler


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="generation_double")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", type=int, default=1)  # accepted as eyas's launch passes it; one process here
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--delay-s", type=float, default=0.0, help="wait this long before each answer")
    p.add_argument("--abort-every", type=int, default=0, help="abort every K-th new prompt (0: never)")
    p.add_argument("--abort-times", type=int, default=1, help="... on its first A requests")
    args = p.parse_args(argv)
    engine = Engine(args.model_path, args.fail_every, args.delay_s, args.abort_every, args.abort_times)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine))
    server.daemon_threads = True
    print(f"generation double serving {args.model_path} on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def start(model_path, port: int, *, fail_every: int = 0, delay_s: float = 0.0, abort_every: int = 0,
          abort_times: int = 1, log_path=None):  # fmt: skip
    """The double as a process on 127.0.0.1:port, returned once GET /health answers 200."""
    import os
    import subprocess
    from pathlib import Path

    import httpx

    repo = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "tests.generation_double", "--model-path", str(model_path), "--port", str(port),
            "--fail-every", str(fail_every), "--delay-s", str(delay_s), "--abort-every", str(abort_every),
            "--abort-times", str(abort_times)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"generation double on port {port} did not start (exit {proc.poll()})")
