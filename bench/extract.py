"""Extraction speed against a bare forward loop, and the time to plan a resume over 40,000 shards.

    .venv/bin/python bench/extract.py [--hidden 512 --layers 8 --num-samples 48 --tokens 192 --repeats 3] [--quick]

Throughput: a random Llama (built here, no download) of `--hidden` x `--layers` is saved as a Hugging
Face directory; the same samples are (1) run through a bare loop of `model(input_ids,
attention_mask, output_hidden_states=True)` over exactly the batches eyas forms (per shard, every
`batch_size` samples from the shard's first), and (2) extracted by `run_extraction` into a
fresh directory (forward, copy into the shard tensors, safetensors bytes, sha256, temporary ->
fsync -> rename, manifest rows, compaction). eyas asks the model for the logits of one position
only (it needs hidden states), which the bare loop, like most hand-written ones, does not. `throughput_ratio` = tokens/s of (2) / tokens/s of (1),
best of `--repeats` each, interleaved (goal >= 0.90). The committed tiny target is measured the same
way for information: its forward pass is so small that the per-shard file work shows.
Resume plan: a manifest of 40,000 shards (2 samples each, sparse files of the listed sizes) is written;
`resume_plan_s` is the time to compute the shard plan from the sample lengths and the resume plan
(run parameters checked, interrupted writes looked for, manifest read and checked against the plan
and the directory listing), best of `--repeats` (goal < 2 s).
The last line is one JSON object with the figures. `--quick` (for the test suite): H 64, 8 samples of at most 32
tokens, 400 resume shards, once each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import ExtractConfig  # noqa: E402
from eyas.dataset.table import TokenizedDataset  # noqa: E402
from eyas.extract.coordinator import run_extraction  # noqa: E402
from eyas.extract.plan import describe_extraction, resume_plan  # noqa: E402
from eyas.facts import facts_for  # noqa: E402
from eyas.shards.format import bytes_per_token, plan_shards, shard_filename  # noqa: E402
from eyas.shards.manifest import ManifestRow, write_manifest  # noqa: E402
from eyas.shards.shard_set import ExtractRunMeta, check_run_meta  # noqa: E402
from eyas.storage.local import LocalStorage  # noqa: E402
from eyas.target import load_target  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_tokenized(path: Path, lengths: list[int], *, vocab: int = 2048) -> None:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    table = pa.table(
        {
            "sample_index": pa.array(range(len(lengths)), pa.int64()),
            "id": pa.array([f"s{i}" for i in range(len(lengths))]),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array([[1] * n for n in lengths], pa.list_(pa.uint8())),
            "num_tokens": pa.array(lengths, pa.int32()),
        }
    ).replace_schema_metadata({b"eyas.content_hash": b"bench"})
    pq.write_table(table, path)


def build_target(out: Path, hidden: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "fixtures" / "tiny-target" / name, out / name)
    return out


@torch.no_grad()
def bare_forward_s(target_path: Path, tokenized: Path, cfg: ExtractConfig) -> float:
    """Seconds of the bare loop over the batches eyas forms (model loaded beforehand, not timed)."""
    dataset = TokenizedDataset(tokenized)
    facts = facts_for(target_path=target_path, tokenized_path=tokenized, shards_dir=tokenized.parent / "unused")
    _, plan = describe_extraction(cfg, facts)
    model = load_target(target_path, "float32").model
    batches = []
    for p in plan:
        ids, _ = dataset.tokens(p.sample_start, p.sample_end)
        lengths = dataset.num_tokens[p.sample_start : p.sample_end]
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        for b in range(0, len(lengths), cfg.batch_size):
            idx = range(b, min(b + cfg.batch_size, len(lengths)))
            x = torch.zeros(len(idx), max(lengths[i] for i in idx), dtype=torch.long)
            mask = torch.zeros_like(x)
            for row, i in enumerate(idx):
                x[row, : lengths[i]] = ids[starts[i] : starts[i + 1]]
                mask[row, : lengths[i]] = 1
            batches.append((x, None if len(idx) == 1 else mask))
    t0 = time.perf_counter()
    for x, mask in batches:
        model(input_ids=x, attention_mask=mask, output_hidden_states=True, use_cache=False)
    return time.perf_counter() - t0


def eyas_extract_s(target_path: Path, tokenized: Path, cfg: ExtractConfig, root: Path) -> float:
    """Seconds of run_extraction (model load excluded: it is timed alone and subtracted)."""
    shards = root / "shards"
    shutil.rmtree(shards, ignore_errors=True)
    t0 = time.perf_counter()
    load_target(target_path, "float32")
    load_s = time.perf_counter() - t0
    summary = run_extraction(cfg, facts_for(target_path=target_path, tokenized_path=tokenized, shards_dir=shards))
    return summary.seconds - load_s


def bench_throughput(root: Path, target: Path, lengths: list[int], cfg: ExtractConfig, repeats: int) -> dict:
    tokenized = root / f"tokenized-{target.name}.parquet"
    write_tokenized(tokenized, lengths)
    tokens = sum(lengths)
    bare, eyas = [], []
    for _ in range(repeats):
        bare.append(bare_forward_s(target, tokenized, cfg))
        eyas.append(eyas_extract_s(target, tokenized, cfg, root))
    return {
        "tokens": tokens,
        "bare_tok_s": tokens / min(bare),
        "eyas_tok_s": tokens / min(eyas),
        "ratio": min(bare) / min(eyas),
    }


def bench_resume_plan(root: Path, num_shards: int, repeats: int) -> dict:
    """A finished-looking extraction of `num_shards` shards; time plan + resume plan over it."""
    shards = root / "resume" / "shards"
    shards.mkdir(parents=True)
    lengths = [100] * (2 * num_shards)
    hidden, bpt = 4096, bytes_per_token(hidden_size=4096, num_aux=3, dtype="bfloat16")
    shard_bytes = 200 * bpt  # two samples per shard
    plan = plan_shards(lengths, bpt, shard_bytes)
    assert len(plan) == num_shards
    run = ExtractRunMeta(
        format_version="1",
        target_fingerprint="bench",
        aux_layer_ids=[2, 16, 29],
        layer_id_convention="hf_hidden_states",
        hidden_size=hidden,
        num_aux=3,
        dtype="bfloat16",
        target_dtype="bfloat16",
        backend="hf",
        dataset_hash="bench",
        shard_bytes=shard_bytes,
        num_shards=num_shards,
        aux_dtype="bfloat16",
        teacher="last_hidden",
        teacher_topk=0,
    )
    store = LocalStorage(shards)
    check_run_meta(store, run)  # records extract.json, as the first run would
    rows = []
    for p in plan:
        name = shard_filename(p.index)
        with open(shards / name, "wb") as f:
            f.truncate(p.num_tokens * bpt)  # sparse: sizes are what the plan checks
        rows.append(
            ManifestRow(p.index, name, p.sample_start, p.sample_end, p.num_tokens, p.num_tokens * bpt, "0" * 64)
        )
    write_manifest(store, rows)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        again = plan_shards(lengths, bpt, shard_bytes)
        rp = resume_plan(store, run, again)
        times.append(time.perf_counter() - t0)
        assert (len(rp.done), rp.todo) == (num_shards, [])
    return {"num_shards": num_shards, "resume_plan_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--num-samples", type=int, default=48)
    parser.add_argument(
        "--tokens", type=int, default=192, help="longest sample; lengths spread over [tokens/2, tokens]"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=16)
    parser.add_argument("--num-resume-shards", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, once each: seconds, the same code path")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.num_samples, args.tokens, args.num_resume_shards, args.repeats = 64, 8, 32, 400, 1
    torch.set_num_threads(os.cpu_count() or 1)
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-extract-", dir=args.dir))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.tokens // 2, args.tokens + 1, (args.num_samples,), generator=g).tolist()
    cfg = ExtractConfig(shard_bytes=args.shard_mib << 20, batch_size=args.batch_size)
    try:
        big = build_target(root / f"llama-h{args.hidden}-l{args.layers}", args.hidden, args.layers)
        main_fig = bench_throughput(root, big, lengths, cfg, args.repeats)
        tiny = bench_throughput(root, REPO / "fixtures" / "tiny-target", lengths, cfg, args.repeats)
        resume = bench_resume_plan(root, args.num_resume_shards, args.repeats)
    finally:
        shutil.rmtree(root)
    print(
        f"\nextraction throughput, {args.num_samples} samples, {main_fig['tokens']} tokens, batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads (best of {args.repeats})"
    )
    for label, fig in ((f"random Llama H={args.hidden} x {args.layers} layers", main_fig), ("tiny target H=128", tiny)):
        print(
            f"  {label:34s} bare forward {fig['bare_tok_s']:8.0f} tok/s   eyas {fig['eyas_tok_s']:8.0f} tok/s   "
            f"ratio {fig['ratio']:.3f}"
        )
    print(f"  (goal: ratio >= 0.90 on the H={args.hidden} model)")
    print(f"resume plan over {resume['num_shards']} shards: {resume['resume_plan_s']:.3f} s (goal < 2 s)")
    print(
        json.dumps(
            {
                "throughput_ratio": round(main_fig["ratio"], 3),
                "resume_plan_s": round(resume["resume_plan_s"], 3),
                "bare_tok_s": round(main_fig["bare_tok_s"], 1),
                "eyas_tok_s": round(main_fig["eyas_tok_s"], 1),
                "tiny_target_ratio": round(tiny["ratio"], 3),
                "hidden_size": args.hidden,
                "num_layers": args.layers,
                "tokens": main_fig["tokens"],
                "resume_num_shards": resume["num_shards"],
            }
        )
    )


if __name__ == "__main__":
    main()
