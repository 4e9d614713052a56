"""Test double of an SGLang 0.5.23 server in aux-capture mode (SGLang cannot run on CPU).

It is NOT SGLang: it runs a small Hugging Face target with transformers (eyas.target.target_features) and
answers as SGLang 0.5.23's code does, so the backend's features can be compared with the hf backend's:

    python -m tests.sglang_extract_double --model-path TARGET --host 127.0.0.1 --port 30000 [flags]
    with serve_extract_double(TARGET, flags=aux_capture_flags(cfg, engine_ids, capture_dir)) as url: ...

What it takes from SGLang itself: its server arguments. The flags go to SGLang's own parser and resolution
(tests/sglang_conformance.py, the `sglang_kit` fixture); a command SGLang refuses makes the double exit with
SGLang's message, as a launch fails, and GET /server_info answers exactly SGLang's resolution (plus the
port it really listens on). What it imitates, each from the named SGLang function:
- layers captured: `set_eagle3_layers_to_capture` of models/llama.py (0.5.23): ids + 1 each, or
  [2, N//2, N-3] without ids; a Llama target only.
- forward hooks: model_executor/hook_manager.py `register_forward_hooks` resolves each spec's hook_factory
  ("pkg.mod:fn"), calls it with the spec's config and attaches the hook to the modules whose names match
  target_modules (fnmatch); the double's module tree has `logits_processor`. The hook is called as
  hook(module, args, output) with LogitsProcessor.forward's positional args (input_ids, hidden_states,
  lm_head, forward_batch, aux_hidden_states) and a LogitsProcessorOutput whose hidden_states are the aux
  layers concatenated (`pack_aux_hidden_states`) and last_hidden_states the final-norm rows
  (`_get_last_hidden_states_to_store`: aux-capture mode under full capture).
- /generate body checks: managers/tokenizer_manager.py `_validate_one_request` refuses return_hidden_states
  when the server's return_hidden_states_mode is None (HTTP 400, SGLang's message).
- meta_info.hidden_states: managers/scheduler_components/batch_result_processor.py appends
  `hidden_states[start:start + extend_input_len].tolist()` (one element: [prompt tokens][width]) when the
  request asks for them; no last_hidden_states key ever.
- input_top_logprobs / output_top_logprobs: logprob_result_processor.py starts the input list with [None]
  and moves the last position's entry to the output; tokenizer_manager.py `detokenize_top_logprobs_tokens`
  makes each entry (logprob, token_id, None).
- flat top logprobs (return_flat_raw_top_logprobs / return_flat_raw_output_top_logprobs, with
  return_flat_raw_top_logprobs_b64): managers/io_struct.py `build_flat_top_logprobs_arrays` (leading null
  rows counted into null_prefix, float32 values and int32 ids [rows, k]) and tokenizer_manager.py
  `_build_flat_top_logprobs_fields_from_arrays` (`{side}_top_logprobs_val_flat_b64` / `_idx_flat_b64`, their
  `_dtype` markers, `_shape` [rows, k], `_null_prefix`) in place of the nested lists of that side.

- an exception in the forward (a forward hook's included): managers/scheduler.py `run_scheduler_process`
  logs "Scheduler hit an exception: <traceback>" and sends SIGQUIT to the server, whose handler
  (entrypoints/engine.py `launch_phase_sigquit_handler`) logs "Received sigquit from a child process. It
  usually means the child failed." and kills the process tree: the request in flight gets no answer. The
  double prints the same lines to its stderr (the server log), then kills itself (command line) or stops
  serving and drops the connection (in a thread).

Modes that misbehave (argument `mode`, or EYAS_SGLANG_EXTRACT_DOUBLE_MODE for the command line): ok;
no_hook (never calls forward hooks, as a prefill replayed from a CUDA graph); drift_aux (the JSON hidden
states differ from what the hook sees, as if SGLang's fields moved); drift_last (the hook's
last_hidden_states are pre-norm); drift_batch (the hook's ForwardBatch has no extend_seq_lens_cpu, as if a
release renamed it); old_version (reports version 0.5.22); http_500; slow (3 s per answer).
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import functools
import importlib
import os
import signal
import sys
import threading
import time
import traceback
import types
import uuid
from dataclasses import dataclass, field
from enum import IntEnum
from http.server import ThreadingHTTPServer

import numpy as np
import torch

from eyas.target import load_target, target_features
from tests.json_handler import JsonHandler
from tests.sglang_conformance import SglangRefused, resolved_server_info

MODES = ("ok", "no_hook", "drift_aux", "drift_last", "drift_batch", "old_version", "http_500", "slow")
OLD_VERSION = "0.5.22"
NOT_CONFIGURED = (
    "The server is not configured to return the hidden states. "
    "Please set `--enable-return-hidden-states` to enable this feature."
)  # SGLang's own message (tokenizer_manager.py)


class ForwardMode(IntEnum):  # model_executor/forward_batch_info.py (the members the double uses)
    EXTEND = 1
    DECODE = 2


@dataclass
class ForwardBatch:  # the fields of model_executor/forward_batch_info.py ForwardBatch the hook may read
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    rids: list[str]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]


@dataclass
class LogitsProcessorOutput:  # layers/logits_processor.py (the fields the double fills)
    next_token_logits: torch.Tensor
    hidden_states: torch.Tensor | None = None
    hidden_states_token_indices: torch.Tensor | None = None
    last_hidden_states: torch.Tensor | None = None
    customized_info: dict | None = field(default=None)


def parse_port(argv: list[str]) -> tuple[str, int]:
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 30000
    return host, port


@functools.lru_cache(maxsize=4)
def _target(model_path: str):
    return load_target(model_path, "float32")


def _factory(path: str):  # hook_manager.py resolve_callable: "pkg.mod:fn" or "pkg.mod.fn"
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class HiddenStateModel:
    """What the server computes per prompt, and the forward hooks it runs on the logits processor."""

    def __init__(self, info: dict, mode: str):
        self.info, self.mode, self.lock = info, mode, threading.Lock()
        self.model = _target(info["model_path"]).model
        n = self.model.config.num_hidden_layers
        ids = info.get("return_aux_hidden_state_layer_ids")
        self.aux_mode = info.get("aux_hidden_state_capture") is not None
        # models/llama.py set_eagle3_layers_to_capture
        self.capture = [i + 1 for i in ids] if ids is not None else [2, n // 2, n - 3]
        self.hooks = []
        for spec in info.get("forward_hooks") or []:  # hook_manager.py register_forward_hooks
            if any(fnmatch.fnmatch("logits_processor", p) for p in spec.get("target_modules") or []):
                hook = _factory(spec["hook_factory"])(spec.get("config") or {})
                if hook is not None:
                    # one process, so TP rank 0 (what sglang.srt.distributed's get_tensor_model_parallel_rank
                    # answers there; SGLang itself is not importable beside the double)
                    hook._tp_rank = lambda: 0
                    self.hooks.append(hook)

    @torch.no_grad()
    def prefill(self, ids: list[int], rid: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stored rows [t, W], final rows [t, H], logits [t, V]) of one prompt; forward hooks run."""
        with self.lock:
            aux, last, logits = target_features(self.model, torch.tensor([ids]), self.capture)
        aux, last, logits = aux[0], last[0], logits[0]
        stored = aux if self.aux_mode else last
        if self.hooks and self.mode != "no_hook":
            batch = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor(ids), [rid], [len(ids)], [0])
            if self.mode == "drift_batch":
                kept = {k: v for k, v in vars(batch).items() if k != "extend_seq_lens_cpu"}
                batch = types.SimpleNamespace(**kept, extend_seq_lens_cpu_v2=[len(ids)])
            hook_last = aux[:, -last.shape[1] :] if self.mode == "drift_last" else last
            out = LogitsProcessorOutput(logits[-1:], hidden_states=stored, last_hidden_states=hook_last)
            args = (torch.tensor(ids), last, self.model.lm_head, batch, None)
            for hook in self.hooks:
                hook(self, args, out)
        if self.mode == "drift_aux":
            stored = stored + 1.0
        return stored, last, logits

    def answer(self, body: dict) -> dict:
        ids, params = body["input_ids"], body.get("sampling_params", {})
        rid = body.get("rid") or uuid.uuid4().hex
        stored, last, logits = self.prefill(ids, rid)
        generated = [int(logits[-1].argmax())]  # max_new_tokens 1: the token after the prefill
        n = int(params.get("max_new_tokens", 128))
        if n != 1:
            raise ValueError("the double serves max_new_tokens 1 only")
        meta = {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0}
        meta["finish_reason"] = {"type": "length", "length": 1}
        if body.get("return_hidden_states"):
            meta["hidden_states"] = [stored.tolist()]
        if body.get("return_logprob"):
            k = int(body.get("top_logprobs_num") or 0)
            start = int(body.get("logprob_start_len", -1))
            if k and start == 0:
                top = torch.log_softmax(logits.double(), -1).topk(k, dim=-1)
                rows = [[(v, int(i), None) for v, i in zip(vals.tolist(), idx.tolist())] for vals, idx in zip(*top)]
                meta["input_top_logprobs"] = [None] + rows[:-1]
                meta["output_top_logprobs"] = rows[-1:]
                b64 = bool(body.get("return_flat_raw_top_logprobs_b64"))
                for side, flag in (("input", "return_flat_raw_top_logprobs"),
                                   ("output", "return_flat_raw_output_top_logprobs")):  # fmt: skip
                    if body.get(flag):
                        meta.update(flat_top_logprobs(side, meta.pop(f"{side}_top_logprobs"), k, b64))
        return {"text": str(generated[0]), "output_ids": generated, "meta_info": meta}


def flat_top_logprobs(side: str, rows: list, k: int, b64: bool) -> dict:
    """The flat fields of one side, as io_struct.py build_flat_top_logprobs_arrays and tokenizer_manager.py
    _build_flat_top_logprobs_fields(_from_arrays) build them from the nested rows."""
    null_prefix = 0
    while null_prefix < len(rows) and not rows[null_prefix]:
        null_prefix += 1
    kept = rows[null_prefix:]
    k = len(kept[0]) if kept else k
    vals = np.asarray([[e[0] for e in r] for r in kept], dtype=np.float32).reshape(len(kept), k)
    ids = np.asarray([[e[1] for e in r] for r in kept], dtype=np.int32).reshape(len(kept), k)
    fields = {f"{side}_top_logprobs_shape": [len(kept), k], f"{side}_top_logprobs_null_prefix": null_prefix}
    if b64:
        fields[f"{side}_top_logprobs_val_flat_b64"] = base64.b64encode(vals.tobytes()).decode()
        fields[f"{side}_top_logprobs_idx_flat_b64"] = base64.b64encode(ids.tobytes()).decode()
        fields[f"{side}_top_logprobs_val_flat_b64_dtype"] = "float32"
        fields[f"{side}_top_logprobs_idx_flat_b64_dtype"] = "int32"
    else:  # the nested rows' own (float64) numbers, flattened
        fields[f"{side}_top_logprobs_val_flat"] = [e[0] for r in kept for e in r]
        fields[f"{side}_top_logprobs_idx_flat"] = [e[1] for r in kept for e in r]
    return fields


def scheduler_failed(stop) -> None:
    """What SGLang does when its forward raises (see the module docstring); `stop` ends the server."""
    stamp = time.strftime("[%Y-%m-%d %H:%M:%S]")
    print(f"{stamp} Scheduler hit an exception: {traceback.format_exc()}", file=sys.stderr, flush=True)
    print(f"{stamp} Received sigquit from a child process. It usually means the child failed.", file=sys.stderr,
          flush=True)  # fmt: skip
    stop()


def make_handler(info: dict, mode: str, model: HiddenStateModel, stop):
    class Handler(JsonHandler):
        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {})
            if self.path in ("/server_info", "/get_server_info"):
                return self._send(200, {**info, "version": OLD_VERSION} if mode == "old_version" else info)
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            if self.path != "/generate":
                return self._send(404, {"detail": "Not Found"})
            body = self._body()
            ids = body.get("input_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                return self._send(400, {"error": {"message": "input_ids: expected a non-empty list of token ids"}})
            if body.get("return_hidden_states") and info.get("return_hidden_states_mode") is None:
                return self._send(400, {"error": {"message": NOT_CONFIGURED}})
            if mode == "http_500":
                return self._send(500, {"error": {"message": "CUDA out of memory (double told to fail: http_500)"}})
            if mode == "slow":
                time.sleep(3)
            try:
                answer = model.answer(body)
            except Exception:  # noqa: BLE001 -- as SGLang's scheduler: any forward error stops the server
                self.close_connection = True
                return scheduler_failed(lambda: stop(self.server))
            self._send(200, answer)

    return Handler


def kill_process_tree(server) -> None:  # utils/common.py kill_process_tree(os.getpid()): the server is gone
    os.kill(os.getpid(), signal.SIGKILL)


def stop_serving(server) -> None:  # in a thread of the test process: the port stops answering
    def stop():
        server.shutdown()
        server.server_close()

    threading.Thread(target=stop, daemon=True).start()


def make_server(argv: list[str], mode: str, stop=kill_process_tree) -> ThreadingHTTPServer:
    if mode not in MODES:
        raise ValueError(f"double mode {mode!r}: expected one of {MODES}")
    info = resolved_server_info(argv)  # SglangRefused: SGLang's own message
    server = ThreadingHTTPServer(parse_port(argv), make_handler(info, mode, HiddenStateModel(info, mode), stop))
    info["port"] = server.server_address[1]
    server.daemon_threads = True
    return server


@contextlib.contextmanager
def serve_extract_double(model_path, *, flags: list[str], mode: str = "ok"):
    """The double on a free port of 127.0.0.1, in a thread; yields its base URL."""
    argv = ["--model-path", str(model_path), "--host", "127.0.0.1", "--port", "0", *flags]
    server = make_server(argv, mode, stop=stop_serving)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    try:
        server = make_server(argv, os.environ.get("EYAS_SGLANG_EXTRACT_DOUBLE_MODE", "ok"))
    except SglangRefused as err:
        print(err, file=sys.stderr)
        return 1
    print(f"double of sglang.launch_server (aux capture) on {server.server_address}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
