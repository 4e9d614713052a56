"""Training from S3 through a bounded shard cache: steps/s with a cache holding 10% of the shards against a full
local copy, in one run.

Usage: .venv/bin/python bench/train_cache.py [--num-shards 40] [--num-epochs 2] [--cache-fraction 0.1] [--quick]

A synthetic shard set (H 128, ~110 tokens a sample, float32: about 1.8 MB a shard) is written locally and
uploaded to a real S3 API server on loopback (moto's server mode, as in the tests). The trainer runs
in-process as one rank (gloo) three times on the same order (train.shuffle_window_shards = half the shards
the cache holds): from the local directory (the baseline), then from S3 through train.cache_bytes =
cache-fraction of the shard set, then through the same cache with a uniform shuffle (shuffle_window_shards 0:
what the window order saves), each `--repeats` times, interleaved, after a short warm-up run; the median
run of each is reported. A run's steps/s counts every step from the trainer's start, the cache's first fetch
included.
Goal: cache_steps_ratio (cached / local steps/s) >= 0.90. The last line is one JSON object. `--quick` (for the test
suite): 6 shards, one epoch, once each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the S3 API server the tests use

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from eyas.config import DraftConfig, TrainConfig, TrainJob  # noqa: E402
from eyas.shards.manifest import read_manifest  # noqa: E402
from eyas.shards.synthetic import SyntheticSpec, write_synthetic_run  # noqa: E402
from eyas.storage.s3 import S3Storage  # noqa: E402
from eyas.train.parallel import Dist  # noqa: E402
from eyas.train.trainer import Trainer  # noqa: E402

SPEC = SyntheticSpec(hidden=128, num_aux=3, vocab=2048, min_len=96, max_len=128, aux_layer_ids=(2, 4, 5))
PER_SHARD = 8


def make_job(run: dict, out: Path, num_epochs: int, **train) -> TrainJob:
    config = TrainConfig(num_processes=1, global_batch_size=8, lr=1e-3, num_warmup_steps=2, num_ttt_steps=4,
                         num_epochs=num_epochs, save_every_steps=20, **train)  # fmt: skip
    draft = DraftConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512)
    return TrainJob(target_path=str(run["target"]), shards_dir=str(run["shards"]), vocab_path=str(run["vocab"]),
                    output_dir=str(out), aux_layer_ids=list(SPEC.aux_layer_ids), draft=draft, train=config)  # fmt: skip


def time_trainer(job: TrainJob) -> dict:
    start = time.perf_counter()
    trainer = Trainer(job, Dist(rank=0, world=1, device=torch.device("cpu")))
    final = trainer.run()
    seconds = time.perf_counter() - start
    cache = trainer.setup.samples.cache
    stats = cache.stats if cache is not None else None
    return {
        "seconds": round(seconds, 3),
        "steps": final["step"],
        "steps_per_s": round(final["step"] / seconds, 3),
        "fetched": stats.fetched if stats else 0,
        "fetched_mib": round(stats.fetched_bytes / 2**20, 1) if stats else 0.0,
        "wait_s": round(stats.wait_s, 3) if stats else 0.0,
        "peak_cache_mib": round(stats.max_bytes_on_disk / 2**20, 2) if stats else 0.0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-shards", type=int, default=40)
    p.add_argument("--num-epochs", type=int, default=2)
    p.add_argument("--cache-fraction", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="6 shards, one epoch, once: seconds, the same code path")
    args = p.parse_args()
    if args.quick:
        args.num_shards, args.num_epochs, args.repeats = 6, 1, 1
    from s3_server import CREDENTIALS, start_s3_server

    os.environ.update(CREDENTIALS)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server, endpoint = start_s3_server(root / "s3.log")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            run = write_synthetic_run(root / "run", num_samples=args.num_shards * PER_SHARD, per_shard=PER_SHARD,
                                      spec=SPEC)  # fmt: skip
            rows = read_manifest(run["shards"])
            total = sum(r.num_bytes for r in rows)
            import boto3

            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
            store = S3Storage("s3://bench/shards", endpoint_url=endpoint)
            t0 = time.perf_counter()
            for path in sorted(q for q in Path(run["shards"]).rglob("*") if q.is_file()):
                store.put_bytes(str(path.relative_to(run["shards"])), path.read_bytes())
            upload_s = time.perf_counter() - t0
            cache_shards = max(2, round(args.cache_fraction * len(rows)))
            cache_bytes = cache_shards * max(r.num_bytes for r in rows)
            window = max(1, cache_shards // 2)
            remote = {"shards_dir": store.url, "shards_endpoint_url": endpoint}
            variants = {
                "local copy": lambda out: make_job(run, out, args.num_epochs, shuffle_window_shards=window),
                "cache 10%": lambda out: make_job(run, out, args.num_epochs, shuffle_window_shards=window,
                                                  cache_bytes=cache_bytes).model_copy(update=remote),
                "cache 10%, uniform shuffle": lambda out: make_job(run, out, args.num_epochs,
                                                                   cache_bytes=cache_bytes).model_copy(update=remote),
            }  # fmt: skip
            time_trainer(make_job(run, root / "warm-up", 1, max_steps=2))  # imports, first allocations
            timings: dict[str, list[dict]] = {name: [] for name in variants}
            for repeat in range(args.repeats):  # interleaved, so drift in the machine's speed hits all alike
                for i, (name, job) in enumerate(variants.items()):
                    timings[name].append(time_trainer(job(root / f"run-{repeat}-{i}")))
            results = {name: sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2] for name, runs in timings.items()}
        finally:
            dist.destroy_process_group()
            server.terminate()
            server.wait(timeout=30)
    base = results["local copy"]["steps_per_s"]
    print(f"shard set: {len(rows)} shards, {total / 2**20:.1f} MiB (uploaded in {upload_s:.1f} s); cache "
          f"{cache_bytes / 2**20:.1f} MiB = {cache_shards} shards ({cache_bytes / total:.0%}); window {window} shards")  # fmt: skip
    print(f"\n{'reader':28s} {'steps':>5s} {'seconds':>8s} {'steps/s':>8s} {'ratio':>6s} {'fetched':>8s} {'MiB':>7s} "
          f"{'waited s':>8s} {'peak MiB':>8s}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:28s} {r['steps']:5d} {r['seconds']:8.2f} {r['steps_per_s']:8.2f} {r['steps_per_s'] / base:6.3f} "
              f"{r['fetched']:8d} {r['fetched_mib']:7.1f} {r['wait_s']:8.2f} {r['peak_cache_mib']:8.2f}")  # fmt: skip
    ratio = results["cache 10%"]["steps_per_s"] / base
    print(f"\ncache_steps_ratio (cache of {cache_bytes / total:.0%} / full local copy, goal >= 0.90): {ratio:.3f}")
    figures = {
        "cache_steps_ratio": round(ratio, 4),
        "uniform_cache_steps_ratio": round(results["cache 10%, uniform shuffle"]["steps_per_s"] / base, 4),
        "num_shards": len(rows),
        "shard_set_mib": round(total / 2**20, 1),
        "cache_bytes": cache_bytes,
        "cache_fraction": round(cache_bytes / total, 4),
        "window_shards": window,
        "repeats": args.repeats,
        "seconds_each": {name: [r["seconds"] for r in runs] for name, runs in timings.items()},
        "runs": results,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
