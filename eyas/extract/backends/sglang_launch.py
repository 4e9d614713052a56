"""The aux-capture server of the `sglang` extraction backend: its launch command, and the check of a running one.

    argv = build_extract_command(cfg.extract.sglang, target_path=..., aux_layer_ids=[2, 30, 58],
                                 capture_dir="/mnt/eyas/runs/r/extract/sglang-capture",
                                 python="/opt/sglang/bin/python", trust_remote_code=True)
    info = check_server(url, engine_ids=[1, 29, 57], convention="sglang_deepseek", timeout_s=600,
                        allowed_versions=(), trust_remote_code=True)   # GET /server_info, refused unless sound

What SGLang 0.5.23 resolves each flag to is in eyas.extract.backends.sglang's docstring and checked against
SGLang's own argument code by tests/test_sglang_conformance.py. The /server_info lint reads the resolved values,
so a server started by hand is held to the same rules as one eyas launches, and an override that SGLang's
resolution lets win over eyas's flags (`--cuda-graph-config` and `--cuda-graph-backend-prefill` over
`--disable-prefill-cuda-graph`, arg_groups/cuda_graph_hook.py) is refused by what it resolves to.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from eyas.config import SGLangExtractConfig
from eyas.engines.sglang import (
    SGLANG_ALGORITHM,
    TRUST_REMOTE_CODE_FLAG,
    SglangLaunch,
    SglangServerError,
    SGLangVersionError,
    build_launch_command,
    check_sglang_version,
    parse_version,
    request_json,
)
from eyas.layer_ids import from_engine_layer_ids, sglang_convention, target_layout, to_engine_layer_ids

MIN_SGLANG_VERSION = (0, 5, 23)
UPGRADE = "pip install -U 'sglang>=0.5.23' on the GPU machine and relaunch the server"
CAPTURE_HOOK_NAME = "eyas-capture"
CAPTURE_HOOK_FACTORY = "eyas.extract.capture_hook:make_hook"
CAPTURE_MODULE = CAPTURE_HOOK_FACTORY.split(":")[0]
CAPTURE_MODULES = ("logits_processor", "language_model.logits_processor")  # Llama/DeepSeek; Kimi-K2.5's wrapper
RID_PREFIX = "eyas-"

# extra_args an extraction server refuses, beyond the flags eyas sets itself (and their aliases), with why.
FORBIDDEN_EXTRA_ARGS = {
    ("--cuda-graph-config", "--cuda-graph-backend-prefill"):
        "they override --disable-prefill-cuda-graph (SGLang's cuda_graph_hook.py), and a prefill replayed from a "
        "CUDA graph runs no forward hook",
    ("--cuda-graph-max-bs-prefill", "--cuda-graph-bs-prefill", "--cuda-graph-max-seq-len-prefill"):
        "they size prefill CUDA graphs, which extraction turns off: they would do nothing",
    ("--enable-dp-attention", "--attn-dp-size"):
        "the capture hook writes from TP rank 0, which sees the requests of its own data-parallel group only",
    ("--return-hidden-states-mode",): "--enable-return-hidden-states sets it to 'full', every row of a prefill",
    ("--enable-torch-compile",):
        "extraction runs one prefill a prompt, eagerly, where the hook fires; torch.compile speeds up decode "
        "graphs only and the hook was not checked under it",
}  # fmt: skip
OWN_ALIASES = {"--model-path", "--model", "--host", "--port", "--tp", "--tensor-parallel-size",
               "--pipeline-parallel-size", "--json-model-override-args", "--speculative-draft-model-path"}  # fmt: skip


def target_family(target_path: str | Path) -> tuple[list[str], int | None]:
    """(architectures, decoder layers) of the target's config.json."""
    path = Path(target_path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"target {target_path}: no config.json; expected a Hugging Face model directory")
    return target_layout(json.loads(path.read_text()))


def engine_layer_ids(aux_layer_ids: list[int], target_path: str | Path) -> tuple[list[int], str]:
    """(ids for --return-aux-hidden-state-layer-ids, their convention) for the run's canonical ids and target."""
    convention = sglang_convention(target_family(target_path)[0])
    return to_engine_layer_ids(list(aux_layer_ids), convention), convention


def hook_spec(capture_dir: str | Path) -> list[dict]:
    """The --forward-hooks value that loads eyas's capture module."""
    config = {"dir": str(capture_dir), "rid_prefix": RID_PREFIX}
    spec = {"name": CAPTURE_HOOK_NAME, "target_modules": list(CAPTURE_MODULES), "hook_factory": CAPTURE_HOOK_FACTORY}
    return [{**spec, "config": config}]


def aux_capture_flags(cfg: SGLangExtractConfig, engine_ids: list[int], capture_dir: str | Path) -> list[str]:
    """The launch_server flags of aux-capture mode with the capture hook, after --model-path/--host/--port."""
    return [
        "--tp-size", str(cfg.tp_size), "--mem-fraction-static", str(cfg.mem_fraction_static), "--pp-size", "1",
        "--speculative-algorithm", SGLANG_ALGORITHM, "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids", *map(str, engine_ids), "--enable-return-hidden-states",
        "--disable-radix-cache", "--chunked-prefill-size", "-1", "--disable-prefill-cuda-graph",
        "--forward-hooks", json.dumps(hook_spec(capture_dir)),
    ]  # fmt: skip


def refused_extra_args(cfg: SGLangExtractConfig, own: list[str]) -> list[str]:
    """Every extra_args flag that would override eyas's aux-capture flags or break the capture, with why."""
    given = sorted({a.split("=")[0] for a in cfg.extra_args if a.startswith("--")})
    own_flags = OWN_ALIASES | {a for a in own if a.startswith("--")}
    problems = []
    clashes = [f for f in given if f in own_flags]
    if clashes:
        problems.append(
            f"{', '.join(clashes)} would override what eyas sets for aux-capture mode (port, tp_size, "
            "mem_fraction_static, capture_dir are extract.sglang fields, layer ids come from target.aux_layer_ids)"
        )
    for flags, why in FORBIDDEN_EXTRA_ARGS.items():
        found = [f for f in given if f in flags]
        if found:
            problems.append(f"{', '.join(found)}: {why}")
    return problems


def extract_launch(
    cfg: SGLangExtractConfig,
    *,
    target_path: str,
    aux_layer_ids: list[int],
    capture_dir: str | Path,
    module: str = "sglang.launch_server",
    python: str = sys.executable,
    trust_remote_code: bool = False,
    allowed_versions: Sequence[str] = (),
) -> SglangLaunch:
    """The server eyas launches (eyas.engines.sglang runs it) with SGLang's interpreter `python`; refuses
    extra_args that override ours."""
    own = aux_capture_flags(cfg, engine_layer_ids(aux_layer_ids, target_path)[0], capture_dir)
    problems = refused_extra_args(cfg, own)
    if problems:
        raise ValueError(f"extract.sglang.extra_args={cfg.extra_args}: remove them:\n  " + "\n  ".join(problems))
    extra = tuple(own + list(cfg.extra_args))
    return SglangLaunch(target_path, None, port=cfg.port, extra_args=extra, module=module, python=python,
                        trust_remote_code=trust_remote_code, allowed_versions=tuple(allowed_versions))  # fmt: skip


def build_extract_command(
    cfg: SGLangExtractConfig, *, target_path: str, aux_layer_ids: list[int], capture_dir: str | Path, **kw
) -> list[str]:
    """argv of the aux-capture server for this config."""
    launch = extract_launch(cfg, target_path=target_path, aux_layer_ids=aux_layer_ids, capture_dir=capture_dir, **kw)
    return build_launch_command(launch)


def served_capture_dir(info: dict) -> str | None:
    """The `dir` of eyas's capture hook in the server's forward_hooks (GET /server_info), if it has one."""
    for spec in info.get("forward_hooks") or []:
        if isinstance(spec, dict) and spec.get("hook_factory") == CAPTURE_HOOK_FACTORY:
            return (spec.get("config") or {}).get("dir")
    return None


# (server_info field, required value, launch flag, why): what extraction depends on, as /server_info reports it.
SERVER_REQUIREMENTS = (
    ("aux_hidden_state_capture", "eagle3",
     f"--speculative-algorithm {SGLANG_ALGORITHM} --enable-return-aux-hidden-states",
     "without aux-capture mode the server keeps the last layer's states (H wide), not the aux layers'"),
    ("speculative_algorithm", None, "no --speculative-draft-model-path",
     "a speculative server runs a draft and does not return the target's capture"),
    ("return_hidden_states_mode", "full", "--enable-return-hidden-states",
     "in 'last' mode a prefill keeps one row per request"),
    ("enable_return_hidden_states", True, "--enable-return-hidden-states",
     "the start-up canary asks for hidden states in its answer"),
    ("pp_size", 1, "--pp-size 1", "the capture hooks see the layers of the last pipeline rank only"),
    ("disable_radix_cache", True, "--disable-radix-cache",
     "a cached prompt prefix is not recomputed, so its rows are missing"),
    ("chunked_prefill_size", -1, "--chunked-prefill-size -1", "a chunked prompt arrives in several prefills"),
    ("disable_prefill_cuda_graph", True, "--disable-prefill-cuda-graph",
     "a prefill replayed from a CUDA graph does not run forward hooks"),
)  # fmt: skip
DP_WHY = "the hook writes from TP rank 0, which sees the requests of its own data-parallel group only"


def _data_parallel_attention(info: dict) -> list[str]:
    """SGLang 0.5.23 reports DP attention as `enable_dp_attention` (attn_dp_size > 1, marked for removal after
    2026-12-31: server_args.py) and `attn_dp_size`; either saying it is on refuses the server, and once the first
    is gone the second decides."""
    flag, size = info.get("enable_dp_attention", "(absent)"), info.get("attn_dp_size", "(absent)")
    if flag in (False, "(absent)") and size in (1, "(absent)") and (flag, size) != ("(absent)", "(absent)"):
        return []
    return [f"enable_dp_attention={flag!r}, attn_dp_size={size!r}, expected false / 1: {DP_WHY}; launch without "
            "--attn-dp-size / --enable-dp-attention"]  # fmt: skip


def _prefill_graph(info: dict) -> list[str]:
    """The prefill phase's resolved CUDA-graph backend: --cuda-graph-config and --cuda-graph-backend-prefill win
    over --disable-prefill-cuda-graph, and /server_info still reports the latter true (cuda_graph_hook.py)."""
    graphs = info.get("cuda_graph_config")
    backend = (graphs.get("prefill") or {}).get("backend", "(absent)") if isinstance(graphs, dict) else "(absent)"
    if backend == "disabled":
        return []
    return [f"cuda_graph_config.prefill.backend={backend!r}, expected 'disabled': a prefill replayed from a CUDA "
            "graph runs no forward hook, so no capture file appears and each request waits out request_timeout_s; "
            "launch without --cuda-graph-config / --cuda-graph-backend-prefill (they override "
            "--disable-prefill-cuda-graph)"]  # fmt: skip


def lint_server_info(
    info: dict, engine_ids: list[int], convention: str, *, trust_remote_code: bool = False
) -> list[str]:
    """Every way a server (GET /server_info) differs from what extraction needs; [] when sound."""
    problems = []
    for name, required, flag, why in SERVER_REQUIREMENTS:
        found = info.get(name, "(absent)")
        if found != required:
            problems.append(f"{name}={found!r}, expected {required!r}: {why}; launch with {flag}")
    problems += _prefill_graph(info) + _data_parallel_attention(info)
    if trust_remote_code and info.get("trust_remote_code") is not True:
        problems.append(
            f"trust_remote_code={info.get('trust_remote_code', '(absent)')!r}, expected True: target.trust_remote_code "
            f"is true (the target's config or tokenizer loads through its own code); launch with {TRUST_REMOTE_CODE_FLAG}"
        )
    served = info.get("return_aux_hidden_state_layer_ids", "(absent)")
    if served != list(engine_ids):
        if isinstance(served, list):
            found = f"{served} (hidden_states {from_engine_layer_ids(served, convention)})"
        else:
            found = f"{served!r} (SGLang then captures its default layers)" if served is None else repr(served)
        problems.append(
            f"return_aux_hidden_state_layer_ids={found}, expected {list(engine_ids)} ({convention}: hidden_states "
            f"{from_engine_layer_ids(list(engine_ids), convention)}, the run's target.aux_layer_ids); launch with "
            f"--return-aux-hidden-state-layer-ids {' '.join(map(str, engine_ids))}"
        )
    if served_capture_dir(info) is None:
        problems.append(
            f"forward_hooks={info.get('forward_hooks')!r}: expected eyas's capture hook ({CAPTURE_HOOK_FACTORY}); "
            f"launch with --forward-hooks '{json.dumps(hook_spec('CAPTURE_DIR'))}' (eyas engine-command prints it)"
        )
    return problems


def check_server_version(info: dict, url: str, allowed_versions: Sequence[str], fix: str) -> str:
    """The server's version from its /server_info: refused when older than 0.5.23, or unchecked and not allowed."""
    version = info.get("version") if isinstance(info, dict) else None
    parsed = parse_version(version) if isinstance(version, str) else None
    if parsed is None:
        raise SglangServerError(f"SGLang server {url}: GET /server_info has version {version!r}; {fix}")
    if parsed < MIN_SGLANG_VERSION:
        raise SGLangVersionError(
            f"SGLang server {url}: version {version}, expected >= {'.'.join(map(str, MIN_SGLANG_VERSION))} (the "
            f"first with --enable-return-aux-hidden-states and --return-aux-hidden-state-layer-ids); {UPGRADE}"
        )
    check_sglang_version(version, allowed_versions, f"SGLang server {url}")
    return version


def check_server(
    url: str,
    *,
    engine_ids: list[int],
    convention: str,
    timeout_s: float,
    allowed_versions: Sequence[str] = (),
    trust_remote_code: bool = False,
) -> dict:
    """GET /server_info: refuse an SGLang release eyas cannot use or a server not set up for extraction; the
    info when sound."""
    need = ".".join(map(str, MIN_SGLANG_VERSION))
    fix = f"expected SGLang >= {need}, which serves GET /server_info with its version; check extract.sglang.server_url"
    info = request_json(f"{url}/server_info", None, timeout_s=timeout_s, what=f"SGLang server {url}", fix=fix)
    version = check_server_version(info, url, allowed_versions, fix)
    problems = lint_server_info(info, engine_ids, convention, trust_remote_code=trust_remote_code)
    if problems:
        raise SglangServerError(
            f"SGLang server {url} (version {version}) is not set up for extraction:\n  " + "\n  ".join(problems)
        )
    return info
