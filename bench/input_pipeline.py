"""The trainer's input pipeline at the Kimi width: tokens/s and GB/s it delivers against a bare sequential read of
the same shard files, and its data stall when each step's compute is simulated at the Kimi draft's H200 rate.

Usage: .venv/bin/python bench/input_pipeline.py [--gib-per-encoding 2.5] [--shard-mib 1024] [--quick]

Shards: H 7168, 3 aux layers, last_hidden teacher in bfloat16, aux in bfloat16 (57,353 bytes a token) and in
float8_e4m3 (35,861), samples of 1,024-4,096 tokens (uniform), written to local disk under TMPDIR with the
extraction's shard writer (eyas.shards.format.write_shard) and deleted at the end. One rank's step of the Kimi
preset (global batch 32 over 8 ranks: 4 samples), walked as a rank whose order covers every sample once, so a pass
reads the bytes the bare read reads; micro-batches of at most 8,192 tokens; the trainer's own code:
eyas.train.input_pipeline RankSteps (order, rank share, load_sample, collate) in InputPipeline (one step ahead,
train.prefetch_steps' default), on this machine's CPU (no pinning; float8 decoded on the CPU inside `next`).

Passes, each over every training sample once (one epoch), with the page cache of the shard files dropped before it
(posix_fadvise DONTNEED after an fsync, so both read from the disk, not from memory):
- read: every shard file read front to back in 64 MiB reads (readinto one buffer); GB/s = file bytes / seconds.
- loader: pipeline.next for every step as fast as it delivers, host side as on a CUDA rank (float8 aux read and
  collated as stored; their decode runs on the device there, so here it is left out); GB/s = the bytes of the
  samples' tensors it read (tokens x bytes per token) / seconds. loader_vs_read_ratio = loader GB/s / read GB/s
  (goal >= 0.80). For float8 a further pass decodes on this CPU inside `next`, as a CPU run of the trainer does
  (`loader_gb_per_s_float8_decoded_on_cpu`).
- stall: the same walk with each step's compute simulated by sleeping tokens x train_flops_per_token(Kimi draft:
  DraftArch(7168, 3, 163840, 32000, 64, 64, 128, 18432), 7 unroll steps, the mean sample length) / (989e12 bf16
  dense peak of an H200 x 0.45 MFU); stall_fraction = seconds waiting in pipeline.next / all step seconds
  (goal <= 0.05), over the steps after the first; the first step's wait (the pipeline filling, once per launch)
  is given apart, and the fraction with it. The headline figures are the worse encoding's; per encoding in
  `by_encoding`.
`--quick` (for the test suite): 64 MiB per encoding in 16 MiB shards, samples of 16-64 tokens: seconds.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from eyas.config import TrainConfig  # noqa: E402
from eyas.draft import DraftArch  # noqa: E402
from eyas.layer_ids import LAYER_ID_CONVENTION  # noqa: E402
from eyas.shards.encoding import ShardEncoding, empty_features  # noqa: E402
from eyas.shards.format import ShardMeta, write_shard  # noqa: E402
from eyas.shards.manifest import write_manifest  # noqa: E402
from eyas.shards.reader import ShardSamples  # noqa: E402
from eyas.train.data import UNIFORM, steps_per_epoch  # noqa: E402
from eyas.train.flops import train_flops_per_token  # noqa: E402
from eyas.train.input_pipeline import HostStep, InputPipeline, RankSteps  # noqa: E402

HIDDEN, NUM_AUX, NUM_TTT_STEPS = 7168, 3, 7
KIMI_DRAFT = DraftArch(7168, 3, 163840, 32000, 64, 64, 128, 18432, rope_theta=1e6, max_position_embeddings=4096)
H200_BF16_PEAK, MFU = 989e12, 0.45
SAMPLES_PER_STEP, MICRO_BATCH_TOKENS = 4, 8192  # Kimi preset: global batch 32 over 8 ranks
ENCODINGS = {
    "bfloat16": ShardEncoding(aux_dtype="bfloat16", dtype="bfloat16"),
    "float8_e4m3": ShardEncoding(aux_dtype="float8_e4m3", dtype="bfloat16"),
}
READ_CHUNK = 64 << 20


def write_shards(root: Path, enc: ShardEncoding, total_bytes: int, shard_bytes: int, lengths: tuple[int, int]):
    """Random shards of samples of `lengths` tokens, about shard_bytes each, total_bytes in all; (dir, tokens)."""
    root.mkdir(parents=True)
    per_token = enc.bytes_per_token(hidden_size=HIDDEN, num_aux=NUM_AUX)
    gen = torch.Generator().manual_seed(0)
    rows, sample, written = [], 0, 0
    while written < total_bytes:
        sizes = []
        while sum(sizes) * per_token < min(shard_bytes, total_bytes - written):
            sizes.append(int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen)))
        t = sum(sizes)
        tensors = empty_features(enc, t, num_aux=NUM_AUX, hidden_size=HIDDEN)
        for name, value in tensors.items():  # random values: the bytes' content does not change a read
            if name == "aux_scales":
                value.uniform_(0.5, 1.5, generator=gen)
            else:
                value.view(torch.uint8).random_(0, 120, generator=gen)
        tensors["input_ids"] = torch.randint(0, 163840, (t,), generator=gen)
        tensors["loss_mask"] = torch.ones(t, dtype=torch.uint8)
        tensors["sample_offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(sizes).cumsum(0)])
        tensors["sample_indices"] = torch.arange(sample, sample + len(sizes), dtype=torch.int64)
        meta = ShardMeta(target_fingerprint="bench", aux_layer_ids=(2, 30, 58), layer_id_convention=LAYER_ID_CONVENTION,
                         hidden_size=HIDDEN, num_aux=NUM_AUX, dtype=enc.dtype, backend="synthetic",
                         dataset_hash="bench", shard_index=len(rows), sample_start=sample,
                         sample_end=sample + len(sizes), aux_dtype=enc.aux_dtype, teacher=enc.teacher,
                         teacher_topk=enc.teacher_topk)  # fmt: skip
        rows.append(write_shard(root, tensors, meta))
        sample, written = sample + len(sizes), written + t * per_token
    write_manifest(root, rows)
    return root


def drop_cache(files: list[Path]) -> None:
    """The files' pages out of the page cache, so the next read comes from the disk."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bare_read(files: list[Path]) -> dict:
    drop_cache(files)
    buf, total = bytearray(READ_CHUNK), 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    seconds = time.perf_counter() - start
    return {"bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9}


def host_side(steps: RankSteps):
    """The steps as a CUDA rank's host builds them: float8 aux and their scales read and collated, the decode left
    to the device (here it would run on the CPU inside `next`, which a GPU rank's host never does)."""

    def build(position: int) -> HostStep:
        host = steps(position)
        for batch in host.micro_batches:
            batch.pop("aux_scales", None)
        return host

    return build


def walk(shards: Path, files: list[Path], compute_s_per_token: float, *, cpu_decode: bool = False) -> dict:
    """One epoch of one rank's steps through the trainer's input pipeline (host side, or with float8 decoded on the
    CPU); with compute_s_per_token > 0 each step sleeps its simulated compute. Bytes are the tensors the samples
    read (tokens x bytes per token). The first step's wait (filling the pipeline, once per launch) is kept apart."""
    samples = ShardSamples(shards)
    train = TrainConfig(num_processes=1, global_batch_size=SAMPLES_PER_STEP, num_ttt_steps=NUM_TTT_STEPS)
    ids = tuple(range(len(samples)))
    num_steps = steps_per_epoch(len(ids), SAMPLES_PER_STEP)
    per_token = samples.meta.encoding.bytes_per_token(hidden_size=HIDDEN, num_aux=NUM_AUX)
    steps = RankSteps(samples, ids, train, UNIFORM, 0, 1, max_len=4096, micro_batch_tokens=MICRO_BATCH_TOKENS,
                      pin_memory=False)  # fmt: skip
    drop_cache(files)
    tokens, waits, step_s, start = 0, [], [], time.perf_counter()
    pipeline = InputPipeline(steps if cpu_decode else host_side(steps), range(0, num_steps * SAMPLES_PER_STEP,
                             SAMPLES_PER_STEP), depth=1, device=torch.device("cpu"), encoding=samples.meta.encoding,
                             num_aux=NUM_AUX)  # fmt: skip
    try:
        for step in range(num_steps):
            began = time.perf_counter()
            data = pipeline.next(step * SAMPLES_PER_STEP)
            step_tokens = sum(int(b["valid"].sum()) for b in data.micro_batches)
            tokens, waits = tokens + step_tokens, waits + [data.wait_s]
            if compute_s_per_token:
                time.sleep(step_tokens * compute_s_per_token)
            step_s.append(time.perf_counter() - began)
    finally:
        pipeline.close()
        samples.close()
    seconds = time.perf_counter() - start
    return {"steps": num_steps, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "gb_per_s": tokens * per_token / seconds / 1e9, "first_wait_s": waits[0],
            "stall_fraction": sum(waits[1:]) / max(sum(step_s[1:]), 1e-9),
            "stall_fraction_with_first": sum(waits) / sum(step_s)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib-per-encoding", type=float, default=2.5)
    p.add_argument("--shard-mib", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="64 MiB per encoding, short samples: seconds")
    args = p.parse_args()
    lengths = (16, 64) if args.quick else (1024, 4096)
    total = (64 << 20) if args.quick else int(args.gib_per_encoding * 2**30)
    shard_bytes = (16 << 20) if args.quick else args.shard_mib << 20
    mean_length = sum(lengths) / 2
    flops = train_flops_per_token(KIMI_DRAFT, NUM_TTT_STEPS, mean_length)
    compute_s_per_token = flops / (H200_BF16_PEAK * MFU)
    results = {}
    root = Path(tempfile.mkdtemp(prefix="eyas-input-bench-"))
    try:
        for name, enc in ENCODINGS.items():
            shards = write_shards(root / name, enc, total, shard_bytes, lengths)
            files = sorted(shards.glob("*.safetensors"))
            walk(shards, files, 0.0)  # warm-up: imports, first allocations (the cache is dropped before each pass)
            read = bare_read(files)
            loader = walk(shards, files, 0.0)
            stall = walk(shards, files, compute_s_per_token)
            decoded = walk(shards, files, 0.0, cpu_decode=True) if enc.aux_dtype == "float8_e4m3" else loader
            results[name] = {"read": read, "loader": loader, "stall": stall, "cpu_decode": decoded,
                             "num_shards": len(files),
                             "shard_set_gb": sum(f.stat().st_size for f in files) / 1e9}  # fmt: skip
            shutil.rmtree(shards)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"one rank, {SAMPLES_PER_STEP} samples of {lengths[0]}-{lengths[1]} tokens a step, "
        f"H {HIDDEN} x {NUM_AUX} aux + last hidden; page cache dropped before every pass (posix_fadvise DONTNEED)"
    )
    print(f"simulated compute: {flops / 1e9:.1f} GFLOP/token (Kimi draft, {NUM_TTT_STEPS} unroll steps, mean length "
          f"{mean_length:.0f}) / (989 TFLOP/s H200 bf16 peak x {MFU} MFU) = {compute_s_per_token * 1e6:.1f} us/token, "
          f"{1 / compute_s_per_token:,.0f} tokens/s")  # fmt: skip
    print(f"\n{'encoding':12s} {'shards':>6s} {'GB':>6s} {'read GB/s':>9s} {'loader GB/s':>11s} {'tokens/s':>9s} "
          f"{'ratio':>6s} {'stall':>6s} {'stall+1st':>9s} {'1st wait s':>10s} {'cpu-decode GB/s':>15s}")  # fmt: skip
    for name, r in results.items():
        ratio = r["loader"]["gb_per_s"] / r["read"]["gb_per_s"]
        r["loader_vs_read_ratio"] = ratio
        print(f"{name:12s} {r['num_shards']:6d} {r['shard_set_gb']:6.2f} {r['read']['gb_per_s']:9.3f} "
              f"{r['loader']['gb_per_s']:11.3f} {r['loader']['tokens_per_s']:9,.0f} {ratio:6.3f} "
              f"{r['stall']['stall_fraction']:6.3f} {r['stall']['stall_fraction_with_first']:9.3f} "
              f"{r['stall']['first_wait_s']:10.2f} {r['cpu_decode']['gb_per_s']:15.3f}")  # fmt: skip
    worst_ratio = min(r["loader_vs_read_ratio"] for r in results.values())
    worst_stall = max(r["stall"]["stall_fraction"] for r in results.values())
    print(f"\nloader_vs_read_ratio (worst encoding, goal >= 0.80): {worst_ratio:.3f}")
    print(f"stall_fraction at the simulated H200 rate (worst encoding, goal <= 0.05): {worst_stall:.3f}")
    figures = {
        "loader_vs_read_ratio": round(worst_ratio, 4),
        "stall_fraction": round(worst_stall, 4),
        "gb_per_s": round(min(r["loader"]["gb_per_s"] for r in results.values()), 4),
        "tokens_per_s": round(min(r["loader"]["tokens_per_s"] for r in results.values()), 1),
        "simulated_tokens_per_s": round(1 / compute_s_per_token, 1),
        "flops_per_token": flops,
        "by_encoding": {
            name: {
                "read_gb_per_s": round(r["read"]["gb_per_s"], 4),
                "loader_gb_per_s": round(r["loader"]["gb_per_s"], 4),
                "loader_tokens_per_s": round(r["loader"]["tokens_per_s"], 1),
                "loader_vs_read_ratio": round(r["loader_vs_read_ratio"], 4),
                "stall_fraction": round(r["stall"]["stall_fraction"], 4),
                "stall_fraction_with_first_step": round(r["stall"]["stall_fraction_with_first"], 4),
                "first_step_wait_s": round(r["stall"]["first_wait_s"], 3),
                "steps": r["stall"]["steps"],
                "loader_gb_per_s_float8_decoded_on_cpu": round(r["cpu_decode"]["gb_per_s"], 4),
                "shard_set_gb": round(r["shard_set_gb"], 3),
                "num_shards": r["num_shards"],
            }
            for name, r in results.items()
        },
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
