"""Cached stages are keyed by the evidence of their outputs too (tasks/caching.py): an output deleted, damaged or
written by something else since its stage wrote it makes the next run of the stage rebuild it, on a real
Prefect server; outputs left alone come back Cached."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from run_queries import task_runs

from eyas.config import load_run_config
from eyas.dataset.table import read_tokenized_meta

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")

CONVERSATIONS = [
    [{"role": "user", "content": f"question {i}: what is {i} and {i}?"}, {"role": "assistant", "content": f"{2 * i}"}]
    for i in range(6)
]


@pytest.fixture
def config(tmp_path, tiny_target_dir):
    """The tiny preset on conversations taken as given (tokenized for real in well under a second)."""
    base = load_run_config(tiny_target_dir.parents[1] / "deployments" / "tiny-cpu.json")
    prompts = tmp_path / "conversations.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"c{i}", "conversations": c}) + "\n" for i, c in enumerate(CONVERSATIONS))
    )
    return base.model_copy(
        update={
            "workdir": str(tmp_path / "run"),
            "target": base.target.model_copy(update={"model_path": str(tiny_target_dir)}),
            "dataset": base.dataset.model_copy(
                update={"prompts_path": str(prompts), "responses": "as_given", "draft_vocab_size": 32}
            ),
        }
    )


def run_tasks(config, *tasks) -> dict[str, str]:
    """The given tasks, in order, in a new flow run: {task name: its final state name}."""
    from prefect import flow

    @flow(name="output-cache-probe")
    def probe(config):
        for fn in tasks:
            fn(config)

    state = probe(config, return_state=True)
    assert state.is_completed(), state.message
    runs = task_runs(state.state_details.flow_run_id)
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def run_dataset(config) -> dict[str, str]:
    from tasks.dataset import build_vocab_mapping, regenerate_and_tokenize

    return run_tasks(config, regenerate_and_tokenize, build_vocab_mapping)


def flip_byte(path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


DATASET = {"regenerate-and-tokenize": "Completed", "build-vocab-mapping": "Completed"}
CACHED = {"regenerate-and-tokenize": "Cached", "build-vocab-mapping": "Cached"}


def test_unchanged_dataset_outputs_come_back_cached(prefect_server, config):
    assert run_dataset(config) == DATASET
    assert run_dataset(config) == CACHED


def test_deleted_table_is_rebuilt_by_rerunning_the_dataset_stage(prefect_server, config):
    run_dataset(config)
    table = config.paths.tokenized.read_bytes()
    config.paths.tokenized.unlink()
    assert run_dataset(config) == {**CACHED, "regenerate-and-tokenize": "Completed"}
    assert config.paths.tokenized.read_bytes() == table  # the same table: the vocab built from it stays valid
    assert run_dataset(config) == CACHED


def test_damaged_table_is_rebuilt_not_reused(prefect_server, config, capsys):
    """A flipped byte inside the table's data pages leaves its footer (and the cache key in it) readable: the
    stage must not take it for its own table."""
    run_dataset(config)
    table = config.paths.tokenized.read_bytes()
    chunk = pq.read_metadata(config.paths.tokenized).row_group(0).column(2)  # input_ids
    middle = chunk.data_page_offset + chunk.total_compressed_size // 2
    flip_byte(config.paths.tokenized, middle / config.paths.tokenized.stat().st_size)
    assert read_tokenized_meta(config.paths.tokenized)["eyas.cache_key"]  # the library alone would reuse it
    assert run_dataset(config) == {**CACHED, "regenerate-and-tokenize": "Completed"}
    assert config.paths.tokenized.read_bytes() == table
    out = capsys.readouterr().out
    assert "regenerate-and-tokenize: dataset/tokenized.parquet changed since this stage wrote them" in out
    assert f"regenerate-and-tokenize: removed {config.paths.tokenized}" in out


def test_deleted_dataset_report_rebuilds_the_table_set(prefect_server, config):
    """The table is reused by the library only with its report: a missing report rebuilds the set."""
    run_dataset(config)
    report = config.paths.dataset_dir / "report.json"
    report.unlink()
    assert run_dataset(config) == {**CACHED, "regenerate-and-tokenize": "Completed"}
    assert json.loads(report.read_text())["num_samples"] == len(CONVERSATIONS)


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_deleted_or_damaged_vocab_is_rebuilt(prefect_server, config, damage):
    run_dataset(config)
    vocab = config.paths.vocab.read_bytes()
    config.paths.vocab.unlink() if damage == "delete" else flip_byte(config.paths.vocab, 0.9)
    assert run_dataset(config) == {**CACHED, "build-vocab-mapping": "Completed"}
    assert config.paths.vocab.read_bytes() == vocab


def test_damaged_output_record_runs_the_stage_again(prefect_server, config, capsys):
    run_dataset(config)
    record = config.paths.root / ".eyas-cache" / "build-vocab-mapping.json"
    record.write_text("{torn")
    assert run_dataset(config) == {**CACHED, "build-vocab-mapping": "Completed"}
    assert f"{record}: not an output record" in capsys.readouterr().out
    assert run_dataset(config) == CACHED


def test_deleted_or_damaged_verification_report_runs_verification_again(prefect_server, config, monkeypatch):
    """The report is the stage's output (eyas status reads it); a stand-in verification of an empty shard set
    writes it here (the real one is tests/test_verify*.py's, and needs extracted shards)."""
    import tasks.verify
    from eyas.verify.report import VerifyReport, write_verify_report

    calls = []

    def verify_run(config, facts, progress=None):
        calls.append(facts)
        report = VerifyReport(mode="cheap", rows=[])
        write_verify_report(report, config.paths.verify_report)
        return report

    monkeypatch.setattr(tasks.verify, "verify_run", verify_run)

    def verify(config):
        tasks.verify.verify_shard_set(config, None)

    states = [run_tasks(config, verify) for _ in range(2)]
    config.paths.verify_report.unlink()
    states.append(run_tasks(config, verify))
    flip_byte(config.paths.verify_report)
    states += [run_tasks(config, verify) for _ in range(2)]
    assert [s["verify-shards"] for s in states] == ["Completed", "Cached", "Completed", "Completed", "Cached"]
    assert len(calls) == 3


def test_deleted_or_damaged_smoke_output_runs_the_smoke_again(prefect_server, config, monkeypatch):
    """RUN/smoke (the smoke checkpoint and smoke.json) is the smoke run's output; a stand-in smoke writes it here
    (the real one is tests/test_smoke.py's, and needs extracted shards)."""
    from types import SimpleNamespace

    import tasks.train

    calls = []

    def run_smoke(config, facts):
        calls.append(facts)
        checkpoint = config.paths.smoke_dir / "checkpoints" / "step-00000030"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "model.safetensors").write_bytes(b"weights %d" % len(calls))
        (config.paths.smoke_dir / "smoke.json").write_text(json.dumps({"passed": True}))
        fields = "first last seconds num_samples tokens_per_s device precision save_s peak_bytes micro_batches modules"
        return SimpleNamespace(**dict.fromkeys(fields.split(), 1), losses=[2.0, 1.0], passed=True)

    monkeypatch.setattr(tasks.train, "run_smoke", run_smoke)

    def smoke(config):
        tasks.train.smoke_run(config, None)

    states = [run_tasks(config, smoke) for _ in range(2)]
    (config.paths.smoke_dir / "smoke.json").unlink()
    states.append(run_tasks(config, smoke))
    with open(config.paths.smoke_dir / "checkpoints" / "step-00000030" / "model.safetensors", "ab") as f:
        f.write(b"!")
    states += [run_tasks(config, smoke) for _ in range(2)]
    assert [s["smoke-run"] for s in states] == ["Completed", "Cached", "Completed", "Completed", "Cached"]
    assert len(calls) == 3
