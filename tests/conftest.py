"""Shared fixtures: the committed tiny target, and a small random Llama with the same tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO / "fixtures" / "tiny-target"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when none is visible")
    config.addinivalue_line("markers", "e2e: runs the whole pipeline against a real Prefect server")
    config.addinivalue_line("markers", "browser: drives the Prefect UI in headless Chromium (runs in the normal suite)")


# The modules that run whole pipelines (minutes each) go first: `make test` spreads the modules over two
# processes in this order (pytest-xdist, --dist loadfile), so the long ones overlap the many short ones.
LONG_MODULES = ("test_worker_death", "test_pipeline", "test_kimi_target", "test_crash_vm", "test_status_server",
                "test_ui_browser", "test_regeneration", "test_train_failure",
                "test_transformers_serve", "test_crash_detection", "test_stream_kills",
                "test_pipeline_streaming")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=lambda item: (LONG_MODULES.index(m) if (m := item.module.__name__) in LONG_MODULES else 99))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def removes_crash_automation(prefect_server):
    """For a test whose `eyas` commands install the crash automation on the session's server: removed afterwards,
    or its window would mark the later tests' runs Crashed (runs in this process do not beat every 30 s)."""
    yield
    from prefect.client.orchestration import get_client

    from eyas_cli.automation import NAME

    with get_client(sync_client=True) as client:
        for automation in client.read_automations_by_name(NAME):
            client.delete_automation(automation.id)


@pytest.fixture(scope="session")
def tiny_target_dir() -> Path:
    """The committed tiny target (scripts/build_tiny_target.py rebuilds it)."""
    assert (TINY_TARGET / "model.safetensors").is_file(), "run scripts/build_tiny_target.py first"
    return TINY_TARGET


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory) -> Path:
    """An 8-layer random Llama (hidden 64) in HF format, sharing the tiny target's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("random-target")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TARGET / name, out / name)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real local Prefect server (SQLite) on a free loopback port, for flow tests.

    PREFECT_API_URL and PREFECT_HOME are set in this process's environment, and prefect's settings are read again if
    a collected module imported it already, so every in-process client talks to this server.
    """
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    # the UI finds the API through PREFECT_SERVER_API_PORT, not through --port
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_PORT": str(port),
    }
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"prefect server did not start; see {home / 'server.log'}")
        time.sleep(0.5)
    os.environ["PREFECT_API_URL"] = url
    os.environ["PREFECT_HOME"] = str(home)
    if "prefect.context" in sys.modules:
        # a module collected earlier imported prefect, whose settings were read then (no API URL, so its clients
        # would start a temporary server of their own): read them again from the environment just set
        sys.modules["prefect.context"].refresh_global_settings_context()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3 API server (moto's server mode) on a free loopback port; credentials in the environment."""
    import os

    from s3_server import CREDENTIALS, start_s3_server

    os.environ.update(CREDENTIALS)
    proc, url = start_s3_server(tmp_path_factory.mktemp("s3") / "server.log")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_endpoint, request):
    """A fresh bucket on the test S3 server; its name is derived from the test's name."""
    import re
    import uuid

    import boto3

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def fault_proxy(s3_endpoint):
    """A FaultProxy in front of the test S3 server (add `Fault`s to `proxy.faults`)."""
    from s3_server import FaultProxy

    proxy = FaultProxy(s3_endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def flush_prefect_logs():
    """Send the flow runs' logs and events while the test server is up (else the process's exit waits
    on retries to a server that has stopped). Flow-test modules use it with `pytestmark`."""
    yield
    from run_queries import drain_run_logs

    drain_run_logs()


@pytest.fixture(scope="session")
def sglang_kit(tmp_path_factory):
    """SGLang 0.5.23's own argument code as a loopback service (tests/sglang_conformance.py); its URL is also in
    EYAS_SGLANG_KIT_URL for the doubles, which answer from that resolution."""
    import os

    from sglang_conformance import KIT_URL_ENV, sglang_kit_service

    with sglang_kit_service(tmp_path_factory.mktemp("sglang-kit")) as url:
        previous = os.environ.get(KIT_URL_ENV)
        os.environ[KIT_URL_ENV] = url
        try:
            yield url
        finally:
            if previous is None:
                os.environ.pop(KIT_URL_ENV, None)
            else:
                os.environ[KIT_URL_ENV] = previous
