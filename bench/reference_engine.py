"""Reference engine on the tiny target: tau of the eyas draft vs the n-gram drafter, wall time vs greedy with and
without the draft's KV cache, the torch thread count the benchmark runs fastest with, and the benchmark on a busy
machine.

    .venv/bin/python bench/reference_engine.py [--export runs/demo/export/sglang] [--num-prompts 48]

Needs an exported draft (`make demo` writes runs/demo/export/sglang). Every side runs the float64 target with a KV
cache, prompts one after another on this machine; speculative decoding includes the draft's own time. Three parts:
- threads: after a warm-up run, the whole benchmark (eyas.bench.acceptance.run_benchmark: greedy, trained,
  random and n-gram drafters) on the first --sweep-prompts prompts at each --threads count, best of --repeats;
- the full run on --num-prompts prompts at BENCH_NUM_THREADS, the trained draft also without its cache, side by
  side per prompt;
- busy: the --sweep-prompts run again while --busy-processes CPU-bound Python loops run (spawned here and killed
  after), at BENCH_NUM_THREADS and at torch's default count; the ratio is busy over idle (the sweep's best) at
  the same count.
Prints tables (with the load average before each measurement), then (last line) one JSON object with the figures.
`--quick` (for the test suite): 2 prompts of 8 new tokens, one thread (torch's default count set to 1), one repeat,
one busy process; without an --export, an untrained draft for the target (its embedding, the first 1,024 token ids
as the draft vocab) is written by the checkpoint writer and exported for SGLang, as training would, into a
temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from eyas.bench.acceptance import BENCH_NUM_THREADS, run_benchmark  # noqa: E402
from eyas.dataset.prompts import read_prompts  # noqa: E402


@contextmanager
def busy_processes(count: int):
    """`count` Python processes spinning on a CPU each, killed (by their pid) on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(1.0)  # let them get scheduled before the measurement starts
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def untrained_export(target: str, out: Path) -> Path:
    """A draft for `target` as training starts it (random layer, the target's embedding), exported for SGLang."""
    from eyas.draft import DraftArch, build_draft
    from eyas.export.configs import TargetRef
    from eyas.export.convert import export_checkpoint
    from eyas.layer_ids import default_aux_layer_ids
    from eyas.target import load_embed_and_lm_head, read_target_config, target_fingerprint
    from eyas.train.checkpoint import write_checkpoint

    embed, _ = load_embed_and_lm_head(target)
    vocab, hidden = embed.shape
    draft_vocab = min(1024, vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    arch = DraftArch(hidden_size=hidden, num_aux=3, target_vocab_size=vocab, draft_vocab_size=draft_vocab,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden)  # fmt: skip
    draft = build_draft(arch, embed.float(), torch.zeros(draft_vocab, dtype=torch.int64), t2d, seed=0)
    checkpoint = write_checkpoint(
        out / "train", 1, model_state={k: v.contiguous() for k, v in draft.state_dict().items()}, optimizer_state={},
        scheduler_state={}, arch=arch, trainer_state={}, target_fingerprint=target_fingerprint(target), keep_last=1,
        aux_layer_ids=default_aux_layer_ids(read_target_config(target)["num_hidden_layers"]),
    )  # fmt: skip
    return export_checkpoint(checkpoint, out / "export", to="sglang", target=TargetRef.read(target))


def load() -> float:
    return os.getloadavg()[0]


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
    p.add_argument("--threads", default="1,2,4", help="torch thread counts of the sweep, comma-separated")
    p.add_argument("--sweep-prompts", type=int, default=8, help="prompts of the thread sweep and the busy runs")
    p.add_argument("--repeats", type=int, default=2, help="runs per thread count (the best one counts)")
    p.add_argument("--busy-processes", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny sizes, an untrained draft when --export has none")
    args = p.parse_args()
    scratch = None
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.threads, args.sweep_prompts = 2, 8, "1", 1
        args.repeats, args.busy_processes = 1, 1
        torch.set_num_threads(1)  # torch's default count is then 1 too: one busy run, not one per count
        if not (Path(args.export) / "config.json").is_file():
            scratch = Path(tempfile.mkdtemp(prefix="eyas-bench-reference-"))
            args.export = str(untrained_export(args.target, scratch))
    try:
        return measure(args)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch)


def measure(args: argparse.Namespace) -> int:
    if not (Path(args.export) / "config.json").is_file():
        print(
            f"no exported draft at {args.export}: run `make demo` first or pass --export (or --quick)", file=sys.stderr
        )
        return 2
    prompts = [r["conversations"] for r in read_prompts(args.prompts, args.num_prompts)]
    shape = dict(
        steps=args.steps, max_new_tokens=args.max_new_tokens, topk=args.topk, num_draft_tokens=args.num_draft_tokens
    )
    default_threads = torch.get_num_threads()

    def bench(num_prompts: int, num_threads: int, **extra) -> dict:
        return run_benchmark(args.target, args.export, prompts[:num_prompts], num_threads=num_threads, **shape, **extra)

    bench(1, BENCH_NUM_THREADS)  # warm-up: the first run pays for imports, lazy initialisation and cold caches
    sweep: dict[int, dict] = {}
    print(
        f"threads ({args.sweep_prompts} prompts, whole benchmark, best of {args.repeats}; torch default "
        f"{default_threads}):"
    )
    print(f"{'threads':>8}{'load':>7}{'wall s':>9}{'greedy s':>10}{'eyas s':>9}")
    for _ in range(args.repeats):  # interleaved, so that a change of load hits every count alike
        for n in [int(t) for t in args.threads.split(",")]:
            before, r = load(), bench(args.sweep_prompts, n)
            print(f"{n:>8}{before:>7.2f}{r['wall_s']:>9.1f}{r['wall_s_greedy']:>10.1f}{r['wall_s_speculative']:>9.1f}")
            if n not in sweep or r["wall_s"] < sweep[n]["wall_s"]:
                sweep[n] = r
    fastest = min(sweep, key=lambda n: sweep[n]["wall_s"])
    print(f"fastest: {fastest} thread(s), {sweep[fastest]['wall_s']:.1f} s")

    before, r = load(), bench(args.num_prompts, BENCH_NUM_THREADS, compare_uncached_draft=True)
    print(f"\n{r['num_prompts']} prompts, {BENCH_NUM_THREADS} thread(s), load {before:.2f}:")
    print(f"{'drafter':<22}{'tau':>8}{'wall s':>10}{'vs greedy':>11}")
    print(f"{'greedy':<22}{1.0:>8.2f}{r['wall_s_greedy']:>10.1f}{1.0:>11.2f}")
    print(f"{'n-gram':<22}{r['tau_ngram']:>8.2f}{r['wall_s_ngram']:>10.1f}{r['speedup_ngram_vs_greedy']:>11.2f}")
    print(
        f"{'eyas draft, cached':<22}{r['tau_mean']:>8.2f}{r['wall_s_speculative']:>10.1f}{r['speedup_vs_greedy']:>11.2f}"
    )
    print(
        f"{'eyas draft, uncached':<22}{r['tau_mean_uncached']:>8.2f}{r['wall_s_speculative_uncached']:>10.1f}"
        f"{r['speedup_vs_greedy_uncached']:>11.2f}"
    )
    print(f"{'random draft':<22}{r['tau_random']:>8.2f}")

    busy = {}
    print(f"\nbusy: {args.sweep_prompts} prompts with {args.busy_processes} CPU-bound processes running:")
    print(f"{'threads':>8}{'load':>7}{'idle s':>9}{'busy s':>9}{'ratio':>8}")
    for n in dict.fromkeys([BENCH_NUM_THREADS, default_threads]):
        idle = sweep[n]["wall_s"] if n in sweep else bench(args.sweep_prompts, n)["wall_s"]
        with busy_processes(args.busy_processes):
            before, wall = load(), bench(args.sweep_prompts, n)["wall_s"]
        busy[n] = {"idle": idle, "busy": wall, "ratio": wall / idle}
        print(f"{n:>8}{before:>7.2f}{idle:>9.1f}{wall:>9.1f}{wall / idle:>8.2f}")

    figures = {
        "tau_mean": r["tau_mean"],
        "tau_mean_uncached": r["tau_mean_uncached"],
        "tau_ngram": r["tau_ngram"],
        "tau_random": r["tau_random"],
        "tau_ratio_vs_ngram": r["tau_ratio_vs_ngram"],
        "speedup_vs_greedy": r["speedup_vs_greedy"],
        "speedup_vs_greedy_uncached": r["speedup_vs_greedy_uncached"],
        "speedup_ngram_vs_greedy": r["speedup_ngram_vs_greedy"],
        "wall_s_greedy": r["wall_s_greedy"],
        "wall_s_speculative": r["wall_s_speculative"],
        "wall_s_speculative_uncached": r["wall_s_speculative_uncached"],
        "wall_s_ngram": r["wall_s_ngram"],
        "wall_s": r["wall_s"],
        "num_threads": r["num_threads"],
        "default_num_threads": default_threads,
        "fastest_num_threads": fastest,
        "wall_s_by_num_threads": {str(n): s["wall_s"] for n, s in sweep.items()},
        "sweep_prompts": args.sweep_prompts,
        "busy_processes": args.busy_processes,
        "wall_s_idle": busy[BENCH_NUM_THREADS]["idle"],
        "wall_s_busy": busy[BENCH_NUM_THREADS]["busy"],
        "busy_ratio": busy[BENCH_NUM_THREADS]["ratio"],
        "busy_ratio_by_num_threads": {str(n): b["ratio"] for n, b in busy.items()},
        "wall_s_busy_by_num_threads": {str(n): b["busy"] for n, b in busy.items()},
        "num_prompts": r["num_prompts"],
        "max_new_tokens": r["max_new_tokens"],
        "steps": r["steps"],
        "topk": r["topk"],
        "num_draft_tokens": r["num_draft_tokens"],
        "lossless": r["lossless"],
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
