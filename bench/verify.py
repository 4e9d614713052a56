"""Shard verification speed: full mode against `cat` of the same files, cheap mode over many headers.

    .venv/bin/python bench/verify.py [--num-shards 4 --shard-mib 384 --num-headers 40000 --dir /tmp] [--quick]

Full mode: real-format shards (bfloat16, H=4096, 3 aux layers: 32 KiB per token) are written to a
temporary directory, the page cache is warmed, then `cat FILES > /dev/null` and `verify_shards(mode=
"full")` are each timed (best of `--repeats`). `full_vs_cat_ratio` = verify throughput / cat
throughput (goal >= 0.70). The files total 1.5 GiB: at page-cache speed (20+ GiB/s) a smaller set is
read in a few milliseconds and the fixed costs (dataset and manifest reads, threads) dominate. Reading
and checksumming the same files (xxh3-128, eyas.checksum) on the same threads is timed too: it bounds
full mode from above (every byte is hashed against the manifest).
Cheap mode: `--num-headers` small shards (2 tokens each) and their manifest; `cheap_40k_s` is the
time of `verify_shards(mode="cheap")` over all of them with every core allowed (goal < 5 s, and never above
`cheap_1_thread_s`, the same with num_workers=1), dataset and manifest reads included; `cheap_workers` is what
verification chose to run them on (eyas.verify.workers: one thread, or processes when the work warrants them).
Everything written is removed at the end. The last line is one JSON object with the figures. `--quick` (for the
test suite): 2 shards of 1 MiB and 200 headers, once each.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save as safetensors_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.checksum import checksum_bytes, checksum_file  # noqa: E402
from eyas.shards.format import ShardMeta, shard_filename, write_shard  # noqa: E402
from eyas.shards.manifest import ManifestRow, write_manifest  # noqa: E402
from eyas.verify.checks import ExpectedShardMeta  # noqa: E402
from eyas.verify.shard_set import verify_shards  # noqa: E402

TOKENS_PER_SAMPLE = 256


def write_tokenized(path: Path, num_samples: int, tokens_per_sample: int) -> None:
    ids = torch.arange(num_samples * tokens_per_sample, dtype=torch.int64).remainder(2048).view(num_samples, -1)
    table = pa.table(
        {
            "sample_index": pa.array(range(num_samples), pa.int64()),
            "id": pa.array([f"s{i}" for i in range(num_samples)]),
            "input_ids": pa.array(ids.tolist(), pa.list_(pa.int32())),
            "loss_mask": pa.array([[1] * tokens_per_sample] * num_samples, pa.list_(pa.uint8())),
            "num_tokens": pa.array([tokens_per_sample] * num_samples, pa.int32()),
        }
    ).replace_schema_metadata({b"eyas.content_hash": b"bench"})
    pq.write_table(table, path)


def expected(hidden: int, dtype: str) -> ExpectedShardMeta:
    return ExpectedShardMeta(
        target_fingerprint="bench", aux_layer_ids=(2, 16, 29), hidden_size=hidden, num_aux=3, dtype=dtype,
        dataset_hash="bench",
    )  # fmt: skip


def meta(index: int, start: int, end: int, hidden: int, dtype: str) -> ShardMeta:
    e = expected(hidden, dtype)
    return ShardMeta(
        target_fingerprint=e.target_fingerprint, aux_layer_ids=e.aux_layer_ids, layer_id_convention=e.layer_id_convention,
        hidden_size=hidden, num_aux=3, dtype=dtype, backend="hf", dataset_hash="bench", shard_index=index,
        sample_start=start, sample_end=end,
    )  # fmt: skip


def shard_tensors(start: int, end: int, tokens: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n = end - start
    ids = torch.arange(start * tokens, end * tokens, dtype=torch.int64).remainder(2048)
    return {
        "input_ids": ids,
        "loss_mask": torch.ones(n * tokens, dtype=torch.uint8),
        "aux_hidden_states": torch.randn(n * tokens, 3 * hidden).to(dtype),
        "last_hidden_states": torch.randn(n * tokens, hidden).to(dtype),
        "sample_offsets": torch.arange(0, n * tokens + 1, tokens, dtype=torch.int64),
        "sample_indices": torch.arange(start, end, dtype=torch.int64),
    }


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def checksum_files(files: list[Path], workers: int) -> None:
    def one(path: Path) -> str:
        return checksum_file(path, chunk_bytes=8 << 20)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, files))


def bench_full(root: Path, num_shards: int, shard_mib: int, repeats: int) -> dict:
    hidden = 4096
    samples_per_shard = max(1, (shard_mib << 20) // (TOKENS_PER_SAMPLE * 4 * hidden * 2))
    shards = root / "full"
    shards.mkdir()
    write_tokenized(root / "full.parquet", num_shards * samples_per_shard, TOKENS_PER_SAMPLE)
    rows = []
    for i in range(num_shards):
        start, end = i * samples_per_shard, (i + 1) * samples_per_shard
        tensors = shard_tensors(start, end, TOKENS_PER_SAMPLE, hidden, torch.bfloat16)
        rows.append(write_shard(shards, tensors, meta(i, start, end, hidden, "bfloat16")))
    write_manifest(shards, rows)
    files = [shards / r.file for r in rows]
    total = sum(r.num_bytes for r in rows)
    cat = ["cat", *map(str, files)]

    def run_cat() -> None:
        subprocess.run(cat, stdout=subprocess.DEVNULL, check=True)

    def run_verify(workers: int):
        report = verify_shards(
            shards_dir=shards, tokenized_path=root / "full.parquet", expected=expected(hidden, "bfloat16"),
            mode="full", num_workers=workers,
        )  # fmt: skip
        if not report.ok:
            raise RuntimeError(f"bench shards failed verification: {report.bad_reasons or report.problems}")

    run_cat()  # warm the page cache
    cores = os.cpu_count() or 1
    cat_s = best_of(repeats, run_cat)
    verify_s = best_of(repeats, lambda: run_verify(0))
    verify_1_s = best_of(repeats, lambda: run_verify(1))
    sha_s = best_of(repeats, lambda: checksum_files(files, cores))
    gib = total / (1 << 30)
    return {
        "bytes": total,
        "cores": cores,
        "cat_gib_s": gib / cat_s,
        "full_gib_s": gib / verify_s,
        "full_1_thread_gib_s": gib / verify_1_s,
        "checksum_only_gib_s": gib / sha_s,
        "full_vs_cat_ratio": cat_s / verify_s,
        "checksum_vs_cat_ratio": cat_s / sha_s,
    }


def write_small_shards(shards: Path, num: int) -> None:
    """`num` shards of one 2-token sample (H=8, float32), written without fsync: only headers matter."""
    hidden, rows = 8, []
    for i in range(num):
        data = safetensors_bytes(
            shard_tensors(i, i + 1, 2, hidden, torch.float32),
            metadata=meta(i, i, i + 1, hidden, "float32").to_metadata(),
        )
        name = shard_filename(i)
        (shards / name).write_bytes(data)
        rows.append(ManifestRow(i, name, i, i + 1, 2, len(data), checksum_bytes(data)))
    write_manifest(shards, rows)


def bench_cheap(root: Path, num: int, repeats: int) -> dict:
    shards = root / "cheap"
    shards.mkdir()
    write_tokenized(root / "cheap.parquet", num, 2)
    write_small_shards(shards, num)

    chosen = []

    def run(workers: int) -> None:
        report = verify_shards(
            shards_dir=shards, tokenized_path=root / "cheap.parquet", expected=expected(8, "float32"),
            mode="cheap", num_workers=workers,
        )  # fmt: skip
        if not report.ok or len(report.rows) != num:
            raise RuntimeError(f"bench shards failed verification: {list(report.bad_reasons.items())[:3]}")
        chosen.append(report.workers)

    return {
        "num_headers": num,
        "cheap_s": best_of(repeats, lambda: run(0)),
        "workers": chosen[0],
        "cheap_1_thread_s": best_of(repeats, lambda: run(1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=384)
    parser.add_argument("--num-headers", type=int, default=40_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where to write the temporary shards (default: the system temp dir)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, once each: seconds, the same code path")
    args = parser.parse_args()
    if args.quick:
        args.num_shards, args.shard_mib, args.num_headers, args.repeats = 2, 1, 200, 1
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-verify-", dir=args.dir))
    try:
        full = bench_full(root, args.num_shards, args.shard_mib, args.repeats)
        shutil.rmtree(root / "full")
        cheap = bench_cheap(root, args.num_headers, max(1, args.repeats - 1))
    finally:
        shutil.rmtree(root)
    print(
        f"\nfull verification, {args.num_shards} shards, {full['bytes'] / (1 << 20):.0f} MiB, page cache warm, {full['cores']} cores"
    )
    print(f"  {'cat':28s} {full['cat_gib_s']:6.2f} GiB/s")
    print(
        f"  {'verify full (all cores)':28s} {full['full_gib_s']:6.2f} GiB/s   ratio to cat {full['full_vs_cat_ratio']:.2f} (goal >= 0.70)"
    )
    print(f"  {'verify full (1 thread)':28s} {full['full_1_thread_gib_s']:6.2f} GiB/s")
    print(
        f"  {'checksum only (all cores)':28s} {full['checksum_only_gib_s']:6.2f} GiB/s   ratio to cat {full['checksum_vs_cat_ratio']:.2f} (read + xxh3-128)"
    )
    print(f"cheap verification, {cheap['num_headers']} shard headers")
    print(f"  {'all cores':28s} {cheap['cheap_s']:6.2f} s (goal < 5 s; ran on {cheap['workers']})")
    print(f"  {'1 thread':28s} {cheap['cheap_1_thread_s']:6.2f} s")
    figures = {
        "full_vs_cat_ratio": round(full["full_vs_cat_ratio"], 3),
        "cheap_40k_s": round(cheap["cheap_s"], 3),
        "num_headers": cheap["num_headers"],
        "cheap_1_thread_s": round(cheap["cheap_1_thread_s"], 3),
        "cheap_workers": cheap["workers"],
        "cat_gib_s": round(full["cat_gib_s"], 3),
        "full_gib_s": round(full["full_gib_s"], 3),
        "full_1_thread_gib_s": round(full["full_1_thread_gib_s"], 3),
        "checksum_only_gib_s": round(full["checksum_only_gib_s"], 3),
        "checksum_vs_cat_ratio": round(full["checksum_vs_cat_ratio"], 3),
        "cores": full["cores"],
        "full_bytes": full["bytes"],
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
