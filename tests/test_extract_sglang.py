"""The sglang extraction backend against a double of SGLang 0.5.23's aux-capture server, and the real one on a GPU.

The double (tests/sglang_extract_double.py) takes its server arguments from SGLang's own resolution (the
`sglang_kit` fixture), runs eyas's capture hook the way SGLang's hook manager does and computes real hidden
states of the random target, so the backend's features must equal the hf backend's.
`test_real_sglang_matches_the_hf_backend` runs a real SGLang >= 0.5.23 behind the `gpu` marker.
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
from safetensors.torch import save_file

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
    read_capture,
    topk_from_answer,
)
from eyas.extract.capture_hook import ERROR_FILE
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


@pytest.fixture
def capture_dir(tmp_path) -> Path:
    out = tmp_path / "capture"
    out.mkdir()
    return out


def aux_flags(capture_dir, engine_ids=ENGINE) -> list[str]:
    return aux_capture_flags(SGLangExtractConfig(), engine_ids, capture_dir)


def connect(url: str, target, **cfg) -> SGLangBackend:
    config = SGLangExtractConfig(server_url=url, **cfg)
    return SGLangBackend(config, target_path=str(target), aux_layer_ids=AUX, hidden_size=H)


def assert_equal_to_hf(feats, target) -> None:
    hf = HFBackend(str(target), target_dtype="float32", aux_layer_ids=AUX, hidden_size=H, device="cpu")
    for (aux, last), (hf_aux, hf_last), sample in zip(feats, hf.features(SAMPLES), SAMPLES, strict=True):
        assert aux.shape == (len(sample), 3 * H) and last.shape == (len(sample), H)
        torch.testing.assert_close(aux, hf_aux, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(last, hf_last, atol=1e-5, rtol=1e-4)


def test_features_equal_the_hf_backends_and_the_files_are_removed(random_target_dir, capture_dir, sglang_kit):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir)) as url:
        backend = connect(url, random_target_dir)
        assert backend.capture_dir == capture_dir  # read from the server's forward_hooks
        feats = backend.features(SAMPLES)
        backend.close()
    assert_equal_to_hf(feats, random_target_dir)
    assert list(capture_dir.iterdir()) == []


def test_a_topk_teacher_comes_from_the_same_request_and_equals_the_hf_backends(
    random_target_dir, capture_dir, sglang_kit
):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir)) as url:
        config = SGLangExtractConfig(server_url=url)
        backend = SGLangBackend(config, target_path=str(random_target_dir), aux_layer_ids=AUX, hidden_size=H,
                                teacher_topk=4)  # fmt: skip
        feats = backend.features(SAMPLES)
        meta = backend._generate(SAMPLES[0].tolist(), "eyas-flat-probe")["meta_info"]
        backend.close()
    assert meta["input_top_logprobs_shape"] == [len(SAMPLES[0]) - 1, 4] and "input_top_logprobs" not in meta
    hf = HFBackend(str(random_target_dir), target_dtype="float32", aux_layer_ids=AUX, hidden_size=H, device="cpu",
                   teacher_topk=4)  # fmt: skip
    for (aux, top), (hf_aux, hf_top), sample in zip(feats, hf.features(SAMPLES), SAMPLES, strict=True):
        assert top.ids.shape == top.logprobs.shape == (len(sample), 4) and top.ids.dtype == torch.int32
        assert torch.equal(top.ids, hf_top.ids)
        torch.testing.assert_close(top.logprobs, hf_top.logprobs, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(aux, hf_aux, atol=1e-5, rtol=1e-4)


def test_a_topk_answer_in_nested_lists_is_read_and_one_short_of_k_entries_is_refused():
    # SGLang answers nested lists when it cannot build the flat form (tokenizer_manager.py "Falling back")
    nested = {"input_top_logprobs": [None, [(-0.1, 3, None)]], "output_top_logprobs": [[(-0.2, 4, None)]]}
    assert topk_from_answer({"meta_info": nested}, 2, 1, "s").ids.tolist() == [[3], [4]]
    with pytest.raises(SglangServerError, match=r"s: the answer's input top logprobs are missing or short of 2 "
                       r"entries a position"):  # fmt: skip
        topk_from_answer({"meta_info": nested}, 2, 2, "s")


def test_launch_command_has_exactly_the_aux_capture_flags(random_target_dir):
    argv = build_extract_command(
        SGLangExtractConfig(port=31000, tp_size=8, mem_fraction_static=0.7, extra_args=["--dtype", "bfloat16"]),
        target_path=str(random_target_dir), aux_layer_ids=[2, 4, 6], capture_dir="/shared/cap", python="python",
    )  # fmt: skip
    hooks = (
        '[{"name": "eyas-capture", "target_modules": ["logits_processor", "language_model.logits_processor"], '
        '"hook_factory": "eyas.extract.capture_hook:make_hook", "config": {"dir": "/shared/cap", "rid_prefix": '
        '"eyas-"}}]'
    )
    assert argv == [
        "python", "-m", "sglang.launch_server", "--model-path", str(random_target_dir), "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "8", "--mem-fraction-static", "0.7", "--pp-size", "1",
        "--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids", "1", "3", "5", "--enable-return-hidden-states",
        "--disable-radix-cache", "--chunked-prefill-size", "-1", "--disable-prefill-cuda-graph",
        "--forward-hooks", hooks, "--dtype", "bfloat16",
    ]  # fmt: skip


def test_extra_args_that_override_the_aux_capture_flags_are_refused(random_target_dir):
    cfg = SGLangExtractConfig(extra_args=["--pp-size", "2", "--speculative-algorithm=EAGLE", "--dtype", "bfloat16"])
    with pytest.raises(ValueError) as err:
        build_extract_command(cfg, target_path=str(random_target_dir), aux_layer_ids=AUX, capture_dir="/c")
    assert "--pp-size, --speculative-algorithm would override what eyas sets for aux-capture mode" in str(err.value)


def launched_double(target_dir, tmp_path, monkeypatch) -> SGLangBackend:
    """An SGLang backend that launches tests.sglang_extract_double (the engine's aux-capture path) on a free port,
    logging to tmp_path/sglang.log."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)
    cfg = SGLangExtractConfig(port=free_port(), startup_timeout_s=180, capture_dir=str(tmp_path / "cap"))
    return SGLangBackend(
        cfg, target_path=str(target_dir), aux_layer_ids=AUX, hidden_size=H,
        launch_module="tests.sglang_extract_double", log_path=tmp_path / "sglang.log",
    )  # fmt: skip


def test_a_launched_server_serves_features_and_is_stopped_on_close(
    random_target_dir, tmp_path, monkeypatch, sglang_kit
):
    backend = launched_double(random_target_dir, tmp_path, monkeypatch)
    cfg = backend.cfg
    try:
        feats = backend.features(SAMPLES)
    finally:
        backend.close()  # the launched server stops whatever happened
    assert_equal_to_hf(feats, random_target_dir)
    assert "double of sglang.launch_server (aux capture)" in (tmp_path / "sglang.log").read_text()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{cfg.port}/health", timeout=5)


def test_a_launch_sglang_refuses_fails_with_sglangs_message(random_target_dir, tmp_path, monkeypatch, sglang_kit):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)
    cfg = SGLangExtractConfig(port=free_port(), startup_timeout_s=180, extra_args=["--dtype", "x"])
    with pytest.raises(SglangServerError) as err:
        SGLangBackend(
            cfg, target_path=str(random_target_dir), aux_layer_ids=AUX, hidden_size=H,
            launch_module="tests.sglang_extract_double", log_path=tmp_path / "sglang.log",
        )  # fmt: skip
    assert "exited with code 1 before GET /health answered 200" in str(err.value)
    assert "argument --dtype: invalid choice: 'x' (choose from 'auto', 'half', 'float16'," in str(err.value)


def test_an_old_server_is_refused_with_the_version_and_the_fix(random_target_dir, capture_dir, sglang_kit):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir), mode="old_version") as url:
        with pytest.raises(SGLangVersionError) as err:
            connect(url, random_target_dir)
    assert str(err.value) == (
        f"SGLang server {url}: version 0.5.22, expected >= 0.5.23 (the first with --enable-return-aux-hidden-states "
        "and --return-aux-hidden-state-layer-ids); pip install -U 'sglang>=0.5.23' on the GPU machine and relaunch "
        "the server"
    )


def test_a_server_whose_hook_never_fires_fails_naming_the_shared_folder(random_target_dir, capture_dir, sglang_kit):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir), mode="no_hook") as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir, request_timeout_s=2).features(SAMPLES[:1])
    assert "the server answered but wrote no " in str(err.value)
    assert "the capture dir must be the same folder for the server and eyas" in str(err.value)


@pytest.mark.parametrize(
    "mode, message",
    [
        ("drift_aux", "the answer's hidden states [5, 192] differ from the capture file's aux [5, 192]"),
        ("drift_last", "LogitsProcessorOutput.last_hidden_states is not the lm_head input"),
    ],
)
def test_the_canary_fails_when_the_two_channels_disagree(random_target_dir, capture_dir, sglang_kit, mode, message):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir), mode=mode) as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir).features(SAMPLES)
    assert f"SGLang server {url}: start-up canary (5 tokens): " in str(err.value)
    assert message in str(err.value)


def test_a_hook_error_stops_the_server_and_eyas_quotes_it_not_cannot_reach(random_target_dir, capture_dir, sglang_kit):
    """SGLang stops the server when a forward hook raises (managers/scheduler.py); the request then gets no answer.
    eyas names what stopped it: the server's state and the hook's CaptureError from the capture folder."""
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir), mode="drift_batch") as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir).features(SAMPLES[:1])
    lines = str(err.value).splitlines()
    assert lines[0] == (
        f"SGLang server {url}: start-up canary (5 tokens): the SGLang server at {url} no longer answers GET /health "
        "during this request."
    )
    assert lines[1] == f"eyas's capture hook raised in the server ({capture_dir / ERROR_FILE}):"
    assert lines[2].startswith(
        "  CaptureError: capture hook: AttributeError: 'types.SimpleNamespace' object has no attribute "
        "'extend_seq_lens_cpu', reading the forward of HiddenStateModel (5 positional args, forward_mode EXTEND, "
        "rids [eyas-"
    )
    assert "eyas did not launch this server: its log (where it was started) has the full traceback." in lines
    assert "cannot reach" not in str(err.value) and "HTTP 5" not in str(err.value)


def test_a_launched_server_stopped_by_a_hook_error_is_reported_with_its_logs_lines(
    random_target_dir, tmp_path, monkeypatch, sglang_kit
):
    monkeypatch.setenv("EYAS_SGLANG_EXTRACT_DOUBLE_MODE", "drift_batch")
    backend = launched_double(random_target_dir, tmp_path, monkeypatch)
    try:
        with pytest.raises(SglangServerError) as err:
            backend.features(SAMPLES[:1])
    finally:
        backend.close()
    message = str(err.value)
    assert message.splitlines()[0].endswith(
        f"the SGLang server at {backend.url} exited with code -9 during this request."
    )
    assert f"The server's log {tmp_path / 'sglang.log'}, where it failed:" in message
    assert "] Scheduler hit an exception: Traceback (most recent call last):" in message
    assert "eyas.extract.capture_hook.CaptureError: capture hook: AttributeError:" in message
    assert message.rstrip().endswith("then start the extraction again (it resumes).")
    assert "cannot reach" not in message


def test_an_http_error_names_the_request_status_and_the_servers_message(random_target_dir, capture_dir, sglang_kit):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir), mode="http_500") as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir).features(SAMPLES[:1])
    assert str(err.value).startswith(f"SGLang server {url}: POST /generate (5 tokens, rid eyas-")
    assert (
        f'HTTP 500 from {url}/generate: {{"error": {{"message": "CUDA out of memory (double told to fail: http_500)"}}}}'
        in str(err.value)
    )


def test_a_slow_answer_times_out_naming_the_setting(random_target_dir, capture_dir, sglang_kit):
    with serve_extract_double(random_target_dir, flags=aux_flags(capture_dir), mode="slow") as url:
        with pytest.raises(
            SglangServerError, match=r"no answer from .* within 1 s; raise extract.sglang.request_timeout_s"
        ):
            connect(url, random_target_dir, request_timeout_s=1).features(SAMPLES[:1])


def test_an_unreachable_server_url_is_reported(random_target_dir):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SglangServerError, match=rf"SGLang server {url}: cannot reach {url}/server_info \("):
        connect(url, random_target_dir)


def test_a_server_not_set_up_for_extraction_is_refused_before_any_request(random_target_dir, capture_dir, sglang_kit):
    flags = aux_flags(capture_dir, engine_ids=AUX)  # canonical ids given as SGLang's: one layer off
    for flag in ("--disable-radix-cache", "--disable-prefill-cuda-graph"):
        flags.remove(flag)
    i = flags.index("--forward-hooks")
    del flags[i : i + 2]
    with serve_extract_double(random_target_dir, flags=flags) as url:
        with pytest.raises(SglangServerError) as err:
            connect(url, random_target_dir)
    problems = str(err.value).splitlines()
    assert problems[0] == f"SGLang server {url} (version 0.5.23) is not set up for extraction:"
    assert problems[1].startswith("  disable_radix_cache=False, expected True: a cached prompt prefix")
    assert problems[2].startswith("  disable_prefill_cuda_graph=False, expected True: a prefill replayed")
    assert problems[3] == (
        "  return_aux_hidden_state_layer_ids=[2, 4, 5] (hidden_states [3, 5, 6]), expected [1, 3, 4] (sglang_llama: "
        "hidden_states [2, 4, 5], the run's target.aux_layer_ids); launch with --return-aux-hidden-state-layer-ids "
        "1 3 4"
    )
    assert problems[4].startswith("  forward_hooks=None: expected eyas's capture hook")


def capture(path: Path, ids, aux, last) -> Path:
    save_file({"input_ids": torch.tensor(ids), "aux": aux, "last": last}, str(path))
    return path


def test_a_capture_file_is_checked_for_token_ids_widths_and_dtype(tmp_path):
    rows = torch.zeros(3, 6, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.bfloat16)
    path = capture(tmp_path / "a.safetensors", [1, 2, 3], *rows)
    aux, last = read_capture(path, [1, 2, 3], num_aux=3, hidden_size=2, where="w")
    assert aux.dtype == torch.bfloat16 and aux.shape == (3, 6) and last.shape == (3, 2)
    with pytest.raises(
        SglangServerError, match=r"holds 3 token ids that differ from the 3 sent \(first at position 2\)"
    ):
        read_capture(path, [1, 2, 4], num_aux=3, hidden_size=2, where="w")
    with pytest.raises(AuxWidthError, match=r"aux_hidden_states width 6, expected 12"):
        read_capture(path, [1, 2, 3], num_aux=3, hidden_size=4, where="w")
    ints = capture(tmp_path / "b.safetensors", [1, 2, 3], torch.zeros(3, 6, dtype=torch.int32), rows[1])
    with pytest.raises(SglangServerError, match=r"aux is torch.int32 of shape \[3, 6\], expected a 2-D bfloat16"):
        read_capture(ints, [1, 2, 3], num_aux=3, hidden_size=2, where="w")
    (tmp_path / "c.safetensors").write_bytes(b"garbage")
    with pytest.raises(SglangServerError, match=r"capture file .*c.safetensors is unreadable"):
        read_capture(tmp_path / "c.safetensors", [1], num_aux=3, hidden_size=2, where="w")


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
        port=free_port(), mem_fraction_static=0.3, startup_timeout_s=900, capture_dir=str(tmp_path / "capture"),
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
