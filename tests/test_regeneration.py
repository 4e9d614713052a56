"""Regeneration through served engines (a double generating with the tiny target over SGLang's /generate and
the OpenAI endpoints), the crash-safe response log, the row accounting, and the dataset flow on a real
Prefect server surviving a failing server, a server killed and restarted, and a kill -9 of the stage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from generation_double import MODEL_NAME, start
from run_fixtures import regeneration_config

from eyas.dataset.build import build_dataset, dataset_cache_key
from eyas.dataset.generate import ResponseLog
from eyas.dataset.prompts import DatasetError

REPO = Path(__file__).resolve().parents[1]
NUM_PROMPTS = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(tmp_path: Path, tiny: Path, name: str, **generation):
    return regeneration_config(tmp_path / name, tiny, num_samples=NUM_PROMPTS, max_new_tokens=12, **generation)


def table(config) -> list[tuple]:
    t = pq.read_table(config.paths.tokenized)
    return list(zip(t.column("id").to_pylist(), t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist()))


@pytest.fixture(scope="module")
def servers(tiny_target_dir, tmp_path_factory):
    """Two doubles, the second failing every 4th request (25%: it takes at least 4 of the 24 requests)."""
    logs = tmp_path_factory.mktemp("doubles")
    ports = [free_port(), free_port()]
    procs = [start(tiny_target_dir, ports[0], log_path=logs / "a.log"),
             start(tiny_target_dir, ports[1], fail_every=4, log_path=logs / "b.log")]  # fmt: skip
    yield [f"http://127.0.0.1:{p}" for p in ports]
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def reference(servers, tiny_target_dir, tmp_path_factory):
    """An uninterrupted run through one healthy server: the table every other run must equal."""
    config = run_config(tmp_path_factory.mktemp("ref"), tiny_target_dir, "run", generator="sglang",
                        server_urls=servers[:1])  # fmt: skip
    report = build_dataset(config)
    return config, report


def test_served_generation_through_two_servers_one_failing_equals_the_reference(servers, reference, tiny_target_dir,
                                                                                tmp_path):  # fmt: skip
    ref_config, ref = reference
    config = run_config(tmp_path, tiny_target_dir, "run", generator="sglang", server_urls=servers, max_in_flight=3)
    report = build_dataset(config)
    acct = report.accounting
    assert acct["answered"] == NUM_PROMPTS and acct["failed"] == acct["skipped"] == 0
    assert acct["answered"] + acct["failed"] + acct["skipped"] == acct["input"] == NUM_PROMPTS
    assert acct["retried"] >= 1 and acct["token_ids_source"] == {"server": NUM_PROMPTS}
    assert acct["servers_taken_out"] == {}  # a 500 now and then is no reason to take the server out
    assert table(config) == table(ref_config) and report.content_hash == ref.content_hash
    assert report.generator == "sglang" and report.generation_temperature == report.bench_temperature == 0.0


def test_openai_completions_give_the_same_tokens_and_chat_is_marked_retokenized(servers, reference, tiny_target_dir,
                                                                                tmp_path):  # fmt: skip
    ref_config, _ = reference
    completions = run_config(tmp_path, tiny_target_dir, "completions", generator="openai", server_urls=servers[:1],
                             openai_model=MODEL_NAME)  # fmt: skip
    acct = build_dataset(completions).accounting
    assert acct["token_ids_source"] == {"server": NUM_PROMPTS} and acct["fallbacks"] == {}  # ids in, ids out
    assert table(completions) == table(ref_config)
    chat = run_config(tmp_path, tiny_target_dir, "chat", generator="openai", server_urls=servers[:1],
                      openai_model=MODEL_NAME, openai_endpoint="chat")  # fmt: skip
    assert build_dataset(chat).accounting["token_ids_source"] == {"retokenized": NUM_PROMPTS}


def test_a_wrong_model_name_is_not_retried_and_takes_the_server_out(servers, tiny_target_dir, tmp_path):
    """A refusal (HTTP 404 here, as vLLM answers an unknown model) is recorded at its first attempt; a server that
    refused every request is taken out after BREAKER_FAILURES of them and the stage stops, naming it."""
    from eyas.dataset.served import BREAKER_FAILURES

    config = run_config(tmp_path, tiny_target_dir, "run", generator="openai", server_urls=servers[:1],
                        openai_model="other", max_attempts=4, max_in_flight=2)  # fmt: skip
    with pytest.raises(DatasetError) as err:
        build_dataset(config)
    assert str(err.value).startswith("regeneration stopped: no server left to ask, ")
    assert f"{servers[0]} was taken out after {BREAKER_FAILURES} failed requests in a row" in str(err.value)
    assert "The model `other` does not exist." in str(err.value)
    log = config.paths.dataset_dir / f"responses-{dataset_cache_key(config.dataset, config.target.model_path)}.log"
    records = ResponseLog(log).read().values()
    assert BREAKER_FAILURES <= len(records) < NUM_PROMPTS and {r["status"] for r in records} == {"failed"}
    assert {r["attempts"] for r in records} == {1}  # never retried: the same request would be refused again


@pytest.fixture(scope="module")
def aborting(tiny_target_dir, tmp_path_factory):
    """A double that aborts the first request of every 4th new prompt of each endpoint as SGLang answers a request
    stopped by /abort_request (generation_double.aborted_answer: HTTP 200, partial output_ids, finish_reason
    abort)."""
    port = free_port()
    proc = start(tiny_target_dir, port, abort_every=4, log_path=tmp_path_factory.mktemp("aborting") / "double.log")
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_an_aborted_answer_is_retried_and_never_kept_as_a_response(aborting, reference, tiny_target_dir, tmp_path):
    ref_config, ref = reference
    config = run_config(tmp_path, tiny_target_dir, "run", generator="sglang", server_urls=[aborting], max_in_flight=3)
    acct = build_dataset(config).accounting
    assert acct["answered"] == NUM_PROMPTS and acct["failed"] == 0 and acct["retried"] == NUM_PROMPTS // 4
    assert table(config) == table(ref_config)  # no partial, aborted answer among the responses
    log = config.paths.dataset_dir / f"responses-{dataset_cache_key(config.dataset, config.target.model_path)}.log"
    records = ResponseLog(log).read().values()
    assert sorted(r["attempts"] for r in records) == [1] * (NUM_PROMPTS - NUM_PROMPTS // 4) + [2] * (NUM_PROMPTS // 4)
    assert {r["finish_reason"] for r in records} <= {"stop", "length"}


def test_an_answer_aborted_at_every_attempt_is_counted_failed_with_the_reason(aborting, tiny_target_dir, tmp_path):
    """Through the OpenAI-compatible endpoint (SGLang's /v1/completions says finish_reason "abort")."""
    config = run_config(tmp_path, tiny_target_dir, "run", generator="openai", server_urls=[aborting],
                        openai_model=MODEL_NAME, max_attempts=1)  # fmt: skip
    with pytest.raises(DatasetError) as err:
        build_dataset(config)
    reason, aborted = f"{aborting}: aborted by the server (finish_reason abort)", NUM_PROMPTS // 4
    assert f"{aborted} of {NUM_PROMPTS} prompts failed every attempt ({{'{reason}': {aborted}}})" in str(err.value)
    log = config.paths.dataset_dir / f"responses-{dataset_cache_key(config.dataset, config.target.model_path)}.log"
    failed = [r for r in ResponseLog(log).read().values() if r["status"] == "failed"]
    assert len(failed) == aborted and {r["reason"] for r in failed} == {reason}


def test_the_log_drops_a_torn_last_line_and_refuses_a_damaged_one(tmp_path):
    log = ResponseLog(tmp_path / "r.log")
    for i in range(3):
        log.append({"id": f"p{i}", "status": "answered", "output_ids": [i], "attempts": 1, "finish_reason": "stop",
                    "token_ids_source": "server"})  # fmt: skip
    log.append({"id": "p0", "status": "answered", "output_ids": [9], "attempts": 1, "finish_reason": "stop",
                "token_ids_source": "server"})  # fmt: skip
    log.close()
    whole = (tmp_path / "r.log").read_bytes()
    (tmp_path / "r.log").write_bytes(whole + b'xxh3-128:0123 {"id": "p3", "status": "answ')  # killed mid-write
    records = ResponseLog(tmp_path / "r.log").read()
    assert sorted(records) == ["p0", "p1", "p2"] and records["p0"]["output_ids"] == [0]  # the first answer kept
    assert (tmp_path / "r.log").read_bytes() == whole  # the torn tail is cut off
    lines = whole.split(b"\n")
    lines[1] = lines[1].replace(b'"output_ids":[1]', b'"output_ids":[7]')
    (tmp_path / "r.log").write_bytes(b"\n".join(lines))
    with pytest.raises(DatasetError, match=r"r.log: line 2 is damaged \(not a record, or its checksum differs\)"):
        ResponseLog(tmp_path / "r.log").read()


def test_the_flow_survives_a_server_restart_and_a_kill_of_the_stage(prefect_server, servers, reference,
                                                                    tiny_target_dir, tmp_path):  # fmt: skip
    """The dataset flow in its own process on a real Prefect server, through two slow servers: one is killed
    and restarted mid-run (the circuit breaker may take it out before the restart: the other answers its
    prompts), then the whole stage is killed with SIGKILL; a re-run finishes the table."""
    ref_config, ref = reference
    ports = [free_port(), free_port()]
    slow = [start(tiny_target_dir, p, delay_s=0.5, log_path=tmp_path / f"slow-{p}.log") for p in ports]
    config = run_config(tmp_path, tiny_target_dir, "run", generator="sglang", max_in_flight=2, max_attempts=8,
                        server_urls=[f"http://127.0.0.1:{p}" for p in ports])  # fmt: skip
    (tmp_path / "config.json").write_text(config.model_dump_json())
    key = dataset_cache_key(config.dataset, config.target.model_path)
    log_path = config.paths.dataset_dir / f"responses-{key}.log"
    script = ("import sys; from eyas.config import load_run_config; from flows.dataset import build_dataset_flow; "
              "build_dataset_flow(load_run_config(sys.argv[1]))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def answered() -> int:
        return log_path.read_bytes().count(b"\n") if log_path.exists() else 0

    def wait(predicate, what, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    try:
        stage = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "config.json")], cwd=REPO, env=env,
                                 stdout=open(tmp_path / "stage1.log", "wb"), stderr=subprocess.STDOUT)  # fmt: skip
        wait(lambda: answered() >= 4, "the first answers")
        slow[1].send_signal(signal.SIGKILL)  # a server dies; its requests in flight fail and are retried
        slow[1].wait()
        wait(lambda: answered() >= 8, "answers from the surviving server")
        # the restart runs beside the stage: waiting for it here, the survivor alone could answer every prompt
        # before the stage is killed (a loaded machine starts the double in seconds)
        restart = threading.Thread(target=lambda: slow.__setitem__(1, start(
            tiny_target_dir, ports[1], delay_s=0.5, log_path=tmp_path / f"slow-{ports[1]}.log")))  # fmt: skip
        restart.start()
        wait(lambda: answered() >= 12, "answers while the server restarts")
        stage.send_signal(signal.SIGKILL)  # the stage's process is killed at once
        stage.wait()
        before = answered()
        restart.join()
        assert 12 <= before < NUM_PROMPTS and not config.paths.tokenized.exists()
        again = subprocess.run([sys.executable, "-c", script, str(tmp_path / "config.json")], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=600)  # fmt: skip
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    finally:
        for p in slow:
            p.kill()
            p.wait()
    report = json.loads((config.paths.dataset_dir / "report.json").read_text())
    acct = report["accounting"]
    assert acct["resumed_answered"] >= before - 1  # at most a torn last record is asked again
    assert acct["answered"] + acct["failed"] + acct["skipped"] == acct["input"] == NUM_PROMPTS == acct["answered"]
    assert table(config) == table(ref_config) and report["content_hash"] == ref.content_hash
    records = ResponseLog(log_path).read()
    assert sorted(records) == sorted(r[0] for r in table(ref_config))  # every prompt once in the final table


def test_the_gate_shows_the_accounting_the_servers_fallbacks_and_a_sampling_mismatch():
    from eyas.gate.summary import dataset_notes

    acct = {"input": 10, "answered": 8, "failed": 1, "skipped": 1, "failed_reasons": {"http://a: HTTP 500": 1},
            "skipped_reasons": {"no user turn to answer": 1}, "token_ids_source": {"server": 8}}  # fmt: skip
    rows, mismatch = dataset_notes({"accounting": acct, "generation_temperature": 0.7, "bench_temperature": 0.0})
    assert rows == ("rows: 8 answered + 1 failed + 1 skipped = 10 input (1 x http://a: HTTP 500; 1 x no user turn "
                    "to answer); token ids: 8 server")  # fmt: skip
    assert mismatch.startswith("**sampling mismatch**: the responses were sampled at temperature 0.7, the benchmark")
    assert dataset_notes({"accounting": acct, "generation_temperature": 0.0, "bench_temperature": 0.0}) == [rows]
    served = {**acct, "token_ids_source": {"retokenized": 8}, "fallbacks": {"http://a": ["return_token_ids refused "
              "(HTTP 422: ...): the answers' text is re-tokenized"]}, "servers_taken_out": {"http://b": "was taken "
              "out after 8 failed requests in a row; its last answer: HTTP 500"}}  # fmt: skip
    assert dataset_notes({"accounting": served})[1:] == [
        "http://a: return_token_ids refused (HTTP 422: ...): the answers' text is re-tokenized",
        "http://b was taken out after 8 failed requests in a row; its last answer: HTTP 500",
    ]


def test_eyas_launches_the_regeneration_server_and_stops_it(reference, tiny_target_dir, tmp_path, monkeypatch):
    """generator sglang without server_urls: eyas starts the server of `eyas engine-command --stage generate`
    (here the double in its place: eyas.dataset.build.generation_launch with the double's module) and stops it."""
    from dataclasses import replace

    import eyas.dataset.build as build

    ref_config, _ = reference
    port = free_port()
    real = build.generation_launch
    monkeypatch.setattr(build, "generation_launch", lambda config: replace(real(config),
                        module="tests.generation_double", python=sys.executable))  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(REPO)
    config = run_config(tmp_path, tiny_target_dir, "run", generator="sglang", sglang_port=port)
    report = build_dataset(config)
    assert report.accounting["answered"] == NUM_PROMPTS and table(config) == table(ref_config)
    assert "generation double serving" in (config.paths.dataset_dir / "sglang-generate.log").read_text()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
