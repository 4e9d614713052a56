"""Reference engine on the tiny target: tau of the eyas draft vs the n-gram drafter, wall time vs greedy.

    .venv/bin/python bench/reference_engine.py [--export runs/demo/export/sglang] [--num-prompts 48]

Needs an exported draft (`make demo` writes runs/demo/export/sglang). Every side runs the float64
target with a KV cache, prompts one after another on this machine; speculative decoding includes
the draft's own time. Prints a table, then (last line) one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eyas.bench.acceptance import run_benchmark  # noqa: E402
from eyas.dataset.prompts import read_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(REPO / "fixtures" / "tiny-target"))
    p.add_argument("--export", default=str(REPO / "runs" / "demo" / "export" / "sglang"))
    p.add_argument("--prompts", default=str(REPO / "fixtures" / "tiny-target" / "heldout_prompts.jsonl"))
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--num-draft-tokens", type=int, default=0)
    args = p.parse_args()
    if not (Path(args.export) / "config.json").is_file():
        print(f"no exported draft at {args.export}: run `make demo` first or pass --export", file=sys.stderr)
        return 2
    prompts = [r["conversations"] for r in read_prompts(args.prompts, args.num_prompts)]
    r = run_benchmark(
        args.target,
        args.export,
        prompts,
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
    )
    figures = {
        "tau_eyas": r["tau_mean"],
        "tau_ngram": r["tau_ngram"],
        "tau_random": r["tau_random"],
        "tau_ratio_vs_ngram": r["tau_ratio_vs_ngram"],
        "wall_s_greedy": r["wall_s_greedy"],
        "wall_s_speculative": r["wall_s_speculative"],
        "wall_s_ngram": r["wall_s_ngram"],
        "speedup_vs_greedy": r["speedup_vs_greedy"],
        "speedup_ngram_vs_greedy": r["speedup_ngram_vs_greedy"],
        "num_prompts": r["num_prompts"],
        "max_new_tokens": r["max_new_tokens"],
        "steps": r["steps"],
        "topk": r["topk"],
        "num_draft_tokens": r["num_draft_tokens"],
        "lossless": r["lossless"],
    }
    print(f"{'drafter':<14}{'tau':>8}{'wall s':>10}{'vs greedy':>11}")
    print(f"{'greedy':<14}{1.0:>8.2f}{r['wall_s_greedy']:>10.1f}{1.0:>11.2f}")
    print(f"{'n-gram':<14}{r['tau_ngram']:>8.2f}{r['wall_s_ngram']:>10.1f}{r['speedup_ngram_vs_greedy']:>11.2f}")
    print(f"{'eyas draft':<14}{r['tau_mean']:>8.2f}{r['wall_s_speculative']:>10.1f}{r['speedup_vs_greedy']:>11.2f}")
    print(f"{'random draft':<14}{r['tau_random']:>8.2f}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
