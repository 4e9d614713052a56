"""The sglang extraction backend against a double of SGLang's aux-capture server, and the real one on a GPU.

The double (tests/sglang_extract_double.py) computes real hidden states of the random target, so the
backend's features must equal the hf backend's. `test_real_sglang_matches_the_hf_backend` runs a real
SGLang >= 0.5.23 behind the `gpu` marker.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from eyas.config import SGLangExtractConfig
from eyas.engines.sglang import SglangServerError, parse_version
from eyas.extract.backends.base import AuxWidthError
from eyas.extract.backends.hf import HFBackend
from eyas.extract.backends.sglang import (
    MIN_SGLANG_VERSION,
    SGLangBackend,
    SGLangVersionError,
    aux_capture_flags,
    build_extract_command,
    parse_answer,
)
from tests.sglang_extract_double import serve_extract_double

REPO = Path(__file__).resolve().parents[1]
AUX = [2, 4, 5]  # canonical (HF hidden_states) ids of the 8-layer random target
ENGINE = [1, 3, 4]  # the same layers in SGLang's Llama numbering
H = 64
SAMPLES = [torch.tensor([5, 17, 300, 2, 9]), torch.tensor(list(range(100, 109))), torch.tensor([7, 7, 7])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aux_flags(engine_ids=ENGINE) -> list[str]:
    return aux_capture_flags(SGLangExtractConfig(), engine_ids)


def connect(url: str, target, **cfg) -> SGLangBackend:
    config = SGLangExtractConfig(server_url=url, **cfg)
    return SGLangBackend(config, target_path=str(target), aux_layer_ids=AUX, hidden_size=H)


def assert_equal_to_hf(feats, target) -> None:
    hf = HFBackend(str(target), target_dtype="float32", aux_layer_ids=AUX, hidden_size=H, device="cpu")
    for (aux, last), (hf_aux, hf_last), sample in zip(feats, hf.features(SAMPLES), SAMPLES, strict=True):
        assert aux.shape == (len(sample), 3 * H) and last.shape == (len(sample), H)
        torch.testing.assert_close(aux, hf_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(last, hf_last, atol=1e-5, rtol=1e-4)


def test_features_equal_the_hf_backends(random_target_dir):
    with serve_extract_double(random_target_dir, flags=aux_flags()) as url:
        backend = connect(url, random_target_dir)
        feats = backend.features(SAMPLES)
        backend.close()
    assert_equal_to_hf(feats, random_target_dir)


def test_launch_command_has_exactly_the_aux_capture_flags():
    argv = build_extract_command(
        SGLangExtractConfig(port=31000, tp_size=8, mem_fraction_static=0.7, extra_args=["--dtype", "bfloat16"]),
        target_path="target", aux_layer_ids=[2, 16, 29], python="python",
    )  # fmt: skip
    assert argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "target", "--host", "127.0.0.1", "--port", "31000",
        "--tp-size", "8", "--mem-fraction-static", "0.7", "--pp-size", "1", "--speculative-algorithm", "EAGLE3",
        "--enable-return-hidden-states", "--enable-return-aux-hidden-states", "--disable-radix-cache",
        "--chunked-prefill-size", "-1", "--json-model-override-args",
        '{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28], "use_aux_hidden_state": true}}',
        "--dtype", "bfloat16",
    ]  # fmt: skip


def test_extra_args_that_override_the_aux_capture_flags_are_refused():
    cfg = SGLangExtractConfig(extra_args=["--pp-size", "2", "--speculative-algorithm=EAGLE", "--dtype", "bfloat16"])
    with pytest.raises(ValueError) as err:
        build_extract_command(cfg, target_path="target", aux_layer_ids=AUX)
    assert "--pp-size, --speculative-algorithm would override what eyas sets for aux-capture mode" in str(err.value)


def test_a_launched_server_serves_features_and_is_stopped_on_close(random_target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)
    cfg = SGLangExtractConfig(port=free_port(), startup_timeout_s=180)
    backend = SGLangBackend(
        cfg, target_path=str(random_target_dir), aux_layer_ids=AUX, hidden_size=H,
        launch_module="tests.sglang_extract_double", log_path=tmp_path / "sglang.log",
    )  # fmt: skip
    feats = backend.features(SAMPLES)
    backend.close()
    assert_equal_to_hf(feats, random_target_dir)
    assert "double of sglang.launch_server (aux capture)" in (tmp_path / "sglang.log").read_text()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{cfg.port}/health", timeout=5)


def test_an_old_server_is_refused_with_the_version_and_the_fix(random_target_dir):
    with serve_extract_double(random_target_dir, flags=aux_flags(), mode="old_version") as url:
        with pytest.raises(SGLangVersionError) as err:
            connect(url, random_target_dir)
    assert str(err.value) == (
        f"SGLang server {url}: version 0.5.22, expected >= 0.5.23 (the first with --enable-return-aux-hidden-states, "
        "the aux-capture mode extraction needs); pip install -U 'sglang>=0.5.23' on the GPU machine and relaunch "
        "the server"
    )


def test_h_wide_states_fail_with_the_known_causes(random_target_dir):
    with serve_extract_double(random_target_dir, flags=aux_flags(), mode="h_wide") as url:
        backend = connect(url, random_target_dir)
        with pytest.raises(AuxWidthError) as err:
            backend.features(SAMPLES)
    message = str(err.value)
    assert message.startswith(
        f"SGLang server {url} sample 0 (5 tokens): aux_hidden_states width 64, expected 192 (3 layers x 64); it is H"
    )
    assert "SGLang needs --enable-return-aux-hidden-states" in message
    assert "--speculative-algorithm EAGLE instead of EAGLE3" in message


def test_truncated_rows_fail_naming_the_sample(random_target_dir):
    with serve_extract_double(random_target_dir, flags=aux_flags(), mode="truncated") as url:
        with pytest.raises(AuxWidthError) as err:
            connect(url, random_target_dir).features(SAMPLES)
    assert f"SGLang server {url} sample 0: 4 aux rows and 4 last rows, expected 5 (one per prompt token)" in str(
        err.value
    )


def test_an_http_error_names_the_request_status_and_the_servers_message(random_target_dir):
    with serve_extract_double(random_target_dir, flags=aux_flags(), mode="http_500") as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir).features(SAMPLES[:1])
    assert str(err.value).startswith(
        f"SGLang server {url}: POST /generate (5 tokens): HTTP 500 from {url}/generate: "
        '{"error": {"message": "CUDA out of memory (double told to fail: http_500)"}}; expected 200'
    )


def test_a_slow_answer_times_out_naming_the_setting(random_target_dir):
    with serve_extract_double(random_target_dir, flags=aux_flags(), mode="slow") as url:
        with pytest.raises(
            SglangServerError, match=r"no answer from .* within 1 s; raise extract.sglang.request_timeout_s"
        ):
            connect(url, random_target_dir, request_timeout_s=1).features(SAMPLES[:1])


def test_an_unreachable_server_url_is_reported():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SglangServerError, match=rf"SGLang server {url}: cannot reach {url}/server_info \("):
        connect(url, "target")


def test_a_server_not_in_aux_capture_mode_is_refused_before_any_request(random_target_dir):
    flags = aux_flags(engine_ids=AUX)
    flags[flags.index("EAGLE3")] = "EAGLE"
    flags.remove("--disable-radix-cache")
    with serve_extract_double(random_target_dir, flags=flags) as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir)
    problems = str(err.value).splitlines()
    assert problems[0] == f"SGLang server {url} (version 0.5.23) is not in aux-capture mode as extraction needs:"
    assert problems[1].startswith("  speculative_algorithm='EAGLE', expected 'EAGLE3': with EAGLE or none")
    assert problems[2].startswith("  disable_radix_cache=False, expected True: a cached prompt prefix")
    assert problems[3] == (
        "  captures eagle_config.eagle_aux_hidden_state_layer_ids=[2, 4, 5] (hidden_states [3, 5, 6]), expected "
        "[1, 3, 4] (sglang_llama; hidden_states [2, 4, 5], the run's target.aux_layer_ids); launch with "
        '--json-model-override-args \'{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], '
        '"use_aux_hidden_state": true}}\''
    )


def answer(**meta) -> dict:
    return {"text": "", "output_ids": [1], "meta_info": {"prompt_tokens": 2, **meta}}


def test_parse_keeps_the_prompt_rows_and_drops_generated_tokens_rows():
    prompt_aux, prompt_last = [[1.0] * 6, [2.0] * 6], [[3.0, 3.5], [4.0, 4.5]]
    a = answer(hidden_states=[prompt_aux, [9.0] * 6], last_hidden_states=[prompt_last, [9.0] * 2])
    aux, last = parse_answer(a, num_aux=3, hidden_size=2, where="w")
    assert aux.tolist() == prompt_aux and last.tolist() == prompt_last and aux.dtype == torch.float32


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"text": "x"}, "w: answer without a meta_info object: {'text': 'x'}; expected SGLang's /generate answer"),
        (answer(), "w: meta_info.hidden_states is absent, expected a list whose first element holds the prompt's "
                   "rows; the server returned no hidden states: launch it with --enable-return-hidden-states"),
        (answer(hidden_states=[[[1.0] * 6, [1.0] * 5]]), "w: meta_info.hidden_states[0] is not a rectangular "
                                                         "[prompt tokens][width] list of numbers"),
        (answer(hidden_states=[[1.0] * 6]), "w: meta_info.hidden_states[0] has shape [6], expected [prompt tokens, "
                                            "width]"),
        (answer(hidden_states=[[[1.0] * 6]]), "w: meta_info.last_hidden_states is absent, expected a list whose first "
                                              "element holds the prompt's rows; the server returned the aux states "
                                              "but not the final layer's: expected SGLang >= 0.5.23 launched with "
                                              "--enable-return-aux-hidden-states"),
    ],
)  # fmt: skip
def test_malformed_answers_are_refused_with_what_was_found(bad, message):
    with pytest.raises(SglangServerError) as err:
        parse_answer(bad, num_aux=3, hidden_size=2, where="w")
    assert str(err.value).startswith(message)


def test_config_refuses_launch_settings_beside_a_server_url():
    with pytest.raises(ValueError, match=r"extract.sglang.port, extract.sglang.extra_args would do nothing"):
        SGLangExtractConfig(server_url="http://gpu:30000", port=31000, extra_args=["--dtype", "bfloat16"])
    with pytest.raises(ValueError, match=r"server_url='gpu:30000': expected empty \(launch a server\) or http://"):
        SGLangExtractConfig(server_url="gpu:30000")


@pytest.mark.gpu
def test_real_sglang_matches_the_hf_backend(tiny_target_dir, tmp_path):
    """A real SGLang >= 0.5.23 in aux-capture mode on the tiny target (GPU, sglang installed)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed")
    version = importlib.metadata.version("sglang")
    if (parse_version(version) or (0, 0, 0)) < MIN_SGLANG_VERSION:
        pytest.skip(f"sglang {version} is older than {MIN_SGLANG_VERSION}: no aux-capture mode")
    cfg = SGLangExtractConfig(
        port=free_port(), mem_fraction_static=0.3, startup_timeout_s=900,
        extra_args=["--dtype", "float32", "--disable-cuda-graph"],
    )  # fmt: skip
    hidden = 128
    backend = SGLangBackend(
        cfg, target_path=str(tiny_target_dir), aux_layer_ids=AUX, hidden_size=hidden, log_path=tmp_path / "sglang.log",
        launch_module="sglang.launch_server",
    )  # fmt: skip
    try:
        feats = backend.features(SAMPLES)
    finally:
        backend.close()
    hf = HFBackend(str(tiny_target_dir), target_dtype="float32", aux_layer_ids=AUX, hidden_size=hidden, device="cuda")
    for (aux, last), (hf_aux, hf_last) in zip(feats, hf.features(SAMPLES), strict=True):
        torch.testing.assert_close(aux, hf_aux, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(last, hf_last, atol=1e-3, rtol=1e-3)
