"""What the pipeline benchmarks share (bench/shard_bytes.py, bench/draft_variants.py, bench/orchestration.py): the
demo's dataset built once, shards extracted into a directory, one training on one process with its export and its
tau on the reference engine, and the quick modes' cut of the demo preset."""

from __future__ import annotations

import json
import time
from pathlib import Path

from eyas.config import RunConfig, TrainJob

REPO = Path(__file__).resolve().parents[1]


def demo_config(preset: str, workdir: str, **export) -> RunConfig:
    """The preset (the demo's, by default) with its repo-relative paths made absolute, writing to `workdir`;
    `export` overrides fields of its export section."""
    data = json.loads(Path(preset).read_text())
    for section, key in (("target", "model_path"), ("dataset", "prompts_path"), ("bench", "prompts_path")):
        data[section][key] = str(REPO / data[section][key])
    data["workdir"] = workdir
    data["export"] = {**data.get("export", {}), **export}
    return RunConfig.model_validate(data)


def quick_config(config: RunConfig) -> RunConfig:
    """The preset cut to seconds for a bench's --quick (the same stages and code paths): 12 prompts answered with
    12 new tokens, 4 training steps of 8 samples on one process, a smoke run of 10 steps on 2 samples, 2 benchmark
    prompts of 8 new tokens, no tau floor."""
    return config.model_copy(
        update={
            "dataset": config.dataset.model_copy(update={"num_samples": 12, "max_new_tokens": 12}),
            "train": config.train.model_copy(
                update={"num_processes": 1, "max_steps": 4, "global_batch_size": 8, "eval_fraction": 0.0}
            ),
            "smoke": config.smoke.model_copy(update={"num_samples": 2, "num_steps": 10, "min_loss_drop": 0.05}),
            "bench": config.bench.model_copy(update={"num_prompts": 2, "max_new_tokens": 8, "min_tau": 0.0}),
        }
    )


def extracted_aux_ids(shards: Path) -> list[int]:
    """The canonical aux layer ids the shards in `shards` were extracted at (their extract.json)."""
    from eyas.shards.shard_set import read_run_meta

    return list(read_run_meta(shards).aux_layer_ids)


def reference_tau(
    target_path: str,
    export_dir: str,
    prompts_path: str,
    num_prompts: int,
    *,
    max_new_tokens: int = 64,
    to_the_end: bool = False,
    longest: int = 0,
) -> float:
    """tau of the exported draft on the reference engine (steps 3, chain, `max_new_tokens`), pooled over the
    prompts: what eyas.bench.acceptance.run_benchmark reports as tau_mean, without its baselines. `to_the_end`:
    each prompt continued past end-of-sequence to the target's longest position (max_position_embeddings), or to
    `longest` when that is lower and not 0."""
    from eyas.bench.acceptance import encode_prompts
    from eyas.bench.reference import load_target_float64, pooled_tau, reference_decode
    from eyas.dataset.prompts import read_prompts
    from eyas.export.reader import load_exported_draft
    from eyas.target import embed_weight

    model = load_target_float64(target_path)
    draft = load_exported_draft(export_dir, embed_weight(model))
    prompts = encode_prompts([r["conversations"] for r in read_prompts(prompts_path, num_prompts)], target_path)
    longest = min(longest or model.config.max_position_embeddings, model.config.max_position_embeddings) - 3 - 1
    # (room for the last round's drafted tokens)
    results = [
        reference_decode(model, draft, ids, max_new_tokens=longest - len(ids) if to_the_end else max_new_tokens,
                         eos_token_id=None if to_the_end else model.config.eos_token_id,
                         aux_layer_ids=draft.aux_layer_ids, steps=3, topk=1, num_draft_tokens=4)
        for ids in prompts
    ]  # fmt: skip
    return pooled_tau(results)


def train_and_measure(
    job_json: str,
    export_dir: str,
    prompts_path: str,
    num_prompts: int,
    *,
    sglang_version: str | None = None,
    num_long_prompts: int = 0,
    long_position: int = 0,
) -> dict:
    """One training on one process, its export (for SGLang >= `sglang_version`; a stack of draft layers in format
    sglang-0.5.12) and its tau; with
    `num_long_prompts`, also tau_long over that many prompts continued to the target's longest position (or to
    `long_position` when lower and not 0; runs in a worker process; its output goes to OUTPUT_DIR/train.log)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from eyas.export.configs import TargetRef
    from eyas.export.convert import export_checkpoint
    from eyas.train.checkpoint import latest_complete
    from eyas.train.parallel import Dist
    from eyas.train.trainer import Trainer

    torch.set_num_threads(1)
    job = TrainJob.model_validate_json(job_json)
    Path(job.output_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(Path(job.output_dir) / "train.log", "w") as log, contextlib.redirect_stdout(log):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            Trainer(job, Dist(rank=0, world=1, device=torch.device("cpu"))).run()
        finally:
            dist.destroy_process_group()
    train_s = time.perf_counter() - t0
    fmt = "sglang" if job.draft.num_layers == 1 else "sglang-0.5.12"
    export_checkpoint(latest_complete(job.output_dir), export_dir, to=fmt, target=TargetRef.read(job.target_path),
                      sglang_version=sglang_version)  # fmt: skip
    tau = reference_tau(job.target_path, export_dir, prompts_path, num_prompts)
    out = {"tau": tau, "train_s": train_s}
    if num_long_prompts:
        out["tau_long"] = reference_tau(job.target_path, export_dir, prompts_path, num_long_prompts, to_the_end=True,
                                        longest=long_position)  # fmt: skip
    return {**out, "bench_s": time.perf_counter() - t0 - train_s}


def prepare(base: RunConfig) -> None:
    """The dataset and vocab mapping of the demo preset, built once (reused when present)."""
    from eyas.dataset.build import build_dataset
    from eyas.dataset.vocab import build_vocab

    report = build_dataset(base)
    build_vocab(base)
    print(
        f"dataset: {report.num_samples} samples, {report.num_tokens} tokens ({'reused' if report.reused else 'built'})"
    )


def extract_variant(config: RunConfig, shards_dir: Path) -> int:
    """Extract the shards of one encoding (resumed when present); their total bytes."""
    from eyas.extract.coordinator import run_extraction
    from eyas.facts import facts_for
    from eyas.shards.manifest import read_manifest

    facts = facts_for(target_path=config.target.model_path, tokenized_path=config.paths.tokenized,
                      shards_dir=shards_dir)  # fmt: skip
    run_extraction(config.extract, facts, target_dtype=config.target.dtype)
    return sum(r.num_bytes for r in read_manifest(shards_dir))
