"""Regeneration through a real OpenAI-compatible server that is neither vLLM nor SGLang: `transformers serve`
(transformers' own, transformers/cli/serving) on the tiny target, started by the tests. It refuses
`return_token_ids` (HTTP 422) and a prompt of token ids (HTTP 400), answers a model name other than the one it
serves with HTTP 400, and, the tiny target having no chat template, every chat request with HTTP 500."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from run_fixtures import regeneration_config

from eyas.dataset.build import build_dataset, dataset_cache_key
from eyas.dataset.generate import ResponseLog
from eyas.dataset.prompts import DatasetError
from eyas.dataset.served import BREAKER_FAILURES

NUM_PROMPTS = 6
MORE_PROMPTS = BREAKER_FAILURES + 4  # enough for the circuit breaker to open before the prompts run out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_transformers_serve(model: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`transformers serve MODEL` (the model preloaded and the only one served, under its path as its name) on
    a free port of 127.0.0.1, offline, on the CPU; returned once GET /health answers 200."""
    port = free_port()
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"transformers serve did not start (exit {proc.wait()}): {log_path.read_text()[-2000:]}")


def requests_seen(log_path: Path, expected: int) -> list[int]:
    """The HTTP status of each POST the server logged (uvicorn's access lines), once `expected` are there."""
    deadline = time.monotonic() + 10
    while True:
        statuses = [int(s) for s in re.findall(r'"POST /v1/\S+ HTTP/1.1" (\d{3})', log_path.read_text())]
        if len(statuses) >= expected or time.monotonic() > deadline:
            return statuses
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tiny_target_dir, tmp_path_factory):
    """(url, access log) of transformers serve on the tiny target, for the tests that leave it running."""
    log_path = tmp_path_factory.mktemp("transformers-serve") / "serve.log"
    proc, url = start_transformers_serve(tiny_target_dir, log_path)
    yield url, log_path
    proc.kill()
    proc.wait()


def run_config(tmp_path: Path, tiny: Path, name: str, num_samples: int, **generation):
    return regeneration_config(tmp_path / name, tiny, num_samples=num_samples, max_new_tokens=8, **generation)


def served_config(tmp_path, tiny, name, url, num_samples=NUM_PROMPTS, **generation):
    generation = {"generator": "openai", "server_urls": [url], "openai_model": str(tiny), "max_in_flight": 2,
                  **generation}  # fmt: skip
    return run_config(tmp_path, tiny, name, num_samples, **generation)


def table(config) -> list[tuple]:
    t = pq.read_table(config.paths.tokenized)
    return list(zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist()))


def records(config) -> list[dict]:
    key = dataset_cache_key(config.dataset, config.target.model_path)
    return list(ResponseLog(config.paths.dataset_dir / f"responses-{key}.log").read().values())


def test_the_forms_it_refuses_are_found_once_and_the_table_equals_local_generation(served, tiny_target_dir,
                                                                                    tmp_path):  # fmt: skip
    url, log_path = served
    before = len(requests_seen(log_path, 0))
    config = served_config(tmp_path, tiny_target_dir, "served", url)
    acct = build_dataset(config).accounting
    assert acct["answered"] == NUM_PROMPTS and acct["failed"] == 0 and acct["retried"] == 0
    assert acct["token_ids_source"] == {"retokenized": NUM_PROMPTS} and acct["servers_taken_out"] == {}
    (returned, as_text) = acct["fallbacks"][url]
    assert returned.startswith("return_token_ids refused (HTTP 422: ") and "Unexpected fields" in returned
    assert "re-tokenized (token_ids_source: retokenized: the ids may differ from the ones the target sampled)" in (
        returned
    )
    assert as_text == ('token ids as the prompt refused (HTTP 400: {"detail":"prompt must be a string."}): the '
                       "prompt is sent as its text, which the server tokenizes itself")  # fmt: skip
    # the refusals are paid once for the server, not once a prompt: 3 refused forms, then one request a prompt
    statuses = requests_seen(log_path, before + 3 + NUM_PROMPTS)[before:]
    assert statuses == [422, 400, 422] + [200] * NUM_PROMPTS
    local = run_config(tmp_path, tiny_target_dir, "local", NUM_PROMPTS, generator="hf")
    build_dataset(local)
    assert table(config) == table(local)  # greedy, and the tiny target's text re-tokenizes to the same ids


def test_a_wrong_model_name_is_refused_without_retries_and_takes_the_server_out(served, tiny_target_dir, tmp_path):
    url, _ = served
    config = served_config(tmp_path, tiny_target_dir, "wrong", url, MORE_PROMPTS, openai_model="other")
    with pytest.raises(DatasetError) as err:
        build_dataset(config)
    message = str(err.value)
    assert message.startswith("regeneration stopped: no server left to ask, ")
    assert f"{url} was taken out after {BREAKER_FAILURES} failed requests in a row; its last answer: " in message
    assert 'HTTP 400: {"detail":"Server is pinned to \'' in message and "requested 'other'." in message
    failed = records(config)
    assert BREAKER_FAILURES <= len(failed) < MORE_PROMPTS  # the prompts after the breaker opened are not asked
    assert {r["status"] for r in failed} == {"failed"} and {r["attempts"] for r in failed} == {1}  # not retried


def test_a_server_failing_every_request_is_taken_out(served, tiny_target_dir, tmp_path):
    """The chat endpoint on a target without a chat template: HTTP 500 for every request."""
    url, _ = served
    config = served_config(tmp_path, tiny_target_dir, "chat", url, MORE_PROMPTS, openai_endpoint="chat")
    with pytest.raises(DatasetError) as err:
        build_dataset(config)
    assert f"{url} was taken out after {BREAKER_FAILURES} failed requests in a row; its last answer: POST {url}" in (
        str(err.value)
    )
    assert "/v1/chat/completions: HTTP 500: Internal Server Error" in str(err.value)
    assert records(config) == []  # every failure was to be retried: none is recorded failed, a re-run asks them


def test_killing_the_only_server_mid_run_stops_the_stage_at_once_naming_it(tiny_target_dir, tmp_path):
    proc, url = start_transformers_serve(tiny_target_dir, tmp_path / "serve.log")
    killed_after = 3

    def kill_at(info: dict) -> None:  # the progress callback, after each answer
        if info["samples_done"] == killed_after and proc.poll() is None:
            proc.kill()
            proc.wait()

    config = served_config(tmp_path, tiny_target_dir, "killed", url, MORE_PROMPTS)
    try:
        with pytest.raises(DatasetError) as err:
            build_dataset(config, progress=kill_at)
    finally:
        proc.kill()
        proc.wait()
    message = str(err.value)
    assert f"{url} was taken out after {BREAKER_FAILURES} failed requests in a row; its last answer: " in message
    assert "cannot reach the server (ConnectError: " in message
    kept = records(config)
    answered = int(re.search(r"; the (\d+) answers so far are kept in ", message).group(1))
    assert killed_after <= answered == len(kept) < MORE_PROMPTS and {r["status"] for r in kept} == {"answered"}
    assert f"{MORE_PROMPTS - answered} of {MORE_PROMPTS} prompts not answered" in message
