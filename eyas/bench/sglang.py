"""Acceptance and speedup on SGLang: the flag lint, the benchmark run on a speculative and a baseline server.

    from eyas.engines.sglang import SglangLaunch
    from eyas.bench.sglang import run_sglang_benchmark
    launch = SglangLaunch(target_path="meta-llama/Llama-3.1-8B-Instruct", draft_path="run/export/sglang",
                          steps=3, topk=1, num_draft_tokens=4, port=30000)
    result = run_sglang_benchmark(launch, prompt_ids, max_new_tokens=256, shard_aux_layer_ids=[2, 16, 29])

The exact commands it runs (GPU machine; SGLANG_PYTHON is sglang.python, SGLang's own environment; a target
with target.trust_remote_code also gets --trust-remote-code), first with the draft, then without:

    SGLANG_PYTHON -m sglang.launch_server --model-path TARGET --host 127.0.0.1 --port 30000 \\
        --speculative-algorithm EAGLE3 --speculative-draft-model-path run/export/sglang \\
        --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
    SGLANG_PYTHON -m sglang.launch_server --model-path TARGET --host 127.0.0.1 --port 30000

Each server is waited for on GET /health, given every prompt concurrently as
POST /generate {"input_ids": [...], "sampling_params": {"temperature": 0, "max_new_tokens": N}}
(answer: {"text", "output_ids", "meta_info": {"completion_tokens", "spec_verify_ct", ...}}), then
stopped. tau = sum(completion_tokens) / sum(spec_verify_ct), as SGLang's own benchmarks count it
(SGLang adds spec_verify_ct only when speculation is on); the speedup is the ratio of output
throughputs (completion tokens / wall seconds) of the two runs on the same prompts.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eyas.config import RunConfig
from eyas.engines.sglang import (
    SGLANG_ALGORITHM,
    SGLANG_DRAFT_ARCHITECTURE,
    SPEC_SHAPE_FLAGS,
    TRUST_REMOTE_CODE_FLAG,
    SglangLaunch,
    SglangServer,
    SglangServerError,
    build_launch_command,
    engine_python,
    request_json,
)
from eyas.layer_ids import from_engine_layer_ids, sglang_convention, target_layout


class LaunchFlagError(ValueError):
    """The SGLang launch command would run, but not the way the benchmark needs."""


def _flags(argv: list[str]) -> dict[str, str]:
    flags, i = {}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            name, eq, value = argv[i].partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            flags[name] = value
        i += 1
    return flags


def _lint_shape(flags: dict[str, str]) -> list[str]:
    given = [f for f in SPEC_SHAPE_FLAGS if f in flags]
    if given and len(given) != len(SPEC_SHAPE_FLAGS):
        missing = [f for f in SPEC_SHAPE_FLAGS if f not in flags]
        return [
            f"launch flags: {', '.join(given)} given without {', '.join(missing)}; expected all three or none "
            "(SGLang fills the others with its own defaults): pass steps, topk and draft tokens together"
        ]
    if not given:
        return []
    steps, topk, tokens = (int(flags[f]) for f in SPEC_SHAPE_FLAGS)
    if topk == 1 and tokens != steps + 1:
        return [
            f"launch flags: --speculative-eagle-topk 1 with --speculative-num-draft-tokens {tokens}, expected "
            f"steps + 1 = {steps + 1}; SGLang rewrites it for a chain: pass {steps + 1}"
        ]
    return []


def _lint_draft(draft_path: str, shard_aux_layer_ids: list[int] | None, convention: str) -> list[str]:
    root = Path(draft_path)
    config_path = root / "config.json"
    if not config_path.is_file() or not (root / "model.safetensors").is_file():
        return [f"--speculative-draft-model-path {root}: no config.json or model.safetensors there; expected an export"]
    config = json.loads(config_path.read_text())
    problems = []
    if config.get("architectures") != [SGLANG_DRAFT_ARCHITECTURE]:
        problems.append(
            f"draft {config_path}: architectures {config.get('architectures')}, expected "
            f"[{SGLANG_DRAFT_ARCHITECTURE!r}]; SGLang would build another model class"
        )
    if "draft_vocab_size" not in config:
        problems.append(
            f"draft {config_path}: no draft_vocab_size; SGLang then replaces the trained lm_head with the "
            "target's: re-export with an explicit draft_vocab_size"
        )
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        problems.append(
            f"draft {config_path}: eagle_config.use_aux_hidden_state is false; SGLang then sends last-layer "
            "states only: set it to true"
        )
    engine_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if shard_aux_layer_ids is not None:
        canonical = None if engine_ids is None else from_engine_layer_ids(engine_ids, convention)
        if canonical != list(shard_aux_layer_ids):
            problems.append(
                f"draft {config_path}: eagle_config.eagle_aux_hidden_state_layer_ids={engine_ids} "
                f"({convention}) captures hidden_states {canonical}, but the shards were "
                f"extracted at {list(shard_aux_layer_ids)} (hf_hidden_states); re-export with the shards' ids"
            )
    return problems


def _target_convention(flags: dict[str, str]) -> tuple[str, list[str]]:
    """(the numbering SGLang reads the draft's ids in for the --model-path target's family, problems)."""
    model = flags.get("--model-path", flags.get("--model", ""))
    config = Path(model) / "config.json"
    if not config.is_file():
        return "sglang_llama", [
            f"launch flags: --model-path {model} has no config.json here; expected the target's model directory "
            "(its architectures decide how SGLang numbers the draft's aux layers)"
        ]
    return sglang_convention(target_layout(json.loads(config.read_text()))[0]), []


def lint_launch_command(
    argv: list[str], *, shard_aux_layer_ids: list[int] | None = None, trust_remote_code: bool = False
) -> list[str]:
    """Every problem of an SGLang launch command for an EAGLE-3 benchmark; [] when it is sound.
    `trust_remote_code`: the target needs its own code (target.trust_remote_code), so the command must say so."""
    flags = _flags(argv)
    algorithm = flags.get("--speculative-algorithm")
    problems = []
    if trust_remote_code and TRUST_REMOTE_CODE_FLAG not in flags:
        problems.append(
            f"launch flags: no {TRUST_REMOTE_CODE_FLAG}, but target.trust_remote_code is true (the target's config "
            f"or tokenizer loads through its own code): pass {TRUST_REMOTE_CODE_FLAG}"
        )
    if algorithm is not None and algorithm != SGLANG_ALGORITHM:
        problems.append(
            f"launch flags: --speculative-algorithm {algorithm}, expected {SGLANG_ALGORITHM}; with {algorithm} "
            "an EAGLE-3 draft silently receives last-layer states instead of the aux layers"
        )
    if algorithm is None and any(f in flags for f in SPEC_SHAPE_FLAGS + ("--speculative-draft-model-path",)):
        problems.append("launch flags: speculative flags without --speculative-algorithm; pass EAGLE3")
    problems += _lint_shape(flags)
    if algorithm is not None:
        draft = flags.get("--speculative-draft-model-path")
        if draft is None:
            problems.append("launch flags: --speculative-algorithm without --speculative-draft-model-path")
        else:
            convention, unknown = _target_convention(flags) if shard_aux_layer_ids is not None else ("", [])
            problems += unknown or _lint_draft(draft, shard_aux_layer_ids, convention)
    pp = flags.get("--pp-size", flags.get("--pipeline-parallel-size", "1"))
    if pp != "1":
        problems.append(f"launch flags: pipeline parallel size {pp}, expected 1; aux capture sees the last stage only")
    return problems


def check_launch_command(
    argv: list[str], *, shard_aux_layer_ids: list[int] | None = None, trust_remote_code: bool = False
) -> None:
    problems = lint_launch_command(argv, shard_aux_layer_ids=shard_aux_layer_ids, trust_remote_code=trust_remote_code)
    if problems:
        raise LaunchFlagError(f"SGLang launch command {' '.join(argv)}:\n  " + "\n  ".join(problems))


def generate(base_url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = 600) -> dict:
    """One greedy POST /generate; the answer's JSON ({"text", "output_ids", "meta_info"})."""
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    answer = request_json(
        f"{base_url}/generate",
        body,
        timeout_s=timeout_s,
        what=f"SGLang server {base_url}: POST /generate ({len(input_ids)} prompt tokens)",
        fix="expected 200 with meta_info; see the server's log (bench/sglang-*.log) for the cause",
    )
    if not isinstance(answer, dict) or "completion_tokens" not in (answer.get("meta_info") or {}):
        raise SglangServerError(
            f"{base_url}/generate: answer without meta_info.completion_tokens: {str(answer)[:300]}; expected "
            "SGLang's /generate answer {text, output_ids, meta_info}: check that the server at this port is SGLang"
        )
    finish = answer["meta_info"].get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        # an aborted request (Scheduler.abort_request, FINISH_ABORT) still answers 200 with the tokens so far:
        # its partial count would enter tau as if the draft had stopped there
        raise SglangServerError(
            f"{base_url}/generate: the server aborted the request ({finish.get('message') or 'no message'}) after "
            f"{answer['meta_info']['completion_tokens']} tokens; expected a finished answer: see the server's log "
            "(bench/sglang-*.log) for why it aborted (memory, a timeout, /abort_request), then rerun the benchmark"
        )
    return answer


def run_prompts(base_url: str, prompts: list[list[int]], max_new_tokens: int, concurrency: int):
    """(answers in prompt order, wall seconds) with `concurrency` requests in flight."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        answers = list(pool.map(lambda ids: generate(base_url, ids, max_new_tokens), prompts))
    return answers, time.perf_counter() - start


def sglang_tau(answers: list[dict], where: str) -> tuple[float, list[float | None], int]:
    """(pooled completion_tokens / spec_verify_ct, per-request values, answers ended at prefill).

    SGLang adds spec_verify_ct only when it is > 0 (managers/tokenizer_manager.py, `_calculate_spec_decoding_
    metrics`): an answer that ended at prefill (its first token was the end) has none and counts as 0 verify
    steps; its per-request value is None and its one token is left out of tau (no verify step produced it) but
    counted in the throughput. When no answer has spec_verify_ct the server ran without speculation."""
    metas = [a["meta_info"] for a in answers]
    verify = [int(m.get("spec_verify_ct") or 0) for m in metas]
    if answers and not any(verify):
        raise SglangServerError(
            f"{where}: none of the {len(answers)} answers has meta_info.spec_verify_ct; expected a speculative "
            "server to count its verification steps: the server ran without speculation (check "
            "--speculative-algorithm)"
        )
    per = [m["completion_tokens"] / v if v else None for m, v in zip(metas, verify)]
    spoken = sum(m["completion_tokens"] for m, v in zip(metas, verify) if v)
    return spoken / sum(verify), per, verify.count(0)


def bench_launch(config: RunConfig, export_dir: str | Path) -> SglangLaunch:
    """The speculative server of the run's benchmark (`.baseline()`: the same without the draft)."""
    b = config.bench
    return SglangLaunch(
        target_path=config.target.model_path,
        draft_path=str(export_dir),
        steps=b.num_steps,
        topk=b.topk,
        num_draft_tokens=b.draft_tokens,
        port=b.sglang_port,
        extra_args=tuple(b.sglang_extra_args),
        python=engine_python(config.sglang.python),
        trust_remote_code=config.target.trust_remote_code,
        allowed_versions=tuple(config.sglang.allow_unchecked_versions),
    )


def run_sglang_benchmark(
    launch: SglangLaunch,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    concurrency: int = 16,
    startup_timeout_s: float = 900,
    shard_aux_layer_ids: list[int] | None = None,
    log_dir: str | Path = ".",
) -> dict:
    """tau on the speculative server, speedup against the same prompts without speculation."""
    spec_argv = build_launch_command(launch)
    check_launch_command(spec_argv, shard_aux_layer_ids=shard_aux_layer_ids)
    with SglangServer(launch, Path(log_dir) / "sglang-eagle3.log", startup_timeout_s) as url:
        spec, wall_spec = run_prompts(url, prompts, max_new_tokens, concurrency)
    with SglangServer(launch.baseline(), Path(log_dir) / "sglang-baseline.log", startup_timeout_s) as url:
        base, wall_base = run_prompts(url, prompts, max_new_tokens, concurrency)
    tau, per_prompt, prefill_only = sglang_tau(spec, where=f"SGLang server {launch.base_url}")
    tokens_spec = sum(a["meta_info"]["completion_tokens"] for a in spec)
    tokens_base = sum(a["meta_info"]["completion_tokens"] for a in base)
    return {
        "engine": "sglang",
        "tau_mean": tau,
        "tau_per_prompt": per_prompt,
        "num_verify_steps": sum(int(a["meta_info"].get("spec_verify_ct") or 0) for a in spec),
        "num_ended_at_prefill": prefill_only,
        "speedup_vs_greedy": (tokens_spec / wall_spec) / (tokens_base / wall_base),
        "wall_s_speculative": wall_spec,
        "wall_s_greedy": wall_base,
        "num_outputs_equal_to_greedy": sum(a.get("output_ids") == b.get("output_ids") for a, b in zip(spec, base)),
        "launch_command": spec_argv,
        "baseline_command": build_launch_command(launch.baseline()),
        "steps": launch.steps,
        "topk": launch.topk,
        "num_draft_tokens": launch.num_draft_tokens,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "concurrency": concurrency,
    }
