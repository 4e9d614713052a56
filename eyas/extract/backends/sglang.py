"""The `sglang` hidden-state backend: an SGLang server (>= 0.5.23) in aux-capture mode, over HTTP.

    backend = SGLangBackend(cfg.extract.sglang, target_path="meta-llama/Llama-3.1-8B-Instruct",
                            aux_layer_ids=[2, 16, 29], hidden_size=4096)
    [(aux, last), ...] = backend.features([ids_0, ids_1])   # aux [t_i, 3*4096], last [t_i, 4096], float32
    backend.close()

On a GPU box, eyas launches this server itself when `extract.sglang.server_url` is empty (port, tp size
and memory fraction from `extract.sglang`; the ids are the run's `target.aux_layer_ids` less 1):

    python -m sglang.launch_server --model-path TARGET --host 127.0.0.1 --port 30000 \\
        --tp-size 1 --mem-fraction-static 0.8 --pp-size 1 --speculative-algorithm EAGLE3 \\
        --enable-return-hidden-states --enable-return-aux-hidden-states --disable-radix-cache \\
        --chunked-prefill-size -1 \\
        --json-model-override-args '{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": true}}'

To reuse a server started by hand with that command, point eyas at it in the run config:
`"extract": {"backend": "sglang", "sglang": {"server_url": "http://GPU-HOST:30000"}}`.
`eyas.extract.backends.sglang.build_extract_command(cfg, target_path=..., aux_layer_ids=...)` gives the exact argv.

Protocol, as SGLang's sources show it (sgl-project/sglang, python/sglang/srt/...):
- POST /generate {"input_ids": [...], "sampling_params": {"temperature": 0, "max_new_tokens": 1},
  "return_hidden_states": true}; the server refuses it (HTTP 400) unless started with
  --enable-return-hidden-states (managers/tokenizer_manager.py, `_validate_one_request`).
- The answer's `meta_info["hidden_states"]` is a list: element 0 holds the prompt's rows, [prompt tokens]
  [width] floats (the prefill slice of the request, `.cpu().tolist()`, so JSON numbers that round-trip the
  model dtype exactly); each decode step then appends one [width] row
  (managers/scheduler_output_processor_mixin.py). With max_new_tokens 1 no decode step runs; any later
  rows are generated tokens' and dropped here.
- The prefill slice is `len(origin_input_ids)` rows of the last extend chunk: a radix-cache hit (prefix not
  recomputed) or a chunked prefill would misalign it, hence --disable-radix-cache and --chunked-prefill-size -1.
- Under --speculative-algorithm EAGLE3 the target captures aux states and the stored hidden states are
  `torch.cat(aux_hidden_states, -1)`, n_aux*H wide, in layer order (layers/logits_processor.py); otherwise
  (EAGLE, none) they are the final layer's, H wide. Llama/Qwen capture `layers_to_capture = [id + 1 ...]`
  for the configured `eagle_aux_hidden_state_layer_ids` (the input of layer id+1, HF hidden_states[id+1]);
  without ids SGLang captures [2, N//2, N-3] (models/llama.py, `set_eagle3_layers_to_capture`).
- GET /server_info answers the server args (`speculative_algorithm`, `pp_size`, `disable_radix_cache`,
  `chunked_prefill_size`, `enable_return_hidden_states`, `json_model_override_args`, ...) and "version"
  (entrypoints/http_server.py; /get_server_info is its deprecated alias).

Not confirmed against SGLang's source for the >= 0.5.23 aux-capture mode: that
--enable-return-aux-hidden-states, with EAGLE3 and no draft path, makes the target capture the aux layers
named by the target config's `eagle_config.eagle_aux_hidden_state_layer_ids` (set here through
--json-model-override-args, in the sglang_llama numbering), keeps `meta_info["hidden_states"]` as the aux
concatenation above, and adds `meta_info["last_hidden_states"]` in the same layout with the final layer's
(normed, lm_head-input) states; and that /server_info reports the flag as `enable_return_aux_hidden_states`
(checked only when present). The field names live in AUX_FIELD / LAST_FIELD and the flags in
`aux_capture_flags`; every answer is checked (widths, rows per prompt token), so a server that differs fails
on the first batch with the list of likely causes instead of writing wrong features.
Cost: JSON numbers take about 10x the bytes of bf16 tensors; keep extract.batch_size modest for long samples.
"""

from __future__ import annotations

import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import torch

from eyas.config import SGLangExtractConfig
from eyas.engines.sglang import (
    SGLANG_ALGORITHM,
    SGLANG_LAYER_ID_CONVENTION,
    SglangLaunch,
    SglangServer,
    SglangServerError,
    build_launch_command,
    parse_version,
    request_json,
)
from eyas.extract.backends.base import check_aux_width, check_feature_widths
from eyas.layer_ids import from_engine_layer_ids, to_engine_layer_ids

MIN_SGLANG_VERSION = (0, 5, 23)
AUX_FIELD = "hidden_states"  # meta_info key: [prompt rows [t][n_aux*H], then one row per generated token]
LAST_FIELD = "last_hidden_states"  # meta_info key, same layout, width H (assumed, see the module docstring)
MAX_NEW_TOKENS = 1  # SGLang samples one token after the prefill; the prompt's rows come with it
UPGRADE = "pip install -U 'sglang>=0.5.23' on the GPU machine and relaunch the server"

# (server_info field, required value, launch flag, why): the server args extraction depends on.
SERVER_REQUIREMENTS = (
    ("speculative_algorithm", SGLANG_ALGORITHM, f"--speculative-algorithm {SGLANG_ALGORITHM}",
     "with EAGLE or none the server returns the last layer's states (H wide), not the aux layers'"),
    ("pp_size", 1, "--pp-size 1", "aux capture sees the last pipeline stage only"),
    ("disable_radix_cache", True, "--disable-radix-cache",
     "a cached prompt prefix is not recomputed, so its rows are missing or misaligned"),
    ("chunked_prefill_size", -1, "--chunked-prefill-size -1",
     "a chunked prompt returns the rows of its last chunk only, misaligned"),
    ("enable_return_hidden_states", True, "--enable-return-hidden-states",
     "the server refuses requests for hidden states"),
)  # fmt: skip


class SGLangVersionError(SglangServerError):
    """The SGLang server is older than the aux-capture mode extraction needs."""


def layer_override(engine_layer_ids: list[int]) -> str:
    """--json-model-override-args value naming the aux layers (SGLang numbering)."""
    eagle = {"eagle_aux_hidden_state_layer_ids": list(engine_layer_ids), "use_aux_hidden_state": True}
    return json.dumps({"eagle_config": eagle})


def aux_capture_flags(cfg: SGLangExtractConfig, engine_layer_ids: list[int]) -> list[str]:
    """The launch_server flags of aux-capture mode, after --model-path/--host/--port."""
    return [
        "--tp-size", str(cfg.tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static), "--pp-size", "1",
        "--speculative-algorithm", SGLANG_ALGORITHM, "--enable-return-hidden-states",
        "--enable-return-aux-hidden-states", "--disable-radix-cache", "--chunked-prefill-size", "-1",
        "--json-model-override-args", layer_override(engine_layer_ids),
    ]  # fmt: skip


def extract_launch(
    cfg: SGLangExtractConfig,
    *,
    target_path: str,
    aux_layer_ids: list[int],
    module: str = "sglang.launch_server",
    python: str = sys.executable,
) -> SglangLaunch:
    """The server eyas launches (eyas.engines.sglang runs it); refuses extra_args that override ours."""
    own = aux_capture_flags(cfg, to_engine_layer_ids(list(aux_layer_ids), SGLANG_LAYER_ID_CONVENTION))
    aliases = {"--model-path", "--host", "--port", "--tp", "--tensor-parallel-size", "--pipeline-parallel-size"}
    own_flags = aliases | {a for a in own if a.startswith("--")}
    clashes = sorted({a.split("=")[0] for a in cfg.extra_args} & own_flags)
    if clashes:
        raise ValueError(
            f"extract.sglang.extra_args={cfg.extra_args}: {', '.join(clashes)} would override what eyas sets "
            "for aux-capture mode; remove them (port, tp_size, mem_fraction_static are extract.sglang fields, "
            "layer ids come from target.aux_layer_ids)"
        )
    extra = tuple(own + list(cfg.extra_args))
    return SglangLaunch(target_path, None, port=cfg.port, extra_args=extra, module=module, python=python)


def build_extract_command(cfg: SGLangExtractConfig, *, target_path: str, aux_layer_ids: list[int], **kw) -> list[str]:
    """argv of the aux-capture server for this config."""
    return build_launch_command(extract_launch(cfg, target_path=target_path, aux_layer_ids=aux_layer_ids, **kw))


def served_layer_ids(info: dict) -> list[int] | None:
    """eagle_config.eagle_aux_hidden_state_layer_ids of the server's --json-model-override-args, if any."""
    overrides = info.get("json_model_override_args") or "{}"
    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    return ((overrides or {}).get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def lint_server_args(info: dict, aux_layer_ids: list[int]) -> list[str]:
    """Every way the server's args (GET /server_info) differ from aux-capture mode; [] when sound."""
    problems = []
    for name, required, flag, why in SERVER_REQUIREMENTS:
        if info.get(name, "(absent)") != required:
            problems.append(f"{name}={info.get(name, '(absent)')!r}, expected {required!r}: {why}; launch with {flag}")
    if info.get("enable_return_aux_hidden_states", True) is not True:
        problems.append("enable_return_aux_hidden_states is off; launch with --enable-return-aux-hidden-states")
    engine = to_engine_layer_ids(list(aux_layer_ids), SGLANG_LAYER_ID_CONVENTION)
    try:
        served = served_layer_ids(info)
    except (json.JSONDecodeError, AttributeError) as err:
        served = f"unreadable ({err})"
    if served != engine:
        if served is None:
            found = "no eagle_config.eagle_aux_hidden_state_layer_ids (SGLang then captures its default layers)"
        elif isinstance(served, list):
            canonical = from_engine_layer_ids(served, SGLANG_LAYER_ID_CONVENTION)
            found = f"eagle_config.eagle_aux_hidden_state_layer_ids={served} (hidden_states {canonical})"
        else:
            found = f"json_model_override_args {served}"
        problems.append(
            f"captures {found}, expected {engine} ({SGLANG_LAYER_ID_CONVENTION}; hidden_states "
            f"{list(aux_layer_ids)}, the run's target.aux_layer_ids); launch with "
            f"--json-model-override-args '{layer_override(engine)}'"
        )
    return problems


def check_server(url: str, *, aux_layer_ids: list[int], timeout_s: float) -> dict:
    """GET /server_info: refuse an SGLang older than 0.5.23 or not in aux-capture mode; the info when sound."""
    need = ".".join(map(str, MIN_SGLANG_VERSION))
    fix = f"expected SGLang >= {need}, which serves GET /server_info with its version; check extract.sglang.server_url"
    info = request_json(f"{url}/server_info", None, timeout_s=timeout_s, what=f"SGLang server {url}", fix=fix)
    version = info.get("version") if isinstance(info, dict) else None
    parsed = parse_version(version) if isinstance(version, str) else None
    if parsed is None:
        raise SglangServerError(f"SGLang server {url}: GET /server_info has version {version!r}; {fix}")
    if parsed < MIN_SGLANG_VERSION:
        raise SGLangVersionError(
            f"SGLang server {url}: version {version}, expected >= {need} (the first with "
            f"--enable-return-aux-hidden-states, the aux-capture mode extraction needs); {UPGRADE}"
        )
    problems = lint_server_args(info, aux_layer_ids)
    if problems:
        raise SglangServerError(
            f"SGLang server {url} (version {version}) is not in aux-capture mode as extraction needs:\n  "
            + "\n  ".join(problems)
        )
    return info


def _prompt_rows(meta: dict, field: str, where: str, fix: str) -> torch.Tensor:
    blocks = meta.get(field)
    if not isinstance(blocks, list) or not blocks:
        found = "absent" if blocks is None else f"{type(blocks).__name__} {str(blocks)[:80]}"
        raise SglangServerError(
            f"{where}: meta_info.{field} is {found}, expected a list whose first element holds the prompt's rows; {fix}"
        )
    try:
        rows = torch.tensor(blocks[0], dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise SglangServerError(
            f"{where}: meta_info.{field}[0] is not a rectangular [prompt tokens][width] list of numbers ({err})"
        ) from err
    if rows.dim() != 2:
        raise SglangServerError(
            f"{where}: meta_info.{field}[0] has shape {list(rows.shape)}, expected [prompt tokens, width]"
        )
    return rows


def parse_answer(answer, *, num_aux: int, hidden_size: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One /generate answer -> (aux [t, n_aux*H], last [t, H]) of the prompt; generated tokens' rows dropped."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise SglangServerError(
            f"{where}: answer without a meta_info object: {str(answer)[:200]}; expected SGLang's "
            "/generate answer {text, output_ids, meta_info}"
        )
    aux = _prompt_rows(
        meta, AUX_FIELD, where, "the server returned no hidden states: launch it with --enable-return-hidden-states"
    )
    check_aux_width(aux.shape[1], num_aux=num_aux, hidden_size=hidden_size, source=where)
    last = _prompt_rows(
        meta,
        LAST_FIELD,
        where,
        f"the server returned the aux states but not the final layer's: expected SGLang >= "
        f"{'.'.join(map(str, MIN_SGLANG_VERSION))} launched with --enable-return-aux-hidden-states",
    )
    return aux, last


class SGLangBackend:
    """Hidden states from an SGLang server in aux-capture mode: launched here, or at extract.sglang.server_url."""

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
    ):
        self.cfg, self.aux_layer_ids, self.hidden_size = cfg, list(aux_layer_ids), hidden_size
        with ExitStack() as stack:
            if cfg.server_url:
                self.url = cfg.server_url.rstrip("/")
            else:
                launch = extract_launch(
                    cfg, target_path=target_path, aux_layer_ids=self.aux_layer_ids, module=launch_module
                )
                log = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="eyas-sglang-")) / "server.log"
                self.url = stack.enter_context(SglangServer(launch, log, cfg.startup_timeout_s))
            timeout_s = cfg.request_timeout_s
            self.server_info = check_server(self.url, aux_layer_ids=self.aux_layer_ids, timeout_s=timeout_s)
            self._resources = stack.pop_all()

    def _generate(self, input_ids: list[int]) -> dict:
        body = {
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
            "return_hidden_states": True,
        }
        return request_json(
            f"{self.url}/generate",
            body,
            timeout_s=self.cfg.request_timeout_s,
            timeout_fix="raise extract.sglang.request_timeout_s, or lower extract.batch_size / the sample length, "
            "or check the server log",
            what=f"SGLang server {self.url}: POST /generate ({len(input_ids)} tokens)",
            fix="expected 200 with meta_info.hidden_states; see the server's log for the cause",
        )

    def features(self, samples: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One concurrent request per sample; results in sample order, widths and row counts checked."""
        if not samples:
            return []
        lengths = [len(s) for s in samples]
        with ThreadPoolExecutor(max_workers=len(samples)) as pool:
            answers = list(pool.map(self._generate, [s.tolist() for s in samples]))
        num_aux, source = len(self.aux_layer_ids), f"SGLang server {self.url}"
        feats = [
            parse_answer(a, num_aux=num_aux, hidden_size=self.hidden_size, where=f"{source} sample {i} ({n} tokens)")
            for i, (a, n) in enumerate(zip(answers, lengths))
        ]
        check_feature_widths(feats, lengths, num_aux=num_aux, hidden_size=self.hidden_size, source=source)
        return feats

    def close(self) -> None:
        """Stop the launched server (a server at server_url is left running)."""
        self._resources.close()
