"""Runs as the stages leave them on disk, for the `eyas status` tests: the tiny preset over a synthetic run (dataset,
shards, verification, smoke run, approval, checkpoints, export, benchmark), written in the stages' own formats."""

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyas.config import load_run_config
from eyas.gate.approval import gate_fingerprint
from eyas.shards.synthetic import write_synthetic_run
from eyas.verify.report import ShardReportRow, VerifyReport, write_verify_report

REPO = Path(__file__).resolve().parents[1]
NUM_SAMPLES, PER_SHARD = 32, 10  # 4 shards
CONTENT_HASH = "0123456789abcdef"


def config_at(workdir: Path, tmp_path: Path):
    """The tiny preset with this workdir, written to tmp_path/config.json; (path, config)."""
    config = load_run_config(REPO / "deployments" / "tiny-cpu.json").model_copy(update={"workdir": str(workdir)})
    path = tmp_path / "config.json"
    path.write_text(config.model_dump_json())
    return path, config


def write_dataset(config, samples: list[dict]) -> None:
    ids = [s["input_ids"].tolist() for s in samples]
    masks = [s["loss_mask"].tolist() for s in samples]
    table = pa.table(
        {
            "sample_index": pa.array(range(len(ids)), pa.int64()),
            "id": pa.array([f"s{i}" for i in range(len(ids))]),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(x) for x in ids], pa.int32()),
        }
    ).replace_schema_metadata({"eyas.content_hash": CONTENT_HASH, "eyas.cache_key": "test"})
    paths = config.paths
    paths.dataset_dir.mkdir(parents=True)
    pq.write_table(table, paths.tokenized)
    report = {"num_samples": len(ids), "num_tokens": sum(map(len, ids)), "num_loss_tokens": sum(map(sum, masks))}
    (paths.dataset_dir / "report.json").write_text(json.dumps(report))


def write_extract_meta(config, num_shards: int, **changed) -> None:
    meta = {
        "format_version": "2", "target_fingerprint": "synthetic", "aux_layer_ids": [1, 2, 3],
        "layer_id_convention": "hf_hidden_states", "hidden_size": 32, "num_aux": 3, "dtype": "float32",
        "target_dtype": "float32", "backend": "hf", "dataset_hash": CONTENT_HASH, "shard_bytes": 4194304,
        "num_shards": num_shards, "aux_dtype": "float32", "teacher": "last_hidden", "teacher_topk": 0, **changed,
    }  # fmt: skip
    (config.paths.shards_dir / "extract.json").write_text(json.dumps(meta))


def build_partial_run(tmp_path: Path, planned: int = 6):
    """Dataset done, 4 of `planned` shards extracted, one interrupted write; (config path, config)."""
    path, config = config_at(tmp_path / "run", tmp_path)
    run = write_synthetic_run(config.paths.root, num_samples=NUM_SAMPLES, per_shard=PER_SHARD)
    write_dataset(config, run["samples"])
    run["vocab"].rename(config.paths.vocab)
    write_extract_meta(config, planned)
    (config.paths.shards_dir / ".shard-00004.safetensors.tmp-4242").write_bytes(b"cut short")
    return path, config


def write_checkpoint_dir(train_dir: Path, step: int, complete: bool = True) -> Path:
    ckpt = train_dir / "checkpoints" / f"step-{step:08d}"
    ckpt.mkdir(parents=True)
    state = {"step": step, "samples_consumed": step * 16, "epoch": 0, "world_size": 2, "loss": 5.0}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    if complete:
        (ckpt / "COMPLETE").write_text(f"{step}\n")
    return ckpt


def write_metrics(train_dir: Path, steps: range) -> None:
    lines = [json.dumps({"step": s, "epoch": 0, "loss": 9.0 - s / 100, "acc_k": [0.5, 0.4], "lr": 1e-4}) for s in steps]
    (train_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def build_trained_run(tmp_path: Path):
    """Every shard extracted and verified, smoke run passed, approved, trained to the planned last step."""
    from eyas.train.data import total_steps

    path, config = build_partial_run(tmp_path, planned=4)
    rows = [ShardReportRow(i, f"shard-{i:05d}.safetensors", "ok", ["header"], "", 100, 1000, 0.1) for i in range(4)]
    write_verify_report(VerifyReport("full", rows), config.paths.verify_report)
    config.paths.smoke_dir.mkdir()
    smoke = {"first": 9.0, "last": 4.0, "passed": True, "num_steps": 40}
    (config.paths.smoke_dir / "smoke.json").write_text(json.dumps(smoke))
    approval = {"approve": True, "reviewer": "ada", "note": "", "decided_at": "2026-01-01T00:00:00+00:00"}
    approval["config_fingerprint"] = gate_fingerprint(config)
    (config.paths.root / "approval.json").write_text(json.dumps(approval))
    last = total_steps(NUM_SAMPLES, config.train)
    ckpt = write_checkpoint_dir(config.paths.train_dir, last)
    write_metrics(config.paths.train_dir, range(1, last + 1))
    final = {"checkpoint": str(ckpt), "step": last, "final_loss": 4.2}
    (config.paths.train_dir / "final.json").write_text(json.dumps(final))
    return path, config, ckpt


def build_finished_run(tmp_path: Path):
    path, config, ckpt = build_trained_run(tmp_path)
    out = config.paths.export_dir / "sglang"
    out.mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("model.safetensors", "x")):
        (out / name).write_text(text)
    (out / "eyas_export.json").write_text(json.dumps({"source_checkpoint": str(ckpt)}))
    os.utime(out / "model.safetensors", (1e9, 1e9))  # exported before the benchmark ran
    config.paths.bench_dir.mkdir()
    bench = {"engine": "reference", "tau_mean": 2.31, "tau_ngram": 1.5, "tau_random": 1.0, "num_prompts": 48}
    bench["accept_rate_per_position"] = [0.6, 0.45, 0.3]
    (config.paths.bench_dir / "benchmark.json").write_text(json.dumps(bench))
    return path, config


def states(status) -> dict[str, str]:
    return {s.stage: s.state for s in status.stages}
