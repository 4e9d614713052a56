"""The capture module an SGLang server loads with --forward-hooks: each eyas request's hidden states as a file.

    --forward-hooks '[{"name": "eyas-capture", "target_modules": ["logits_processor",
        "language_model.logits_processor"], "hook_factory": "eyas.extract.capture_hook:make_hook",
        "config": {"dir": "/shared/run/extract/sglang-capture", "rid_prefix": "eyas-"}}]'

SGLang (>= 0.5.23) calls `make_hook(config)` once per spec on every TP worker and attaches that one hook to every
matching module (Llama's `logits_processor`, Kimi-K2.5's `language_model.logits_processor`), after CUDA-graph
capture (sglang/srt/model_executor/hook_manager.py `register_forward_hooks`, called from
model_runner_components/cuda_graph_setup.py `finalize_cuda_graph_capture`), and PyTorch then calls the hook as
`hook(module, args, output)` after each forward of the logits processor. What it reads, as SGLang 0.5.23
defines it:
- `args`: LogitsProcessor.forward(input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, ...)
  (layers/logits_processor.py), called positionally by the models (models/llama.py, deepseek_v2.py):
  args[0] the batch's token ids [T], args[3] the ForwardBatch. args[0] is None under a multimodal wrapper
  that embeds the tokens itself: KimiK25ForConditionalGeneration.forward (models/kimi_k25.py) goes through
  `general_mm_embed_routine` (managers/mm_utils.py), which calls the DeepSeek language model with
  input_ids=None, and DeepseekV2ForCausalLM.forward passes that on. The ids are then the ForwardBatch's
  `input_ids`, the ones the runner gave the wrapper (model_executor/runner/eager_runner.py).
- ForwardBatch (model_executor/forward_batch_info.py): `forward_mode` (ForwardMode.EXTEND for a prefill;
  `is_extend()` is also true for MIXED and TARGET_VERIFY, so the name is compared), `rids` (one per request),
  `extend_seq_lens_cpu` (tokens computed per request), `extend_prefix_lens_cpu` (0 without a prefix cache).
- `output`, a LogitsProcessorOutput: `hidden_states`, the aux layers concatenated [T, n_aux*H] under full
  capture in aux-capture mode (`pack_aux_hidden_states`), `last_hidden_states`, the post-norm final states
  [T, H] (the lm_head input; kept only in aux-capture mode), `hidden_states_token_indices` (None when every
  row is kept).

The hook writes on TP rank 0 only (every rank sees the same rows), for requests whose rid starts with
`rid_prefix`, one safetensors file per request `<dir>/<rid>.safetensors` with `input_ids` [t] int64, `aux`
[t, n_aux*H] and `last` [t, H] in the model's dtype: written under a temporary name, then renamed, by one
writer thread (the forward waits only for the copy to host memory; at most WRITE_QUEUE files wait). Anything
it cannot read as above raises CaptureError, whatever the underlying exception, and SGLang's scheduler then stops
the server ("Scheduler hit an exception", managers/scheduler.py): a drift in SGLang's internals fails the first
request, it does not write wrong features. The message is also written to `<dir>/capture-error.txt`, so that
eyas quotes it even for a server whose log it cannot read. torch and safetensors only: it runs inside the server.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

WRITE_QUEUE = 8
RID_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
FILE_SUFFIX = ".safetensors"
ERROR_FILE = "capture-error.txt"  # the hook's last CaptureError, for the client (eyas.extract.backends.sglang)


class CaptureError(RuntimeError):
    """The server's forward did not carry what the capture hook reads."""


def capture_file(out_dir: str | Path, rid: str) -> Path:
    """Where the hook writes request `rid`'s states."""
    if not RID_PATTERN.match(rid):
        raise CaptureError(f"request id {rid!r}: expected letters, digits, '.', '_' or '-' (it names a file)")
    return Path(out_dir) / f"{rid}{FILE_SUFFIX}"


def sglang_tp_rank() -> int:
    """This worker's tensor-parallel rank (sglang/srt/distributed/parallel_state.py)."""
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class CaptureHook:
    """hook(module, args, output): splits a prefill's rows per request and writes eyas's requests to files."""

    def __init__(self, out_dir: str | Path, *, rid_prefix: str, tp_rank: Callable[[], int] = sglang_tp_rank):
        self.out_dir, self.rid_prefix, self._tp_rank = Path(out_dir), rid_prefix, tp_rank
        self._writer_rank: bool | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __call__(self, module, args, output):
        try:
            return self._capture(args, output)
        except CaptureError as err:
            self._record(err)
            raise
        except Exception as err:  # noqa: BLE001 -- whatever broke, the server stops with one CaptureError
            error = unexpected_error(module, args, err)
            self._record(error)
            raise error from err

    def _capture(self, args, output):
        forward_batch = args[3]
        if getattr(forward_batch.forward_mode, "name", None) != "EXTEND":
            return None  # decode, verify, mixed and idle forwards carry no prompt
        if self._writer_rank is None:
            self._writer_rank = self._tp_rank() == 0
        rids = list(forward_batch.rids or [])
        if not self._writer_rank or not any(r.startswith(self.rid_prefix) for r in rids):
            return None
        if self.error is not None:
            raise CaptureError(f"capture hook: writing to {self.out_dir} failed earlier") from self.error
        for rid, start, n, rows in self._split(args, output, rids, forward_batch):
            if rid.startswith(self.rid_prefix):
                self._put(capture_file(self.out_dir, rid), rows)
        return None

    def _split(self, args, output, rids, forward_batch):
        aux, last = output.hidden_states, output.last_hidden_states
        ids = args[0] if args[0] is not None else forward_batch.input_ids  # None: a wrapper embedded the tokens
        if ids is None:
            raise CaptureError(
                "capture hook: LogitsProcessor.forward's input_ids and ForwardBatch.input_ids are both None in a "
                "prefill; expected the batch's token ids in one of them"
            )
        if aux is None or last is None:
            raise CaptureError(
                "capture hook: LogitsProcessorOutput.hidden_states or .last_hidden_states is None in a prefill; "
                "expected the aux layers and the final states (the server must run aux-capture mode: "
                "--enable-return-aux-hidden-states with --return-hidden-states-mode full)"
            )
        if getattr(output, "hidden_states_token_indices", None) is not None:
            raise CaptureError("capture hook: hidden_states keeps a subset of rows; expected every prompt row")
        lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        prefix = [int(n) for n in (getattr(forward_batch, "extend_prefix_lens_cpu", None) or [0] * len(lens))]
        total = sum(lens)
        if len(lens) != len(rids) or aux.shape[0] != total or last.shape[0] != total or ids.shape[0] != total:
            raise CaptureError(
                f"capture hook: {len(rids)} rids, extend_seq_lens_cpu {lens} (sum {total}), hidden_states rows "
                f"{aux.shape[0]}, last_hidden_states rows {last.shape[0]}, input_ids {ids.shape[0]}; expected one "
                "row per prompt token of each request"
            )
        start = 0
        for rid, n, cached in zip(rids, lens, prefix):
            if cached and rid.startswith(self.rid_prefix):
                raise CaptureError(
                    f"capture hook: request {rid} reused {cached} cached tokens, so its first rows were not computed; "
                    "launch the server with --disable-radix-cache"
                )
            yield rid, start, n, (ids[start : start + n], aux[start : start + n], last[start : start + n])
            start += n

    def _put(self, path: Path, rows) -> None:
        ids, aux, last = (t.detach().to("cpu", copy=True).contiguous() for t in rows)
        if self._thread is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._write_loop, name="eyas-capture-writer", daemon=True)
            self._thread.start()
        self._queue.put((path, {"input_ids": ids.to(torch.int64), "aux": aux, "last": last}))

    def _write_loop(self) -> None:
        while True:
            path, tensors = self._queue.get()
            try:
                temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                save_file(tensors, str(temp))
                os.replace(temp, path)
            except Exception as err:  # noqa: BLE001 -- the next forward raises it as a CaptureError
                self.error = err
            finally:
                self._queue.task_done()

    def _record(self, err: CaptureError) -> None:
        """Write the error beside the captures (atomically), where the client looks when the server stops."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            temp = self.out_dir / f".{ERROR_FILE}.{os.getpid()}.tmp"
            temp.write_text(f"{type(err).__name__}: {err}\n")
            os.replace(temp, self.out_dir / ERROR_FILE)
        except OSError as record_err:  # the raise that follows stops the server either way; its log has both
            err.add_note(f"(not recorded in {self.out_dir / ERROR_FILE}: {record_err})")

    def flush(self) -> None:
        """Wait until every queued file is written (tests; the server never waits)."""
        self._queue.join()
        if self.error is not None:
            raise CaptureError(f"capture hook: writing to {self.out_dir} failed") from self.error


def unexpected_error(module, args, err: Exception) -> CaptureError:
    """A CaptureError naming what the hook was reading when `err` (not one of its own checks) was raised."""
    batch = args[3] if isinstance(args, tuple) and len(args) > 3 else None
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    rids = list(getattr(batch, "rids", None) or [])
    shown = ", ".join(rids[:4]) + (f", ... ({len(rids)} in all)" if len(rids) > 4 else "")
    return CaptureError(
        f"capture hook: {type(err).__name__}: {err}, reading the forward of {type(module).__name__} "
        f"({len(args) if isinstance(args, tuple) else '?'} positional args, forward_mode {mode}, rids [{shown}]); "
        "expected LogitsProcessor.forward's (input_ids, hidden_states, lm_head, ForwardBatch, aux_hidden_states) "
        "and a LogitsProcessorOutput as SGLang 0.5.23 passes them: this server's SGLang passes something else; "
        "check eyas.extract.capture_hook against its version"
    )


def make_hook(config: dict) -> CaptureHook:
    """The hook factory SGLang calls with the spec's `config`: {"dir": folder, "rid_prefix": "eyas-"}."""
    if not isinstance(config, dict) or not config.get("dir"):
        raise CaptureError(f"eyas capture hook config {config!r}: expected {{'dir': FOLDER, 'rid_prefix': 'eyas-'}}")
    return CaptureHook(config["dir"], rid_prefix=str(config.get("rid_prefix", "eyas-")))
