"""Small runs for tests: a tokenized table, a synthetic run (eyas.shards.synthetic) with a TrainJob over it,
and the trainer under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyas.config import DraftConfig, TrainConfig, TrainJob
from eyas.shards.synthetic import SyntheticSpec, write_synthetic_run
from eyas.train.metrics import parse_metric_line

REPO = Path(__file__).resolve().parents[1]
SPEC = SyntheticSpec()
AUX_LAYER_IDS = list(SPEC.aux_layer_ids)


def write_tokenized(path, samples, *, dataset_hash="d5e7", sample_index=None, masks=None):
    """A tokenized table as eyas.dataset.table holds it; the loss mask is on the second half of each sample
    unless `masks` are given; `dataset_hash` None leaves the content hash out."""
    n = len(samples)
    masks = masks if masks is not None else [[int(i >= len(s) // 2) for i in range(len(s))] for s in samples]
    table = pa.table(
        {
            "sample_index": pa.array(sample_index if sample_index is not None else range(n), pa.int64()),
            "id": pa.array([f"s{i}" for i in range(n)]),
            "input_ids": pa.array(samples, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(s) for s in samples], pa.int32()),
        }
    )
    if dataset_hash is not None:
        table = table.replace_schema_metadata({b"eyas.content_hash": dataset_hash.encode()})
    pq.write_table(table, path)
    return path


def write_tiny_run(root: Path, *, num_samples: int = 32, per_shard: int = 10, seed: int = 0, **kw) -> dict:
    return write_synthetic_run(root, num_samples=num_samples, per_shard=per_shard, seed=seed, **kw)


def tiny_job(run: dict, output_dir: Path, **train) -> TrainJob:
    """A TrainJob over a tiny run: a small draft, 3 TTT steps, gloo."""
    defaults = dict(
        num_processes=2,
        backend="gloo",
        global_batch_size=8,
        lr=1e-2,
        num_warmup_steps=1,
        num_ttt_steps=3,
        save_every_steps=2,
        num_checkpoints_kept=2,
        seed=0,
    )
    return TrainJob(
        target_path=str(run["target"]),
        shards_dir=str(run["shards"]),
        vocab_path=str(run["vocab"]),
        output_dir=str(output_dir),
        aux_layer_ids=AUX_LAYER_IDS,
        draft=DraftConfig(
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=64
        ),
        train=TrainConfig(**{**defaults, **train}),
    )


def run_trainer(job_path: Path, nproc: int | None) -> tuple[str, list[dict]]:
    """`torchrun --nproc_per_node=N -m eyas.train`, or plain `python -m eyas.train` when nproc is None."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = (launcher if nproc else [sys.executable]) + ["-m", "eyas.train", "--config", str(job_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    metrics = [m for m in map(parse_metric_line, proc.stdout.splitlines()) if m is not None]
    return proc.stdout, metrics


def extract(tokenized, shards, target, cfg=None, *, aux_layer_ids=None, **kwargs):
    """run_extraction over a tokenized table and a target: `shards` is a local directory, s3://bucket/prefix,
    or a Storage object (then the coordinator and its threads use it)."""
    from eyas.config import ExtractConfig
    from eyas.extract.coordinator import run_extraction
    from eyas.facts import facts_for

    cfg = cfg or ExtractConfig()
    store = shards if hasattr(shards, "put_bytes") else None
    url = store.url if store is not None else str(shards)
    local = "" if url.startswith("s3://") else url
    facts = facts_for(
        target_path=target,
        tokenized_path=tokenized,
        aux_layer_ids=aux_layer_ids,
        shards_dir=local,
        storage_url=url,
        s3_endpoint_url=cfg.s3_endpoint_url,
    )
    return run_extraction(cfg, facts, store=store, **kwargs)


def small_run_config(workdir: Path, tiny: Path, **sections):
    """The tiny preset on 32 short samples and small shards, for runs of the whole pipeline in tests; `sections`
    update fields of a section (`train={"num_epochs": 3}`)."""
    from eyas.config import load_run_config

    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    wanted = {
        "target": {"model_path": str(tiny)},
        "dataset": {"prompts_path": str(tiny / "prompts.jsonl"), "num_samples": 32, "max_new_tokens": 16},
        "extract": {"shard_bytes": 1 << 16},
    }
    for name, fields in sections.items():
        wanted[name] = {**wanted.get(name, {}), **fields}
    update = {name: getattr(base, name).model_copy(update=fields) for name, fields in wanted.items()}
    return base.model_copy(update={"workdir": str(workdir), **update})


def regeneration_config(workdir: Path, tiny: Path, *, num_samples: int, max_new_tokens: int, **generation):
    """The tiny preset whose dataset stage regenerates `num_samples` of the tiny target's prompts with
    `dataset.generation` updated by `generation` (generator, server_urls, ...)."""
    from eyas.config import load_run_config

    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    dataset = base.dataset.model_copy(
        update={
            "prompts_path": str(tiny / "prompts.jsonl"),
            "num_samples": num_samples,
            "max_new_tokens": max_new_tokens,
            "generation": base.dataset.generation.model_copy(update=generation),
        }
    )
    target = base.target.model_copy(update={"model_path": str(tiny)})
    return base.model_copy(update={"workdir": str(workdir), "target": target, "dataset": dataset})


def gated_run_config(workdir: Path, tiny: Path, *, num_samples: int, timeout_s: int = 120):
    """The tiny preset in `workdir` holding a tokenized table of `num_samples` samples: what a run holds when it
    reaches the approval gate (answered within `timeout_s`)."""
    from eyas.config import load_run_config

    base = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    config = base.model_copy(
        update={
            "workdir": str(workdir),
            "target": base.target.model_copy(update={"model_path": str(tiny)}),
            "approval": base.approval.model_copy(update={"timeout_s": timeout_s}),
        }
    )
    config.paths.dataset_dir.mkdir(parents=True)
    write_tokenized(config.paths.tokenized, [[1, 2, 3, 4]] * num_samples)
    return config


def peak_memory_case(case: dict) -> dict:
    """`python -m eyas.train.peak_memory CASE` in a process of its own (one torch thread): measured and planned
    peaks of a training step of the case."""
    import json

    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eyas.train.peak_memory", json.dumps(case)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
