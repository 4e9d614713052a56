"""SGLang mode: launch command and its lint, and the client against a double of the server.

The double (tests/sglang_double.py) speaks SGLang's documented protocol: GET /health, POST /generate
with meta_info.completion_tokens and, only with speculation, meta_info.spec_verify_ct.
The real run is `test_real_sglang_accepts_the_draft_about_as_the_reference_engine_does` behind the `gpu` marker.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from sglang_conformance import TINY_DRAFT_CONFIG

from eyas.bench.sglang import (
    LaunchFlagError,
    check_launch_command,
    generate,
    lint_launch_command,
    run_sglang_benchmark,
    sglang_tau,
)
from eyas.engines.sglang import SglangLaunch, SglangServerError, build_launch_command

REPO = Path(__file__).resolve().parents[1]
TARGET = str(REPO / "fixtures" / "tiny-target")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def export(tmp_path) -> Path:
    """An SGLang draft directory: config.json as export_sglang writes it and an (empty) weights file."""
    out = tmp_path / "draft"
    out.mkdir()
    config = TINY_DRAFT_CONFIG
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").write_bytes(b"")
    return out


def launch_for(export: Path, **kw) -> SglangLaunch:
    return SglangLaunch(target_path=TARGET, draft_path=str(export), python="python", **kw)


def test_launch_command_is_eagle3_with_all_three_shape_flags(export):
    argv = build_launch_command(launch_for(export, steps=3, topk=1, num_draft_tokens=4, port=31000))
    assert argv == [
        "python", "-m", "sglang.launch_server", "--model-path", TARGET, "--host", "127.0.0.1", "--port", "31000",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(export),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip
    assert lint_launch_command(argv, shard_aux_layer_ids=[2, 4, 5]) == []
    assert build_launch_command(launch_for(export).baseline())[3:] == ["--model-path", TARGET, "--host",
                                                                      "127.0.0.1", "--port", "30000"]  # fmt: skip


def test_lint_refuses_eagle_instead_of_eagle3(export):
    argv = build_launch_command(launch_for(export))
    argv[argv.index("EAGLE3")] = "EAGLE"
    [problem] = lint_launch_command(argv)
    assert problem.startswith("launch flags: --speculative-algorithm EAGLE, expected EAGLE3; with EAGLE an EAGLE-3")


def test_lint_wants_steps_topk_and_draft_tokens_all_or_none(export):
    argv = build_launch_command(launch_for(export))
    i = argv.index("--speculative-eagle-topk")
    del argv[i : i + 2]
    [problem] = lint_launch_command(argv)
    assert "--speculative-num-steps, --speculative-num-draft-tokens given without --speculative-eagle-topk" in problem


def test_lint_refuses_a_chain_whose_draft_tokens_are_not_steps_plus_one(export):
    [problem] = lint_launch_command(build_launch_command(launch_for(export, num_draft_tokens=6)))
    assert "--speculative-eagle-topk 1 with --speculative-num-draft-tokens 6, expected steps + 1 = 4" in problem


def test_lint_checks_the_draft_config_against_the_shards(export):
    config = json.loads((export / "config.json").read_text())
    del config["draft_vocab_size"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (export / "config.json").write_text(json.dumps(config))
    argv = build_launch_command(launch_for(export)) + ["--pp-size", "2"]
    with pytest.raises(LaunchFlagError) as err:
        check_launch_command(argv, shard_aux_layer_ids=[2, 4, 5])
    message = str(err.value)
    assert "no draft_vocab_size; SGLang then replaces the trained lm_head" in message
    assert "captures hidden_states [3, 5, 6], but the shards were extracted at [2, 4, 5]" in message
    assert "pipeline parallel size 2, expected 1" in message


def test_lint_refuses_a_missing_draft_directory(tmp_path):
    [problem] = lint_launch_command(build_launch_command(launch_for(tmp_path / "nowhere")))
    assert "no config.json or model.safetensors there" in problem


def test_tau_counts_an_answer_without_spec_verify_ct_as_zero_verify_steps():
    answers = [{"meta_info": {"completion_tokens": 10, "spec_verify_ct": 4}}, {"meta_info": {"completion_tokens": 1}}]
    assert sglang_tau(answers, where="server") == (2.5, [2.5, None], 1)
    with pytest.raises(SglangServerError, match=r"none of the 2 answers has meta_info.spec_verify_ct"):
        sglang_tau([answers[1]] * 2, where="server")


def double_launch(export: Path) -> SglangLaunch:
    return SglangLaunch(
        target_path=TARGET,
        draft_path=str(export),
        port=free_port(),
        module="tests.sglang_double",
        python=sys.executable,
    )


def test_benchmark_against_the_protocol_double(export, tmp_path, monkeypatch, sglang_kit):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("EYAS_SGLANG_DOUBLE_ACCEPT_LENGTH", "2.5")
    monkeypatch.setenv("EYAS_SGLANG_DOUBLE_STOP_AT_PREFILL", "11")
    monkeypatch.chdir(REPO)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11]]  # the last ends at prefill: no spec_verify_ct
    result = run_sglang_benchmark(
        double_launch(export),
        prompts,
        max_new_tokens=21,
        concurrency=4,
        shard_aux_layer_ids=[2, 4, 5],
        log_dir=tmp_path,
    )
    # 20 tokens after the prefill's in ceil(20 / 2.5) = 8 verify steps; SGLang's accept length counts all 21
    assert result["engine"] == "sglang" and result["tau_mean"] == 21 / 8
    assert result["tau_per_prompt"] == [21 / 8] * 3 + [None] and result["num_ended_at_prefill"] == 1
    assert result["num_verify_steps"] == 24 and result["num_outputs_equal_to_greedy"] == 4
    assert result["launch_command"][3] == "--model-path" and "EAGLE3" in result["launch_command"]
    assert "--speculative-algorithm" not in result["baseline_command"]
    assert result["speedup_vs_greedy"] > 0
    assert (tmp_path / "sglang-eagle3.log").is_file() and (tmp_path / "sglang-baseline.log").is_file()


def test_a_server_that_dies_at_startup_is_reported_with_its_log(export, tmp_path, monkeypatch, sglang_kit):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("EYAS_SGLANG_DOUBLE_EXIT", "1")
    monkeypatch.chdir(REPO)
    with pytest.raises(SglangServerError, match=r"exited with code 1 before GET /health answered 200") as err:
        run_sglang_benchmark(double_launch(export), [[1, 2]], max_new_tokens=4, log_dir=tmp_path, startup_timeout_s=60)
    assert "double told to fail at start-up" in str(err.value)


def test_a_launch_with_bad_flags_never_starts_a_server(export, tmp_path):
    launch = launch_for(export, num_draft_tokens=9)
    with pytest.raises(LaunchFlagError, match=r"expected steps \+ 1 = 4"):
        run_sglang_benchmark(launch, [[1, 2]], max_new_tokens=4, log_dir=tmp_path)
    assert not (tmp_path / "sglang-eagle3.log").exists()


# SGLang's tau on the same draft and prompts may fall this much short of the reference engine's: SGLang runs the
# target in bfloat16 (ties broken differently) and counts the prefill's token in completion_tokens.
SGLANG_TAU_MARGIN = 0.85


@pytest.mark.gpu
def test_real_sglang_accepts_the_draft_about_as_the_reference_engine_does(tmp_path):
    """A draft trained here on the tiny target (the demo's pipeline, by its library entries), exported, then
    benchmarked on the held-out prompts by the reference engine and by a real SGLang (GPU, sglang installed)."""
    pytest.importorskip("sglang")
    from eyas.bench.acceptance import bench_run
    from eyas.config import load_run_config
    from eyas.dataset.build import build_dataset
    from eyas.dataset.vocab import build_vocab
    from eyas.export.convert import export_run
    from eyas.extract.coordinator import run_extraction
    from eyas.facts import resolve_facts
    from eyas.train.launch import train_run
    from eyas.verify.shard_set import raise_if_bad, verify_run

    preset = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    config = preset.model_copy(update={"workdir": str(tmp_path / "run")})
    for name in ("target", "dataset", "bench"):  # the preset's relative paths, from the repo root
        section = getattr(config, name)
        key = {"target": "model_path"}.get(name, "prompts_path")
        config = config.model_copy(update={name: section.model_copy(update={key: str(REPO / getattr(section, key))})})
    build_dataset(config)
    build_vocab(config)
    facts = resolve_facts(config)
    run_extraction(config.extract, facts)
    raise_if_bad(verify_run(config, facts))
    train_run(config, facts)
    export = export_run(config)
    reference = bench_run(config, export)
    served = config.model_copy(
        update={
            "bench": config.bench.model_copy(
                update={
                    "engine": "sglang",
                    "sglang_port": free_port(),
                    "sglang_extra_args": ["--mem-fraction-static", "0.3", "--disable-cuda-graph"],
                }
            )
        }
    )
    result = bench_run(served, export)
    print(json.dumps({"reference_tau": reference["tau_mean"], "sglang_tau": result["tau_mean"]}))
    assert reference["tau_mean"] >= config.bench.min_tau  # the draft is a real one
    assert result["tau_mean"] >= SGLANG_TAU_MARGIN * reference["tau_mean"], (result["tau_mean"], reference["tau_mean"])


def test_an_aborted_answer_is_an_error_not_a_short_answer():
    """SGLang answers a request it aborted (Scheduler.abort_request -> FINISH_ABORT, managers/schedule_batch.py)
    with HTTP 200, the tokens decoded so far and finish_reason {"type": "abort"}; tau must never count it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Aborting(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"text": "ab", "output_ids": [5, 6], "meta_info": {
                "completion_tokens": 2, "spec_verify_ct": 1,
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Aborting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SglangServerError, match=r"aborted the request \(Abort in waiting queue\) after 2 tokens"):
            generate(f"http://127.0.0.1:{server.server_port}", [1, 2, 3], max_new_tokens=8)
    finally:
        server.shutdown()
