"""Acceptance of each draft variant (draft.variant): the same data, shards and seeds, one variant at a time.

Usage: .venv/bin/python bench/draft_variants.py [--num-epochs 6] [--seeds 0 1 2] [--num-prompts 48]
       [--num-long-prompts 12] [--stacks eagle3:2] [--jobs 2]

On the tiny target (the demo preset, deployments/tiny-cpu.json): the dataset, the vocab mapping and the shards
are built once (the demo's encoding), then the draft of every variant is trained with every seed (one process
per training, `--jobs` at once), and so is each `--stacks` entry VARIANT:N (that variant with draft.num_layers N,
row `VARIANT-Nlayers`), exported for SGLang 0.5.23 (the release that serves every variant) and measured
by the reference engine (steps 3, chain): `tau` on the held-out prompts (64 new tokens, as the demo's benchmark
stage), and `tau_long` on the first --num-long-prompts of them continued past end-of-sequence to the tiny
target's longest position (512): the long-context drift EAGLE 3.1's norms are for. Printed: mean and spread
(population sd over the seeds) of both. The last line is one JSON object with `tau_by_variant`,
`tau_long_by_variant` (means), `best_variant` (highest mean tau) and `beats_demo` (whether it is above the demo
preset's draft, its variant with one layer, by more than the larger of the two spreads). Takes 30-50 minutes on 2
cores. Work goes to --workdir (default runs/draft-variants). `--quick`: seconds, the same code path (eagle3 and the
demo's variant, one seed, 4 training steps, 2 prompts and one long one to position 96; a temporary workdir), for
the test suite.
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

from eyas.config import DRAFT_VARIANTS, TrainJob  # noqa: E402

SERVED_BY = "0.5.23"  # an SGLang release that runs every variant (eyas.export.serving)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=str(REPO / "deployments" / "tiny-cpu.json"))
    p.add_argument("--workdir", default=None, help="default runs/draft-variants (kept); with --quick a temporary one")
    p.add_argument("--variants", nargs="+", default=list(DRAFT_VARIANTS), choices=list(DRAFT_VARIANTS))
    p.add_argument("--num-epochs", type=int, default=6)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-long-prompts", type=int, default=12)
    p.add_argument("--stacks", nargs="*", default=["eagle3:2"], help="VARIANT:NUM_LAYERS rows")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--long-position", type=int, default=0, help="tau_long continues to here; 0 = the target's longest")
    p.add_argument("--quick", action="store_true", help="seconds, the same code path (see above)")
    args = p.parse_args()
    for stack in args.stacks:
        variant, _, layers = stack.partition(":")
        if variant not in DRAFT_VARIANTS or not layers.isdigit() or int(layers) < 2:
            p.error(f"--stacks {stack}: expected VARIANT:N with VARIANT in {list(DRAFT_VARIANTS)} and N >= 2")
    return args


def main() -> int:
    args = parse_args()
    workdir = args.workdir or (
        tempfile.mkdtemp(prefix="eyas-bench-variants-") if args.quick else str(REPO / "runs" / "draft-variants")
    )
    try:
        return measure_variants(args, workdir)
    finally:
        if args.quick and not args.workdir:
            shutil.rmtree(workdir)


def measure_variants(args: argparse.Namespace, workdir: str) -> int:
    base = demo_config(args.preset, workdir, sglang_version=SERVED_BY)
    args.demo = (
        base.draft.variant if base.draft.num_layers == 1 else f"{base.draft.variant}-{base.draft.num_layers}layers"
    )
    if args.quick:
        base = quick_config(base)
        args.variants, args.stacks, args.seeds = list(dict.fromkeys(["eagle3", base.draft.variant])), [], [0]
        args.num_prompts, args.num_long_prompts, args.long_position = base.bench.num_prompts, 1, 96
    rows_of = {v: (v, 1) for v in args.variants}
    for stack in args.stacks:
        variant, _, layers = stack.partition(":")
        rows_of[f"{variant}-{layers}layers"] = (variant, int(layers))
    t0 = time.perf_counter()
    prepare(base)
    shards = Path(workdir) / "shards"
    extract_variant(base, shards)
    aux_ids = extracted_aux_ids(shards)
    futures = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for row, (variant, num_layers) in rows_of.items():
            for seed in args.seeds:
                train = base.train.model_copy(update={"num_processes": 1, "seed": seed, "num_epochs": args.num_epochs})
                out = Path(workdir) / "train" / f"{row}-seed{seed}"
                draft = base.draft.model_copy(update={"variant": variant, "num_layers": num_layers})
                job = TrainJob(target_path=base.target.model_path, shards_dir=str(shards),
                               vocab_path=str(base.paths.vocab), output_dir=str(out), aux_layer_ids=aux_ids,
                               draft=draft, train=train)  # fmt: skip
                futures[(row, seed)] = pool.submit(
                    train_and_measure, job.model_dump_json(), str(out / "export"), base.bench.prompts_path,
                    args.num_prompts, sglang_version=SERVED_BY, num_long_prompts=args.num_long_prompts,
                    long_position=args.long_position,
                )  # fmt: skip
        rows: dict[str, dict[str, list[float]]] = {row: {"tau": [], "tau_long": []} for row in rows_of}
        for (variant, seed), fut in futures.items():
            r = fut.result()
            rows[variant]["tau"].append(r["tau"])
            rows[variant]["tau_long"].append(r["tau_long"])
            print(f"  {variant} seed {seed}: tau {r['tau']:.3f}, tau_long {r['tau_long']:.3f} "
                  f"(train {r['train_s']:.0f} s, bench {r['bench_s']:.0f} s)", flush=True)  # fmt: skip
    return report(rows, args, time.perf_counter() - t0)


def report(rows: dict, args, wall_s: float) -> int:
    stats = {
        v: {k: (statistics.mean(xs), statistics.pstdev(xs)) for k, xs in r.items()} for v, r in rows.items()
    }  # fmt: skip
    print(f"\n{'variant':22s} {'tau mean':>8s} {'sd':>6s} {'tau_long mean':>13s} {'sd':>6s}")
    for v, s in stats.items():
        print(f"{v:22s} {s['tau'][0]:8.3f} {s['tau'][1]:6.3f} {s['tau_long'][0]:13.3f} {s['tau_long'][1]:6.3f}")
    best = max(stats, key=lambda v: stats[v]["tau"][0])
    demo = stats.get(args.demo)
    margin = None if demo is None else stats[best]["tau"][0] - demo["tau"][0]
    beats = demo is not None and best != args.demo and margin > max(stats[best]["tau"][1], demo["tau"][1])
    print(f"\nbest mean tau: {best}" + ("" if margin is None else f", {margin:+.3f} over the demo's {args.demo}")
          + (" (more than the spread: the demo should use it)" if beats else " (within the spread)"))  # fmt: skip
    figures = {
        "tau_by_variant": {v: round(s["tau"][0], 4) for v, s in stats.items()},
        "tau_sd_by_variant": {v: round(s["tau"][1], 4) for v, s in stats.items()},
        "tau_long_by_variant": {v: round(s["tau_long"][0], 4) for v, s in stats.items()},
        "tau_long_sd_by_variant": {v: round(s["tau_long"][1], 4) for v, s in stats.items()},
        "taus": {v: [round(t, 4) for t in r["tau"]] for v, r in rows.items()},
        "taus_long": {v: [round(t, 4) for t in r["tau_long"]] for v, r in rows.items()},
        "best_variant": best,
        "demo_variant": args.demo,
        "beats_demo": beats,
        "num_epochs": args.num_epochs,
        "seeds": args.seeds,
        "num_prompts": args.num_prompts,
        "num_long_prompts": args.num_long_prompts,
        "wall_s": round(wall_s, 1),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
