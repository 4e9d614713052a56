"""A failed training says why: the first failing rank's own exception (type, message, where it was raised) and
the path of train/torchrun.log are the launch task's, the flow's and the `eyas train` command's failure message
(eyas.train.failure, eyas.train.launch, tasks/train.py); a deterministic failure is not relaunched.

Real runs of `eyas train`: two gloo ranks under torchrun on a synthetic run laid out as a workdir
(eyas.shards.synthetic), with one shard damaged after extraction (tests/faults.py): a NaN written with a valid
checksum (the loss goes NaN on every rank after two checkpoints: the launch progressed, and is still not
relaunched), or its bytes flipped (the trainer's checksum check refuses it on the one rank that reads it,
while the other rank then loses its peer: the first is named).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from faults import apply_fault
from run_queries import logs, task_runs, top_run_tagged

from eyas.config import load_run_config
from eyas.gate.approval import gate_fingerprint
from eyas.shards.synthetic import SYNTHETIC_DATASET_HASH, write_synthetic_run
from eyas.status.launches import read_launches
from eyas.train.failure import FAILURES_DIR, TrainerFailure, first_failure, read_failures, record_failure

pytestmark = pytest.mark.usefixtures("flush_prefect_logs")

REPO = Path(__file__).resolve().parents[1]


def failing_workdir(tmp_path: Path, fault: str, at: int) -> tuple[Path, object]:
    """The tiny preset over a synthetic run in tmp_path/run (dataset, vocab and shards as the stages leave them,
    the approval on record) whose shard `at` has `fault`; (config path, config)."""
    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    workdir = tmp_path / "run"
    sections = {
        "target": {"model_path": str(workdir / "target"), "aux_layer_ids": [1, 2, 3]},
        "dataset": {"draft_vocab_size": 32},
        "draft": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64},
        "train": {"global_batch_size": 8, "lr": 1e-2, "num_warmup_steps": 1, "num_ttt_steps": 3, "max_steps": 6,
                  "save_every_steps": 1, "num_checkpoints_kept": 2, "eval_fraction": 0.0, "seed": 0},
        "smoke": {"num_steps": 20, "lr": 1e-2},
    }  # fmt: skip
    update = {name: getattr(base, name).model_copy(update=fields) for name, fields in sections.items()}
    config = base.model_copy(update={"workdir": str(workdir), **update})
    run = write_synthetic_run(workdir, num_samples=32, per_shard=10)
    write_table(config.paths.tokenized, run["samples"])
    run["vocab"].rename(config.paths.vocab)
    apply_fault(config.paths.shards_dir, fault, at=at)
    approval = {"approve": True, "reviewer": "test", "note": "", "decided_at": "2026-01-01T00:00:00+00:00"}
    (workdir / "approval.json").write_text(json.dumps({**approval, "config_fingerprint": gate_fingerprint(config)}))
    path = tmp_path / "config.json"
    path.write_text(config.model_dump_json())
    return path, config


def write_table(path: Path, samples: list[dict]) -> None:
    """The tokenized table of the synthetic samples, as the dataset stage writes it."""
    ids = [s["input_ids"].tolist() for s in samples]
    table = pa.table(
        {
            "sample_index": pa.array(range(len(ids)), pa.int64()),
            "id": pa.array([f"s{i}" for i in range(len(ids))]),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array([s["loss_mask"].tolist() for s in samples], pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(x) for x in ids], pa.int32()),
        }
    ).replace_schema_metadata({"eyas.content_hash": SYNTHETIC_DATASET_HASH})
    path.parent.mkdir(parents=True)
    pq.write_table(table, path)


def assert_names_the_reason(message: str, config, *words: str) -> None:
    log_path = config.paths.train_dir / "torchrun.log"
    assert "training failed on rank " in message and " of 2 " in message, message
    for word in (*words, f"the whole log: {log_path}"):
        assert word in message, f"{word!r} not in:\n{message}"
    assert "ChildFailedError" not in message and "Root Cause" not in message  # not torchrun's summary


def test_the_oldest_record_is_the_first_failure_and_a_bad_record_is_named(tmp_path, monkeypatch):
    def raised(exc):
        try:
            raise exc
        except Exception as e:
            return e

    monkeypatch.delenv("RANK", raising=False)
    path = record_failure(tmp_path, raised(ValueError("shard x: checksum")))
    assert path == tmp_path / FAILURES_DIR / "rank-00000.json"
    recorded = json.loads(path.read_text())
    later = {**recorded, "rank": 1, "time": recorded["time"] + 0.001, "type": "DistBackendError"}
    (tmp_path / FAILURES_DIR / "rank-00001.json").write_text(json.dumps(later))
    first = first_failure(read_failures(tmp_path))
    assert (first.rank, first.type, first.message) == (0, "ValueError", "shard x: checksum")
    assert first.kinds == ["ValueError", "Exception", "BaseException", "object"]
    assert first.where.startswith("tests/test_train_failure.py:") and first.where.endswith(" in raised")
    assert "raise exc" in first.traceback
    earlier = {**later, "time": recorded["time"] - 0.001}
    (tmp_path / FAILURES_DIR / "rank-00001.json").write_text(json.dumps(earlier))
    assert first_failure(read_failures(tmp_path)) == TrainerFailure(**earlier)
    (tmp_path / FAILURES_DIR / "rank-00001.json").write_text("{cut")
    with pytest.raises(ValueError, match=r"trainer failure record \S+rank-00001.json: not a record"):
        read_failures(tmp_path)


CASES = {
    # a NaN in sample 20 (shard 2), first read at step 3 by both ranks, after the checkpoints of steps 1 and 2
    "nan": (2, r"training failed on rank [01] of 2 ", "FloatingPointError: step 3: loss nan", "trainer.py:"),
    # shard 3's bytes changed: only rank 1 reads it at step 1; rank 0 then loses its peer in the step's collective
    "flip": (3, "training failed on rank 1 of 2 ", "ShardDataError: shard shard-00003.safetensors: checksum ",
             "reader.py:"),
}  # fmt: skip


@pytest.mark.parametrize("fault", sorted(CASES))
@pytest.mark.usefixtures("removes_crash_automation")
def test_eyas_train_prints_the_first_failing_rank_its_reason_and_the_log(prefect_server, tmp_path, fault):
    """`eyas train CONFIG` (the real command: input checks, preflight, smoke run, the approval on record,
    torchrun): it exits 1 and prints the first failing rank's exception and the log's path, which is also the
    message of the flow run on the server; the launch is not relaunched, not even after progress (nan)."""
    at, rank_pattern, *words = CASES[fault]
    path, config = failing_workdir(tmp_path, fault, at)
    done = subprocess.run([sys.executable, "-m", "eyas_cli.main", "train", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 1, (done.stdout + done.stderr)[-5000:]
    answer = json.loads(done.stdout[done.stdout.rindex('{\n  "state"') :])
    assert answer["state"] == "Failed" and re.search(rank_pattern, answer["message"]), answer
    assert_names_the_reason(answer["message"], config, *words)
    [tag] = read_launches(config.paths.root)
    flow_run = top_run_tagged(tag)
    assert flow_run.state.message == answer["message"]
    [launch] = task_runs(flow_run.id, "launch-torchrun")
    reason = answer["message"][answer["message"].index("TorchrunFailed: ") :]
    assert launch.run_count == 1 and launch.state.message.endswith(reason), launch.state.message
    rank = int(re.search(r"training failed on rank (\d)", reason).group(1))
    first = read_failures(config.paths.train_dir)[0]
    assert first.rank == rank and f"{first.type}: {first.message}" in reason
    if fault == "nan":
        checkpoints = sorted(p.name for p in (config.paths.train_dir / "checkpoints").glob("step-*"))
        assert checkpoints == ["step-00000001", "step-00000002"]
        said = "\n".join(logs(flow_run.id))
        assert (
            f"trainer failed after reaching step-00000002 (started from step 0): not relaunched: rank {rank}'s "
            "FloatingPointError would stop every launch from this checkpoint the same way"
        ) in said
