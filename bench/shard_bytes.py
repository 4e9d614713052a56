"""Bytes per token against acceptance: the same data and seeds trained from shards in each encoding.

Usage: .venv/bin/python bench/shard_bytes.py [--num-epochs 6] [--seeds 0 1 2] [--num-prompts 48] [--jobs 2]

On the tiny target (the demo preset, deployments/tiny-cpu.json): the dataset and the vocab mapping are built
once, then the shards are extracted in each encoding (eyas.shards.encoding), and the draft is trained from
each with every seed (one process per training, `--jobs` at once), exported, and measured by the reference
engine (steps 3, chain) on the held-out prompts. Printed: tau (mean and spread over the seeds) and bytes
per token of each variant, measured here (H 128) and computed for Kimi-K2.5 (H 7168, 3 aux layers).
The last line is one JSON object: `bytes_ratio_best` is the bytes per token of the smallest variant whose
mean tau is no more than 2% below bfloat16/last_hidden's, over bfloat16/last_hidden's (at H 7168, and at the tiny
target's H as `bytes_ratio_best_measured_h`); `tau_delta_best` is that variant's relative tau difference.
Takes 30-60 minutes on 2 cores. Work goes to --workdir (default runs/shard-bytes), kept. `--quick`: seconds, the
same code path (bfloat16/last_hidden and float8_e4m3/topk 32, one seed, the demo preset cut as bench/measure.py's
quick_config says; a temporary workdir), for the test suite.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from measure import (  # noqa: E402
    demo_config,
    extract_variant,
    extracted_aux_ids,
    prepare,
    quick_config,
    train_and_measure,
)

from eyas.config import RunConfig, TrainJob  # noqa: E402
from eyas.shards.encoding import ShardEncoding, extract_encoding  # noqa: E402

# (aux_dtype, teacher, teacher_topk, dtype); the first is today's demo, the second the baseline
VARIANTS = [
    ("float32", "last_hidden", 0, "float32"),
    ("bfloat16", "last_hidden", 0, "bfloat16"),
    ("float8_e4m3", "last_hidden", 0, "bfloat16"),
    ("bfloat16", "topk", 8, "float16"),
    ("bfloat16", "topk", 32, "float16"),
    ("float8_e4m3", "topk", 32, "float16"),
]
BASELINE = "bfloat16/last_hidden"
KIMI = {"hidden_size": 7168, "num_aux": 3}


def variant_config(base: RunConfig, variant: tuple) -> RunConfig:
    aux_dtype, teacher, k, dtype = variant
    extract = base.extract.model_copy(
        update={"aux_dtype": aux_dtype, "teacher": teacher, "teacher_topk": k or 32, "dtype": dtype}
    )
    return base.model_copy(update={"extract": extract})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=str(REPO / "deployments" / "tiny-cpu.json"))
    p.add_argument("--workdir", default=None, help="default runs/shard-bytes (kept); with --quick a temporary one")
    p.add_argument("--num-epochs", type=int, default=6)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="seconds, the same code path (see above)")
    args = p.parse_args()
    workdir = args.workdir or (
        tempfile.mkdtemp(prefix="eyas-bench-shard-bytes-") if args.quick else str(REPO / "runs" / "shard-bytes")
    )
    try:
        return measure_variants(args, Path(workdir))
    finally:
        if args.quick and not args.workdir:
            shutil.rmtree(workdir)


def measure_variants(args: argparse.Namespace, workdir: Path) -> int:
    base = demo_config(args.preset, str(workdir))
    variants = VARIANTS
    if args.quick:
        base = quick_config(base)
        variants, args.seeds, args.num_prompts = [VARIANTS[1], VARIANTS[-1]], [0], base.bench.num_prompts
    t0 = time.perf_counter()
    prepare(base)
    from eyas.dataset.table import TokenizedDataset

    num_tokens = int(sum(TokenizedDataset(base.paths.tokenized).num_tokens))
    measured_h = json.loads((Path(base.target.model_path) / "config.json").read_text())["hidden_size"]
    rows, futures = {}, {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for variant in variants:
            config = variant_config(base, variant)
            enc = extract_encoding(config.extract)
            label = enc.label()
            shards = workdir / "shards" / label.replace("/", "-")
            nbytes = extract_variant(config, shards)
            rows[label] = {"encoding": enc, "shard_bytes": nbytes, "taus": []}
            for seed in args.seeds:
                train = base.train.model_copy(update={"num_processes": 1, "seed": seed, "num_epochs": args.num_epochs})
                out = workdir / "train" / f"{label.replace('/', '-')}-seed{seed}"
                job = TrainJob(target_path=base.target.model_path, shards_dir=str(shards),
                               vocab_path=str(base.paths.vocab), output_dir=str(out), aux_layer_ids=extracted_aux_ids(shards),
                               draft=base.draft, train=train)  # fmt: skip
                futures[(label, seed)] = pool.submit(train_and_measure, job.model_dump_json(), str(out / "export"),
                                                     base.bench.prompts_path, args.num_prompts,
                                                     sglang_version=base.export.sglang_version)  # fmt: skip
            print(f"extracted {label}: {nbytes:,} bytes; training {len(args.seeds)} seeds", flush=True)
        for (label, seed), fut in futures.items():
            r = fut.result()
            rows[label]["taus"].append(r["tau"])
            print(f"  {label} seed {seed}: tau {r['tau']:.3f} (train {r['train_s']:.0f} s, bench {r['bench_s']:.0f} s)",
                  flush=True)  # fmt: skip
    return report(rows, num_tokens, measured_h, args, time.perf_counter() - t0)


def report(rows: dict, num_tokens: int, measured_h: int, args, wall_s: float) -> int:
    base = rows[BASELINE]
    base_tau = statistics.mean(base["taus"])
    tiny = {"hidden_size": measured_h, "num_aux": 3}
    print(f"\n{'encoding':26s} {'tau mean':>8s} {'spread':>7s} {'vs bf16':>8s} {'B/token':>8s} {'ratio':>6s} "
          f"{'B/token H7168':>13s} {'ratio':>6s}")  # fmt: skip
    table = []
    for label, row in rows.items():
        enc: ShardEncoding = row["encoding"]
        mean, spread = statistics.mean(row["taus"]), statistics.pstdev(row["taus"])
        measured = row["shard_bytes"] / num_tokens
        kimi = enc.bytes_per_token(**KIMI)
        entry = {
            "encoding": label,
            "tau_mean": round(mean, 4),
            "tau_std": round(spread, 4),
            "taus": [round(t, 4) for t in row["taus"]],
            "tau_delta": round(mean / base_tau - 1, 4),
            "bytes_per_token_measured": round(measured, 1),
            "bytes_per_token_formula": enc.bytes_per_token(**tiny),
            "bytes_ratio_measured_h": round(enc.bytes_per_token(**tiny) / rows[BASELINE]["encoding"].bytes_per_token(**tiny), 4),
            "bytes_per_token_h7168": kimi,
            "bytes_ratio": round(kimi / base["encoding"].bytes_per_token(**KIMI), 4),
        }  # fmt: skip
        table.append(entry)
        print(f"{label:26s} {mean:8.3f} {spread:7.3f} {entry['tau_delta']:+8.1%} {measured:8.0f} "
              f"{entry['bytes_ratio_measured_h']:6.3f} {kimi:13,d} {entry['bytes_ratio']:6.3f}")  # fmt: skip
    within = [e for e in table if e["tau_delta"] >= -0.02]
    best = min(within, key=lambda e: e["bytes_ratio"])
    print(f"\nsmallest no more than 2% below {BASELINE}'s tau: {best['encoding']} ({best['bytes_ratio']:.3f} of its bytes at "
          f"H 7168, tau {best['tau_delta']:+.1%}); goal bytes_ratio_best <= 0.40")  # fmt: skip
    figures = {
        "bytes_ratio_best": best["bytes_ratio"],
        "tau_delta_best": best["tau_delta"],
        "best": best["encoding"],
        "bytes_ratio_best_measured_h": best["bytes_ratio_measured_h"],
        "baseline": BASELINE,
        "tau_baseline": round(base_tau, 4),
        "measured_hidden_size": measured_h,
        "num_epochs": args.num_epochs,
        "seeds": args.seeds,
        "num_prompts": args.num_prompts,
        "wall_s": round(wall_s, 1),
        "variants": table,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
