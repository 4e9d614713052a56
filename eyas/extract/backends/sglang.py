"""The `sglang` hidden-state backend: a stock SGLang 0.5.23 server in aux-capture mode with eyas's capture hook.

    backend = SGLangBackend(cfg.extract.sglang, target_path="/models/Kimi-K2.5", aux_layer_ids=[2, 31, 58],
                            hidden_size=7168)
    [(aux, last), ...] = backend.features([ids_0, ids_1])   # aux [t_i, 3*7168], last [t_i, 7168]
    backend.close()

The server (launched here when `extract.sglang.server_url` is empty; `eyas engine-command CONFIG --stage
extract` prints the command for a server started by hand) runs the target once per prompt and, through
SGLang's documented --forward-hooks, eyas's capture module (eyas.extract.capture_hook) writes each request's
rows to `<capture dir>/<rid>.safetensors`: the aux layers [t, n_aux*H] and the final-norm states [t, H] the
draft trains against, in the model's dtype. The client sends POST /generate {"input_ids", "rid",
"sampling_params": {"max_new_tokens": 1}} without return_hidden_states, waits for the file, checks its
token ids, rows, widths and dtype, and deletes it once read. Server and client therefore share a filesystem
(one machine, or the capture dir on a shared volume).

With a top-K teacher (`extract.teacher = "topk"`) the same request also asks for the top K log-probabilities
at every prompt position (return_logprob, logprob_start_len 0, top_logprobs_num K) as flat base64 arrays
(return_flat_raw_top_logprobs, return_flat_raw_output_top_logprobs, return_flat_raw_top_logprobs_b64: float32
values and int32 ids, 8 bytes an entry); SGLang computes them as log_softmax of the raw logits of the
final-norm states over the full vocab (layers/logprob_processor.py), and a nested-list answer (SGLang's
fallback when it cannot build the flat form) is read too (`topk_from_answer`).

What SGLang 0.5.23 does with the flags (sglang/srt/arg_groups/validation_hook.py
`handle_aux_hidden_state_capture`, serving_hook.py `handle_return_hidden_states_mode`, checked against
SGLang's own code by tests/test_sglang_conformance.py):
- --speculative-algorithm EAGLE3 --enable-return-aux-hidden-states names the capture convention and then
  resets speculative_algorithm to null: /server_info reports `speculative_algorithm: null` and
  `aux_hidden_state_capture: "eagle3"`; no draft model may be given.
- --return-aux-hidden-state-layer-ids a b c (space-separated) picks the layers, in SGLang's numbering for
  the target's family (eyas.layer_ids.sglang_convention): Llama/Qwen capture the input of layer id+1;
  DeepSeek/Kimi add 1 only when the first id is 1. The ids in eagle_config of --json-model-override-args are
  ignored in this mode.
- --enable-return-hidden-states sets return_hidden_states_mode "full", so every prefill keeps every row:
  LogitsProcessorOutput.hidden_states (aux) and .last_hidden_states (final, never in a response).
- --disable-radix-cache and --chunked-prefill-size -1: each prompt is computed whole in one prefill;
  --disable-prefill-cuda-graph: prefills run eagerly, where forward hooks fire.

Start-up canary: one short prompt sent with return_hidden_states and return_logprob (logprob_start_len 0,
top_logprobs_num 1) is read through both channels: its JSON aux rows must equal the file's, and the argmax
of the file's final states times the target's lm_head must equal SGLang's top-1 logprob at every position
(input_top_logprobs[p + 1]; the last position's is output_top_logprobs[0]). A change in SGLang's internal
fields therefore fails on the first request, not after hours. JSON hidden states are nested floats (about
10 ms of client CPU a token at 3 x 7168, bench/engine_io.py): fine for one canary, not for 87.8M tokens.
"""

from __future__ import annotations

import base64
import json
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eyas.config import SGLangEnvConfig, SGLangExtractConfig
from eyas.engines.sglang import SglangServer, SglangServerError, SGLangVersionError, engine_python, request_json
from eyas.extract.backends.base import check_aux_width, check_feature_widths
from eyas.extract.backends.sglang_failure import explain_failure
from eyas.extract.backends.sglang_launch import (
    CAPTURE_HOOK_FACTORY,
    CAPTURE_MODULE,
    MIN_SGLANG_VERSION,
    RID_PREFIX,
    aux_capture_flags,
    build_extract_command,
    check_server,
    engine_layer_ids,
    extract_launch,
    hook_spec,
    lint_server_info,
    served_capture_dir,
)
from eyas.extract.capture_hook import ERROR_FILE, CaptureError, capture_file
from eyas.shards.encoding import TopK
from eyas.target import find_weight

__all__ = [  # the launch and lint live in sglang_launch; callers may import them from here
    "CAPTURE_HOOK_FACTORY", "MIN_SGLANG_VERSION", "SGLangBackend", "SGLangVersionError", "aux_capture_flags",
    "build_extract_command", "check_server", "engine_layer_ids", "extract_launch", "hook_spec", "lint_server_info",
    "read_capture", "topk_from_answer",
]  # fmt: skip
MAX_NEW_TOKENS = 1  # SGLang samples one token after the prefill; the prompt's rows are what eyas keeps
CANARY_TOKENS = 16
FILE_POLL_S = 0.02
FLOAT_DTYPES = {torch.bfloat16, torch.float16, torch.float32}


def read_capture(path: Path, input_ids: list[int], *, num_aux: int, hidden_size: int, where: str):
    """(aux, last) of one capture file, after checking its token ids, rows, widths and dtype."""
    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as err:
        raise SglangServerError(f"{where}: capture file {path} is unreadable ({err})") from err
    missing = sorted({"input_ids", "aux", "last"} - set(tensors))
    if missing:
        raise SglangServerError(f"{where}: capture file {path} lacks {missing}; expected eyas's capture hook's file")
    ids, aux, last = tensors["input_ids"], tensors["aux"], tensors["last"]
    if ids.tolist() != list(input_ids):
        first = next(
            (i for i, (a, b) in enumerate(zip(ids.tolist(), input_ids)) if a != b), min(len(ids), len(input_ids))
        )
        raise SglangServerError(
            f"{where}: capture file {path} holds {len(ids)} token ids that differ from the {len(input_ids)} sent "
            f"(first at position {first}); the rows belong to another prompt: the capture dir is shared by two "
            "extractions, or the server rewrote the prompt"
        )
    for name, t in (("aux", aux), ("last", last)):
        if t.dtype not in FLOAT_DTYPES or t.dim() != 2:
            raise SglangServerError(
                f"{where}: capture file {path}: {name} is {t.dtype} of shape {list(t.shape)}, expected a 2-D "
                "bfloat16, float16 or float32 tensor"
            )
    if aux.dtype != last.dtype:
        raise SglangServerError(f"{where}: capture file {path}: aux is {aux.dtype}, last {last.dtype}; expected one")
    check_aux_width(aux.shape[1], num_aux=num_aux, hidden_size=hidden_size, source=where)
    return aux, last


def wait_for_file(path: Path, timeout_s: float, where: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SglangServerError(
                f"{where}: the server answered but wrote no {path} within {timeout_s} s; expected eyas's capture "
                f"hook to write it: the capture dir must be the same folder for the server and eyas (one machine "
                "or a shared volume), the server's Python must import eyas, and its log names any CaptureError"
            )
        time.sleep(FILE_POLL_S)


def lm_head_weight(target_path: str | Path) -> torch.Tensor:
    """The target's output projection [vocab, H] from its safetensors (tied: the input embedding)."""
    root = Path(target_path)
    config = json.loads((root / "config.json").read_text())
    text = config.get("text_config") or {}
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    suffixes = ("lm_head.weight",) + (("embed_tokens.weight",) if tied else ())
    for suffix in suffixes:
        found = find_weight(root, suffix)  # the text model's tensor, not an MTP or vision copy
        if found is not None:
            with safe_open(str(found[0]), framework="pt") as f:
                return f.get_tensor(found[1]).float()
    raise SglangServerError(
        f"target {root}: no tensor named *lm_head.weight{' or *embed_tokens.weight' if tied else ''} in its "
        "*.safetensors; the start-up canary needs the output projection to check SGLang's final states"
    )


def check_canary(answer: dict, aux: torch.Tensor, last: torch.Tensor, lm_head: torch.Tensor, where: str) -> None:
    """Both channels of one request agree: JSON aux rows == the file's, argmax(final @ lm_head) == top-1 logprob."""
    meta = answer.get("meta_info") or {}
    blocks = meta.get("hidden_states")
    if not isinstance(blocks, list) or not blocks:
        raise SglangServerError(f"{where}: meta_info.hidden_states is {str(blocks)[:80]}, expected the prompt's rows")
    json_aux = torch.tensor(blocks[0], dtype=torch.float32)
    if json_aux.shape != aux.shape or not torch.equal(json_aux, aux.float()):
        raise SglangServerError(
            f"{where}: the answer's hidden states {list(json_aux.shape)} differ from the capture file's aux "
            f"{list(aux.shape)} (max difference "
            f"{(json_aux - aux.float()).abs().max().item() if json_aux.shape == aux.shape else 'n/a'}); "
            "SGLang's LogitsProcessorOutput.hidden_states no longer holds what the hook reads: check "
            "eyas.extract.capture_hook against this SGLang version"
        )
    tops = (meta.get("input_top_logprobs") or [])[1:] + (meta.get("output_top_logprobs") or [])[:1]
    if len(tops) != last.shape[0] or any(not row for row in tops):
        raise SglangServerError(
            f"{where}: {len(tops)} top-1 logprobs for {last.shape[0]} prompt positions (input_top_logprobs[1:] + "
            "output_top_logprobs[0]); expected one each: the request asked for return_logprob, logprob_start_len 0"
        )
    if lm_head.shape[1] != last.shape[1]:
        raise SglangServerError(
            f"{where}: the target's lm_head is {list(lm_head.shape)}, the final states {list(last.shape)}; "
            "expected the same width H"
        )
    logits = last.float() @ lm_head.T
    mine = logits.argmax(-1)
    for p, row in enumerate(tops):
        theirs = int(row[0][1])
        gap = (logits[p, mine[p]] - logits[p, theirs]).item() if theirs < logits.shape[1] else float("inf")
        # a near-tie may flip between SGLang's kernels and this matmul: 1% of the position's largest |logit|
        if int(mine[p]) != theirs and gap > 1e-2 * logits[p].abs().max().item():
            raise SglangServerError(
                f"{where}: at position {p} the capture file's final states give token {int(mine[p])} (logit "
                f"{logits[p, mine[p]].item():.4f}), SGLang's top-1 is {theirs} ({gap:.4f} lower by these states); "
                "LogitsProcessorOutput.last_hidden_states is not the lm_head input: check "
                "eyas.extract.capture_hook against this SGLang version"
            )


# Ask for the top-K teacher as flat base64 arrays (SGLang >= 0.5.22: io_struct.py GenerateReqInput
# return_flat_raw_*): 8 bytes an entry instead of a nested JSON list of [logprob, id, text].
TOPK_FLAGS = {
    "return_logprob": True,
    "logprob_start_len": 0,
    "return_flat_raw_top_logprobs": True,
    "return_flat_raw_output_top_logprobs": True,
    "return_flat_raw_top_logprobs_b64": True,
}


def _flat_rows(meta: dict, side: str, k: int, where: str) -> "tuple[torch.Tensor, torch.Tensor, int] | None":
    """(ids, logprobs [rows, k], null_prefix) of one side's flat b64 fields (tokenizer_manager.py
    _build_flat_top_logprobs_fields_from_arrays), or None when SGLang answered nested lists instead (it falls
    back to them when it cannot build the flat form)."""
    if f"{side}_top_logprobs_val_flat_b64" not in meta:
        return None
    dtypes = (meta.get(f"{side}_top_logprobs_val_flat_b64_dtype"), meta.get(f"{side}_top_logprobs_idx_flat_b64_dtype"))
    shape, null_prefix = meta.get(f"{side}_top_logprobs_shape"), meta.get(f"{side}_top_logprobs_null_prefix")
    if dtypes != ("float32", "int32") or not isinstance(shape, list) or len(shape) != 2 or shape[1] != k:
        raise SglangServerError(
            f"{where}: {side} top logprobs in flat form with dtypes {dtypes} and shape {shape}, expected float32 "
            f"values, int32 ids and [rows, {k}]: this SGLang's flat format changed; check its io_struct.py"
        )
    vals = np.frombuffer(base64.b64decode(meta[f"{side}_top_logprobs_val_flat_b64"]), dtype="<f4")
    ids = np.frombuffer(base64.b64decode(meta[f"{side}_top_logprobs_idx_flat_b64"]), dtype="<i4")
    if vals.size != shape[0] * k or ids.size != vals.size:
        raise SglangServerError(f"{where}: {side} flat top logprobs hold {vals.size} values, shape says {shape}")
    as_tensor = lambda a: torch.from_numpy(a.reshape(shape[0], k).copy())  # noqa: E731
    return as_tensor(ids), as_tensor(vals), int(null_prefix)


def _nested_rows(meta: dict, side: str, k: int):
    rows = meta.get(f"{side}_top_logprobs") or []
    null_prefix = 0
    while null_prefix < len(rows) and not rows[null_prefix]:
        null_prefix += 1
    kept = rows[null_prefix:]
    if any(not row or len(row) < k for row in kept):
        return None
    ids = torch.tensor([[int(e[1]) for e in row[:k]] for row in kept], dtype=torch.int32).reshape(len(kept), k)
    vals = torch.tensor([[float(e[0]) for e in row[:k]] for row in kept], dtype=torch.float32).reshape(len(kept), k)
    return ids, vals, null_prefix


def topk_from_answer(answer: dict, num_tokens: int, k: int, where: str) -> TopK:
    """The top-K teacher of every prompt position from one /generate answer (TOPK_FLAGS, top_logprobs_num K).
    SGLang 0.5.23 (logprob_result_processor.py) starts the input side with a null row for the first token
    (nothing predicts it) and moves the last position's row to the output side: so position p's next-token
    distribution is input row p + 1 and the last position's is output row 0, in either form (flat b64 arrays,
    or the nested [logprob, id, text] lists SGLang falls back to)."""
    meta = answer.get("meta_info") or {}
    sides = []
    for side, want_null in (("input", 1), ("output", 0)):
        got = _flat_rows(meta, side, k, where) or _nested_rows(meta, side, k)
        if got is None or got[2] != want_null:
            raise SglangServerError(
                f"{where}: the answer's {side} top logprobs are missing or short of {k} entries a position; "
                "expected them at every position (flat or nested): the request asks for return_logprob with "
                "logprob_start_len 0 and top_logprobs_num K; check the server's version"
            )
        sides.append(got)
    ids = torch.cat([sides[0][0], sides[1][0][:1]])
    logprobs = torch.cat([sides[0][1], sides[1][1][:1]])
    if ids.shape[0] != num_tokens:
        raise SglangServerError(
            f"{where}: {ids.shape[0]} top-logprob rows for {num_tokens} prompt positions (input rows 1.. + output "
            "row 0); expected one a position"
        )
    return TopK(ids, logprobs)


class SGLangBackend:
    """Hidden states from an SGLang server with eyas's capture hook: launched here, or at extract.sglang.server_url."""

    name = "sglang"

    def __init__(
        self,
        cfg: SGLangExtractConfig,
        *,
        target_path: str,
        aux_layer_ids: list[int],
        hidden_size: int,
        launch_module: str = "sglang.launch_server",
        log_path: str | Path | None = None,
        teacher_topk: int = 0,
        env: SGLangEnvConfig = SGLangEnvConfig(),
        trust_remote_code: bool = False,
    ):
        self.cfg, self.aux_layer_ids, self.hidden_size = cfg, list(aux_layer_ids), hidden_size
        self.teacher_topk = teacher_topk
        self.target_path = target_path
        self._server: SglangServer | None = None
        self.engine_ids, self.convention = engine_layer_ids(self.aux_layer_ids, target_path)
        with ExitStack() as stack:
            if cfg.server_url:
                self.url = cfg.server_url.rstrip("/")
            else:
                capture_dir = Path(cfg.capture_dir or tempfile.mkdtemp(prefix="eyas-sglang-capture-")).resolve()
                capture_dir.mkdir(parents=True, exist_ok=True)
                launch = extract_launch(
                    cfg, target_path=target_path, aux_layer_ids=self.aux_layer_ids, capture_dir=capture_dir,
                    module=launch_module, python=engine_python(env.python), trust_remote_code=trust_remote_code,
                    allowed_versions=env.allow_unchecked_versions,
                )  # fmt: skip
                log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="eyas-sglang-")) / "server.log"
                server = SglangServer(launch, log, cfg.startup_timeout_s, capture_module=CAPTURE_MODULE)
                self.url = stack.enter_context(server)
                self._server = server  # its process and log explain a failed request (_failure)
            self.server_info = check_server(
                self.url, engine_ids=self.engine_ids, convention=self.convention, timeout_s=cfg.request_timeout_s,
                allowed_versions=env.allow_unchecked_versions, trust_remote_code=trust_remote_code,
            )  # fmt: skip
            self.capture_dir = self._capture_dir(self.server_info)
            self._resources = stack.pop_all()
        self._canary_done = False

    def _capture_dir(self, info: dict) -> Path:
        served = Path(served_capture_dir(info))
        if self.cfg.capture_dir and Path(self.cfg.capture_dir).resolve() != served.resolve():
            raise SglangServerError(
                f"SGLang server {self.url}: its capture hook writes to {served}, extract.sglang.capture_dir is "
                f"{self.cfg.capture_dir}; expected the same folder: clear capture_dir to use the server's"
            )
        if not served.is_dir():
            raise SglangServerError(
                f"SGLang server {self.url}: its capture hook writes to {served}, which is not a folder here; "
                "expected a folder this machine shares with the server (the same machine or a shared volume); "
                "a server that shares none cannot serve extraction"
            )
        (served / ERROR_FILE).unlink(missing_ok=True)  # an earlier server's; this one's hook writes its own
        return served

    def _generate(self, input_ids: list[int], rid: str, canary: bool = False) -> dict:
        body = {
            "input_ids": input_ids,
            "rid": rid,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
        }
        if canary:  # both channels: JSON hidden states and top-1 logprobs at every position
            body.update(return_hidden_states=True, return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        elif self.teacher_topk:  # the top-K teacher of every position, in the same request
            body.update(TOPK_FLAGS, top_logprobs_num=self.teacher_topk)
        return request_json(
            f"{self.url}/generate",
            body,
            timeout_s=self.cfg.request_timeout_s,
            timeout_fix="raise extract.sglang.request_timeout_s, or lower extract.batch_size / the sample length, "
            "or check the server log",
            what=f"SGLang server {self.url}: POST /generate ({len(input_ids)} tokens, rid {rid})",
            fix="expected 200; see the server's log for the cause",
        )

    def _one(self, input_ids: list[int], where: str, canary: bool = False):
        rid = f"{RID_PREFIX}{uuid.uuid4().hex}"
        path = capture_file(self.capture_dir, rid)
        try:
            answer = self._generate(input_ids, rid, canary)
            wait_for_file(path, self.cfg.request_timeout_s, where)
        except SglangServerError as err:
            failure = self._failure(err, where)
            if failure is err:
                raise
            raise failure from err
        try:
            aux, last = read_capture(path, input_ids, num_aux=len(self.aux_layer_ids), hidden_size=self.hidden_size,
                                     where=where)  # fmt: skip
        finally:
            path.unlink(missing_ok=True)
        return answer, aux, last

    def _failure(self, err: SglangServerError, where: str) -> SglangServerError:
        """The request's own error while the server is up and its hook has not failed, else what stopped it, in
        the server's words (eyas.extract.backends.sglang_failure): never a bare "cannot reach" or HTTP 5xx."""
        server = self._server
        return explain_failure(err, where=where, url=self.url, capture_dir=self.capture_dir,
                               log_path=server.log_path if server else None, proc=server.proc if server else None)  # fmt: skip

    def canary(self, input_ids: list[int]) -> None:
        """The start-up check on one short prompt (see the module docstring)."""
        ids = list(input_ids)[:CANARY_TOKENS]
        where = f"SGLang server {self.url}: start-up canary ({len(ids)} tokens)"
        answer, aux, last = self._one(ids, where, canary=True)
        check_canary(answer, aux, last, lm_head_weight(self.target_path), where)
        self._canary_done = True

    def features(self, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One concurrent request per sample; results in sample order, as float32, rows and widths checked."""
        if not samples:
            return []
        if not self._canary_done:
            self.canary(samples[0].tolist())
        lengths = [len(s) for s in samples]
        source = f"SGLang server {self.url}"
        wheres = [f"{source} sample {i} ({n} tokens)" for i, n in enumerate(lengths)]
        try:
            with ThreadPoolExecutor(max_workers=len(samples)) as pool:
                results = list(pool.map(self._one, [s.tolist() for s in samples], wheres))
        except CaptureError as err:
            raise SglangServerError(f"{source}: {err}") from err
        if self.teacher_topk:
            feats = [(aux.float(), topk_from_answer(a, n, self.teacher_topk, w)) for (a, aux, _), n, w in
                     zip(results, lengths, wheres)]  # fmt: skip
        else:
            feats = [(aux.float(), last.float()) for _, aux, last in results]
        check_feature_widths(feats, lengths, num_aux=len(self.aux_layer_ids), hidden_size=self.hidden_size,
                             source=source, teacher_topk=self.teacher_topk)  # fmt: skip
        return feats

    def close(self) -> None:
        """Stop the launched server (a server at server_url is left running)."""
        self._resources.close()
