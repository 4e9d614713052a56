"""The acceptance benchmark: the stage entry, and the reference engine's run of the trained draft, a random
draft, the n-gram drafter and plain greedy decoding on the same prompts.

    result = bench_run(config, "run/export/sglang")            # the configured engine; writes benchmark.json
    result = run_benchmark("target/", "run/export/sglang", prompts, steps=3, max_new_tokens=64)

The draft is loaded from the exported SGLang files (`load_exported_draft`), so the benchmark
measures what the engine will load. Every speculative output is compared token for token with
plain greedy decoding (`LosslessError` otherwise). The decoding loop is eyas.bench.reference, the
drafters eyas.bench.proposers; the fields of benchmark.json are BENCHMARK_FIELDS. The SGLang engine
is eyas.bench.sglang.

Wall times compare like with like: the float64 target with a KV cache on the same CPU/GPU, one
token per forward for greedy decoding, the pending token + drafts per forward for speculative
decoding (the draft's own time included, its keys and values cached across rounds); batch size 1.
Each prompt runs greedy, then every drafter, before the next prompt, so a change of machine load
hits all sides alike. The run uses BENCH_NUM_THREADS torch threads (restored afterwards): its ops
are tiny, so more threads only add synchronisation, and on a busy machine threads that spin-wait
for each other multiply the wall time (bench/reference_engine.py measures both).

`progress`, when given, is called with {"pass", "prompts_done", "prompts_total", "eta_s"} before the first
prompt and after each one; "pass" names what runs on every prompt (greedy and each drafter).
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from eyas.bench.proposers import NgramProposer
from eyas.bench.reference import (
    DecodeResult,
    accept_rates,
    check_lossless,
    greedy_decode,
    load_target_float64,
    pooled_tau,
    reference_decode,
)
from eyas.bench.sglang import bench_launch, run_sglang_benchmark
from eyas.config import RunConfig
from eyas.dataset.prompts import prompt_token_ids, read_prompts
from eyas.draft import build_draft
from eyas.export.drafter_dir import read_export_provenance
from eyas.export.reader import load_exported_draft
from eyas.facts import shard_source
from eyas.fsio import atomic_write_text, read_json_record
from eyas.shards.shard_set import RUN_META_NAME, read_run_meta
from eyas.target import check_remote_code, embed_weight, target_fingerprint

# torch intra-op threads of the reference benchmark (batch 1, a token or a few per forward): 1 ran fastest on
# the tiny target idle, and stays within a small factor of idle when the CPUs are busy (bench/reference_engine.py)
BENCH_NUM_THREADS = 1
BENCHMARK_FILE = "benchmark.json"
PLOTS_FILE = "acceptance.png"
UNCACHED = "uncached trained"  # the drafter label of the trained draft without its cache
Prompt = list[int] | str | list[dict]  # token ids, raw text, or a conversation [{role, content}, ...]

# benchmark.json of the reference engine: field -> meaning (README "benchmark.json" documents it too).
BENCHMARK_FIELDS = {
    "engine": '"reference"',
    "tau_mean": "trained draft: emitted tokens / verification rounds over all prompts (bonus token included)",
    "tau_per_prompt": "trained draft: tau of each prompt (null when no round ran)",
    "accept_rate_per_position": "trained draft: fraction of rounds accepting draft position i (depth i for a tree)",
    "num_verify_steps": "trained draft: verification rounds over all prompts",
    "tau_random": "a random draft of the same shape (expected about 1.0)",
    "accept_rate_per_position_random": "the random draft's acceptance per position",
    "tau_ngram": "the n-gram (prompt lookup) drafter, chain of `steps`",
    "accept_rate_per_position_ngram": "the n-gram drafter's acceptance per position",
    "tau_ratio_vs_ngram": "tau_mean / tau_ngram",
    "speedup_vs_greedy": "wall_s_greedy / wall_s_speculative (same target, dtype, KV cache, device)",
    "speedup_ngram_vs_greedy": "wall_s_greedy / wall_s_ngram",
    "wall_s_greedy": "plain greedy decoding of every prompt (float64 target, KV cache, one token per forward)",
    "wall_s_speculative": "speculative decoding of every prompt with the trained draft (draft time included)",
    "wall_s_ngram": "speculative decoding of every prompt with the n-gram drafter",
    "wall_s_speculative_uncached": "the trained draft recomputed over the whole sequence every round (no draft "
    "cache), side by side with the others; null unless run_benchmark(compare_uncached_draft=True)",
    "speedup_vs_greedy_uncached": "wall_s_greedy / wall_s_speculative_uncached; null unless compared",
    "tau_mean_uncached": "tau of the uncached trained draft (equals tau_mean: both draft the same tokens); null "
    "unless compared",
    "num_threads": "torch intra-op threads the benchmark ran with (null: torch's setting left as it was)",
    "steps": "chain length / tree depth k",
    "topk": "1 = chain; > 1 = tree",
    "num_draft_tokens": "tree size as SGLang counts it (root included); steps + 1 for a chain",
    "num_prompts": "prompts benchmarked",
    "max_new_tokens": "new tokens per prompt at most",
    "aux_layer_ids": "canonical (HF hidden_states) aux layer ids the draft was loaded with",
    "lossless": "true: every speculative output equalled greedy decoding (otherwise the run fails)",
    "wall_s": "the whole benchmark",
}


def encode_prompts(
    prompts: Sequence[Prompt], target_path: str | Path, *, trust_remote_code: bool = False
) -> list[list[int]]:
    """Token-id lists as they are; texts through the target's tokenizer; conversations
    ([{role, content}, ...]) through its chat template exactly as the dataset stage encodes them."""
    tokenizer = None
    encoded = []
    for i, prompt in enumerate(prompts):
        is_conversation = bool(prompt) and not isinstance(prompt, str) and isinstance(prompt[0], dict)
        if isinstance(prompt, str) or is_conversation:
            if tokenizer is None:
                from transformers import AutoTokenizer

                check_remote_code(target_path, trust_remote_code)
                tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
            if is_conversation:
                prompt = prompt_token_ids(tokenizer, list(prompt))
            else:
                prompt = tokenizer(prompt)["input_ids"]
        if not prompt:
            raise ValueError(f"prompt {i}: empty after encoding; expected at least one token")
        encoded.append([int(t) for t in prompt])
    return encoded


def _check_provenance(export_dir: str | Path, target_path: str | Path) -> None:
    provenance = read_export_provenance(export_dir)
    if provenance is None or not provenance.get("target_fingerprint"):
        return
    actual = target_fingerprint(target_path)
    if provenance["target_fingerprint"] != actual:
        raise ValueError(
            f"export {export_dir}: trained for target fingerprint {provenance['target_fingerprint']}, "
            f"but target {target_path} has {actual}; benchmark the draft against the target it was trained on"
        )


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


@contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch.set_num_threads(num_threads) inside, the previous count restored after; None changes nothing."""
    if num_threads is None:
        yield
        return
    if num_threads < 1:
        raise ValueError(f"benchmark: num_threads={num_threads}, expected >= 1 (or None for torch's setting)")
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _decode_all(model, drafters: dict, prompts, *, max_new_tokens, eos, progress=None, **decode):
    """Per prompt, greedy decoding then each drafter, timed side by side (so load drift hits all alike);
    every speculative output is checked against the greedy one. ({label: results}, {label: wall s})."""
    results: dict[str, list[DecodeResult]] = {label: [] for label in drafters}
    walls = dict.fromkeys(["greedy", *drafters], 0.0)
    name, start = ", ".join(walls), time.perf_counter()
    report = progress or (lambda info: None)
    report({"pass": name, "prompts_done": 0, "prompts_total": len(prompts), "eta_s": None})
    for i, ids in enumerate(prompts):
        greedy, dt = _timed(greedy_decode, model, ids, max_new_tokens, eos)
        walls["greedy"] += dt
        for label, (proposer, extra) in drafters.items():
            r, dt = _timed(
                reference_decode,
                model,
                proposer,
                ids,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                **decode,
                **extra,
            )
            walls[label] += dt
            check_lossless(r.tokens, greedy, prompt=f"prompt {i} ({label} draft)")
            results[label].append(r)
        elapsed = time.perf_counter() - start
        eta_s = elapsed / (i + 1) * (len(prompts) - i - 1)
        report({"pass": name, "prompts_done": i + 1, "prompts_total": len(prompts), "eta_s": eta_s})
    return results, walls


def run_benchmark(
    target_path: str | Path,
    export_dir: str | Path,
    prompts: Sequence[Prompt],
    *,
    steps: int,
    max_new_tokens: int,
    topk: int = 1,
    num_draft_tokens: int = 0,
    ngram_max_n: int = 3,
    random_draft_seed: int = 0,
    device: str = "cpu",
    num_threads: int | None = BENCH_NUM_THREADS,
    compare_uncached_draft: bool = False,
    progress: Callable[[dict], None] | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """tau and per-position acceptance of the exported draft, a random draft and the n-gram drafter, and
    the trained draft's wall time against plain greedy decoding; the fields are BENCHMARK_FIELDS.
    `device` "cuda" runs the same exact loop on a GPU (float64 there too). `num_threads`: torch threads for the
    run (None: as set). `compare_uncached_draft` also runs the trained draft without its cache, side by side.
    `progress`: called with a dict per prompt (module docstring). `trust_remote_code`: the run's
    target.trust_remote_code (the tokenizer's code, or a model transformers does not ship)."""
    start = time.perf_counter()
    if not prompts:
        raise ValueError("benchmark: no prompts; expected at least one held-out prompt")
    num_draft_tokens = num_draft_tokens or (steps + 1 if topk == 1 else 0)
    if topk == 1 and num_draft_tokens != steps + 1:
        raise ValueError(
            f"benchmark: topk=1 (chain) with num_draft_tokens={num_draft_tokens}, expected steps + 1 = {steps + 1} "
            "(or 0 for the default)"
        )
    _check_provenance(export_dir, target_path)
    with torch_threads(num_threads):
        model = load_target_float64(target_path, trust_remote_code=trust_remote_code)
        draft = load_exported_draft(export_dir, embed_weight(model))
        random_draft = build_draft(draft.arch, draft.embed_tokens.weight, draft.d2t, draft.t2d, seed=random_draft_seed)
        model, draft, random_draft = model.to(device), draft.to(device), random_draft.to(device)
        encoded = encode_prompts(prompts, target_path, trust_remote_code=trust_remote_code)
        tree = dict(topk=topk, num_draft_tokens=num_draft_tokens)
        drafters = {
            "trained": (draft, tree),
            "random": (random_draft.eval(), tree),
            "n-gram": (NgramProposer(ngram_max_n), {}),
        }
        if compare_uncached_draft:
            drafters[UNCACHED] = (draft, {**tree, "draft_cache": False})
        results, walls = _decode_all(
            model,
            drafters,
            encoded,
            max_new_tokens=max_new_tokens,
            eos=model.config.eos_token_id,
            progress=progress,
            aux_layer_ids=draft.aux_layer_ids,
            steps=steps,
        )
    shape = dict(steps=steps, topk=topk, num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens)
    return {
        **_figures(results, walls, steps),
        **shape,
        "num_prompts": len(encoded),
        "aux_layer_ids": list(draft.aux_layer_ids),
        "lossless": True,
        "num_threads": num_threads,
        "wall_s": time.perf_counter() - start,
    }


def _figures(results: dict[str, list[DecodeResult]], walls: dict[str, float], steps: int) -> dict:
    """The acceptance and wall-time fields of BENCHMARK_FIELDS from _decode_all's results."""
    trained, random, ngram, uncached = results["trained"], results["random"], results["n-gram"], results.get(UNCACHED)
    tau, tau_ngram = pooled_tau(trained), pooled_tau(ngram)
    return {
        "engine": "reference",
        "tau_mean": tau,
        "tau_per_prompt": [r.tau for r in trained],
        "accept_rate_per_position": accept_rates(trained, steps),
        "num_verify_steps": sum(r.num_verify_steps for r in trained),
        "tau_random": pooled_tau(random),
        "accept_rate_per_position_random": accept_rates(random, steps),
        "tau_ngram": tau_ngram,
        "accept_rate_per_position_ngram": accept_rates(ngram, steps),
        "tau_ratio_vs_ngram": tau / tau_ngram,
        "speedup_vs_greedy": walls["greedy"] / walls["trained"],
        "speedup_ngram_vs_greedy": walls["greedy"] / walls["n-gram"],
        "wall_s_greedy": walls["greedy"],
        "wall_s_speculative": walls["trained"],
        "wall_s_ngram": walls["n-gram"],
        "wall_s_speculative_uncached": walls.get(UNCACHED),
        "speedup_vs_greedy_uncached": None if uncached is None else walls["greedy"] / walls[UNCACHED],
        "tau_mean_uncached": None if uncached is None else pooled_tau(uncached),
    }


def describe_benchmark(result: dict) -> list[str]:
    """The benchmark's result as a few aligned lines for a terminal (figures rounded; what an engine does not
    measure is left out)."""
    r = result

    def fig(key: str, fmt: str = "{:.2f}") -> str:
        return fmt.format(r[key]) if isinstance(r.get(key), (int, float)) else "-"

    per_position = ", ".join(f"{a:.2f}" for a in r.get("accept_rate_per_position") or []) or "-"
    lines = [
        f"benchmark ({r['engine']} engine, {r.get('num_prompts', '?')} held-out prompts, chains of {r['steps']}):",
        f"  tau (tokens per verify step)  {fig('tau_mean')}   n-gram {fig('tau_ngram')}   random draft "
        f"{fig('tau_random')}",
        f"  acceptance per position       {per_position}",
    ]
    if "speedup_vs_greedy" in r:
        lines.append(
            f"  speedup vs greedy             {fig('speedup_vs_greedy', '{:.2f}x')}   n-gram "
            f"{fig('speedup_ngram_vs_greedy', '{:.2f}x')}"
        )
    if "lossless" in r:
        lines.append(f"  lossless (output = greedy)    {'yes' if r['lossless'] else 'NO'}")
    return lines


def write_benchmark_json(result: dict, path: str | Path) -> Path:
    """Write the result as JSON (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path


def extracted_aux_layer_ids(config: RunConfig) -> list[int]:
    """The canonical aux layer ids the run's shards were extracted at (their extract.json, local copy or S3)."""
    store = shard_source(config)
    run = read_run_meta(store)
    if run is None:
        raise FileNotFoundError(f"{store.url}/{RUN_META_NAME}: no extraction recorded; run extraction first")
    return list(run.aux_layer_ids)


def bench_run(config: RunConfig, export_dir: str | Path, progress: Callable[[dict], None] | None = None) -> dict:
    """The stage entry: the configured engine on the held-out prompts; writes and returns benchmark.json's
    contents (plus "path"). The SGLang launch is linted against the layer ids the shards were extracted at.
    `progress` gets run_benchmark's dicts per prompt; the SGLang engine reports its prompts as one pass, before
    the launch and once they are all done."""
    b = config.bench
    prompts = [r["conversations"] for r in read_prompts(b.prompts_path, b.num_prompts)]
    report = progress or (lambda info: None)
    if b.engine == "sglang":
        report({"pass": "sglang", "prompts_done": 0, "prompts_total": len(prompts), "eta_s": None})
        result = run_sglang_benchmark(
            bench_launch(config, export_dir),
            encode_prompts(prompts, config.target.model_path, trust_remote_code=config.target.trust_remote_code),
            max_new_tokens=b.max_new_tokens,
            concurrency=b.sglang_concurrency,
            startup_timeout_s=b.sglang_startup_timeout_s,
            shard_aux_layer_ids=extracted_aux_layer_ids(config),
            log_dir=config.paths.bench_dir,
        )
        report({"pass": "sglang", "prompts_done": len(prompts), "prompts_total": len(prompts), "eta_s": 0.0})
    else:
        result = run_benchmark(
            config.target.model_path,
            export_dir,
            prompts,
            steps=b.num_steps,
            max_new_tokens=b.max_new_tokens,
            topk=b.topk,
            num_draft_tokens=b.draft_tokens,
            ngram_max_n=b.ngram_max_n,
            progress=progress,
            trust_remote_code=config.target.trust_remote_code,
        )
    path = write_benchmark_json(result, config.paths.bench_dir / BENCHMARK_FILE)
    return {**result, "path": str(path)}


def read_benchmark(bench_dir: str | Path) -> dict | None:
    """benchmark.json of a run (BENCHMARK_FIELDS for the reference engine), or None when there is none."""
    return read_json_record(Path(bench_dir) / BENCHMARK_FILE)
