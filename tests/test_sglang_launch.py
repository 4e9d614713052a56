"""What every SGLang server eyas starts is launched with: SGLang's interpreter, --trust-remote-code from the
target, no extraction flag that breaks the capture, and only the SGLang releases eyas has checked.

SGLang's own resolution of these commands is in tests/test_sglang_conformance.py; the interpreter's environment
in tests/test_sglang_env.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eyas.bench.sglang import bench_launch, lint_launch_command
from eyas.config import SGLangExtractConfig, load_run_config
from eyas.dataset.build import generation_launch
from eyas.engines.sglang import CHECKED_SGLANG_VERSIONS, SGLangVersionError, build_launch_command
from eyas.extract.backends.sglang import build_extract_command
from eyas.extract.backends.sglang_launch import check_server_version
from eyas_cli.engine_command import ENGINE_STAGES, engine_command

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "fixtures" / "tiny-target"
SGLANG_PYTHON = "/opt/sglang/bin/python"


def tiny_run(tmp_path, *, python: str = "", trust_remote_code: bool = False):
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    target = config.target.model_copy(update={"trust_remote_code": trust_remote_code})
    sglang = config.sglang.model_copy(update={"python": python})
    return config.model_copy(update={"workdir": str(tmp_path / "run"), "target": target, "sglang": sglang})


def test_every_server_of_a_run_runs_sglangs_interpreter_with_the_targets_trust_remote_code(tmp_path):
    config = tiny_run(tmp_path, python=SGLANG_PYTHON, trust_remote_code=True)
    for stage in ENGINE_STAGES:
        argv = engine_command(config, stage)
        assert argv[:3] == [SGLANG_PYTHON, "-m", "sglang.launch_server"], stage
        assert argv.count("--trust-remote-code") == 1, stage
    launches = [generation_launch(config), bench_launch(config, tmp_path / "export"),
                bench_launch(config, tmp_path / "export").baseline()]  # fmt: skip
    assert [launch.python for launch in launches] == [SGLANG_PYTHON] * 3


def test_without_a_configured_interpreter_the_servers_run_eyas_own_and_trust_no_remote_code(tmp_path):
    config = tiny_run(tmp_path)
    for stage in ENGINE_STAGES:
        argv = engine_command(config, stage)
        assert argv[0] == sys.executable and "--trust-remote-code" not in argv, stage


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--cuda-graph-backend-prefill", "breakable"], "they override --disable-prefill-cuda-graph"),
        (["--cuda-graph-config", '{"prefill": {"backend": "full"}}'], "they override --disable-prefill-cuda-graph"),
        (["--cuda-graph-max-bs-prefill", "8"], "they size prefill CUDA graphs, which extraction turns off"),
        (["--attn-dp-size", "2"], "which sees the requests of its own data-parallel group only"),
        (["--enable-dp-attention"], "which sees the requests of its own data-parallel group only"),
        (["--return-hidden-states-mode", "last"], "--enable-return-hidden-states sets it to 'full'"),
        (["--enable-torch-compile"], "torch.compile speeds up decode graphs only"),
    ],
)
def test_extraction_refuses_extra_args_that_break_the_capture(flags, why):
    cfg = SGLangExtractConfig(extra_args=[*flags, "--dtype", "bfloat16"])
    with pytest.raises(ValueError) as err:
        build_extract_command(cfg, target_path=str(TINY), aux_layer_ids=[2, 4, 5], capture_dir="/c")
    assert str(err.value).startswith(f"extract.sglang.extra_args={cfg.extra_args}: remove them:\n  {flags[0]}: ")
    assert why in str(err.value) and "--dtype" not in str(err.value).split("\n", 1)[1]


def test_the_benchmark_lint_wants_trust_remote_code_when_the_target_does(tmp_path):
    launch = bench_launch(tiny_run(tmp_path), tmp_path / "export").baseline()
    [problem] = lint_launch_command(build_launch_command(launch), trust_remote_code=True)
    assert problem == (
        "launch flags: no --trust-remote-code, but target.trust_remote_code is true (the target's config or "
        "tokenizer loads through its own code): pass --trust-remote-code"
    )
    trusted = bench_launch(tiny_run(tmp_path, trust_remote_code=True), tmp_path / "export").baseline()
    assert lint_launch_command(build_launch_command(trusted), trust_remote_code=True) == []


def test_a_server_of_a_release_eyas_has_not_checked_is_refused_naming_what_was_not_checked():
    url = "http://gpu:30000"
    assert CHECKED_SGLANG_VERSIONS == ("0.5.23",)
    assert check_server_version({"version": "0.5.23"}, url, (), fix="f") == "0.5.23"
    for newer in ("0.5.24", "0.5.23.post1", "0.6.0"):
        with pytest.raises(SGLangVersionError) as err:
            check_server_version({"version": newer}, url, (), fix="f")
        assert str(err.value) == (
            f"SGLang server {url}: SGLang {newer} is not a release eyas has checked (0.5.23); not checked on {newer}: "
            "the layer each aux id captures for the target's model class (a changed rule captures other layers at "
            "the right width, which no later check sees); the aux-capture flags and what /server_info reports for "
            "them; what the capture hook reads of LogitsProcessor.forward's arguments, the ForwardBatch and "
            "LogitsProcessorOutput; the /generate answer's meta_info (finish_reason, spec_verify_ct, top "
            "logprobs). Install SGLang 0.5.23 in SGLang's environment (README: A GPU machine), or add "
            f'"{newer}" to sglang.allow_unchecked_versions to run with it unchecked'
        )
        assert check_server_version({"version": newer}, url, [newer], fix="f") == newer
    with pytest.raises(SGLangVersionError, match=r"version 0.5.22, expected >= 0.5.23 \(the first with"):
        check_server_version({"version": "0.5.22"}, url, ["0.5.22"], fix="f")  # allowing it does not make it work
