"""Training at a real width and length: attention memory, the memory plan against measured peaks, padding waste,
and the trainer's speed against a bare loop.

Usage:
    .venv/bin/python bench/train_scale.py            # H 512, T up to 8,192 (about 15 minutes on 2 cores)
    .venv/bin/python bench/train_scale.py --quick    # small sizes, the same code paths (seconds)

1. Memory: the peak of a training step above the state it starts from (eyas.train.peak_memory: every torch
   allocation, read from the profiler), one sample of T tokens, 7 unroll steps, H 512, 8 heads of 64; the fused
   attention (eyas.attention) for T = 1,024 .. 8,192 and the eager [T, T] one where it fits in memory; and the
   seconds per step of both. Goal: at most 2.2x per doubling of T, and the fused one at least as fast.
2. Plan: eyas.train.memory_plan's peak against the measured peak at several widths, lengths, micro-batch sizes,
   parallelisms and checkpointing. Goal: within 20 %.
3. Padding: the share of computed tokens that is padding, over 400 global batches of the Kimi preset (32 samples,
   8 ranks) with lengths drawn like a chat dataset (log-normal, median 2,000, cut to 128..4,096): one micro-batch
   per rank against the auto budget's micro-batches of similar lengths.
4. Speed: eyas.train's Trainer (shards read from disk, metrics, a checkpoint) against a bare loop of the same
   micro-batches already on the device, at H 512 and T 2,048. Goal: trainer/bare >= 0.90.

The last line is one JSON object: attention_memory_growth_per_doubling, plan_error_max, padding_waste,
steps_ratio and the figures behind them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eyas.train.data import split_micro_batches  # noqa: E402
from eyas.train.memory_plan import AUTO_MAX_TOKENS, GIB, host_available_bytes  # noqa: E402

FULL = {
    "width": {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
              "intermediate_size": 1408, "target_vocab_size": 16384, "draft_vocab_size": 8192},
    "lengths": [1024, 2048, 4096, 8192],
    "timed": [1024, 2048],
    "scale_length": 2048,
}  # fmt: skip
QUICK = {
    "width": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
              "intermediate_size": 128, "target_vocab_size": 512, "draft_vocab_size": 256},
    "lengths": [128, 256, 512],
    "timed": [256],
    "scale_length": 128,
}  # fmt: skip
NUM_TTT_STEPS = 7


def run_case(case: dict, *, in_process: bool = False) -> dict:
    """eyas.train.peak_memory in a process of its own (one per case: nothing of one case stays allocated for the
    next), or with `in_process` (--quick) the same functions in this process."""
    if in_process:
        from eyas.train.peak_memory import step_peak, step_seconds

        return step_seconds(case, case["timed_steps"]) if case.get("mode") == "time" else step_peak(case)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "eyas.train.peak_memory", json.dumps(case)], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"eyas.train.peak_memory {json.dumps(case)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def eager_fits(width: dict, length: int) -> bool:
    """The eager attention keeps about three [heads, T, T] fp32 tensors per unroll step: run it where that is at
    most half of the memory this host has free."""
    need = NUM_TTT_STEPS * 3 * width["num_attention_heads"] * length * length * 4
    return need < host_available_bytes() // 2


def memory_table(sizes: dict, quick: bool) -> dict:
    width = {**sizes["width"], "num_aux": 3, "num_ttt_steps": NUM_TTT_STEPS, "parallelism": "none"}
    rows = {}
    print(f"{'T':>6s} {'fused MiB':>10s} {'eager MiB':>10s} {'fused s/step':>13s} {'eager s/step':>13s}")
    for length in sizes["lengths"]:
        row = {}
        for impl in ("fused", "eager"):
            if impl == "eager" and not eager_fits(width, length):
                continue
            case = {**width, "attention": impl, "lengths": [length]}
            peak = run_case(case, in_process=quick)
            row[f"{impl}_bytes"] = peak["measured_bytes"] - peak["step_start_bytes"]
            if length in sizes["timed"]:
                timed = {**case, "mode": "time", "timed_steps": 2}
                row[f"{impl}_step_s"] = run_case(timed, in_process=quick)["step_s"]
        rows[length] = row
        cells = [f"{row[k] / 2**20:10.1f}" if k in row else f"{'-':>10s}" for k in ("fused_bytes", "eager_bytes")]
        times = [f"{row[k]:13.2f}" if k in row else f"{'-':>13s}" for k in ("fused_step_s", "eager_step_s")]
        print(f"{length:6d} {' '.join(cells)} {' '.join(times)}")
    lengths = sizes["lengths"]
    growth = max(rows[b]["fused_bytes"] / rows[a]["fused_bytes"] for a, b in zip(lengths, lengths[1:]))
    eager = [t for t in lengths if "eager_bytes" in rows[t]]
    eager_growth = max((rows[b]["eager_bytes"] / rows[a]["eager_bytes"] for a, b in zip(eager, eager[1:])), default=None)
    speed = min(rows[t]["eager_step_s"] / rows[t]["fused_step_s"] for t in sizes["timed"] if "eager_step_s" in rows[t])
    print(f"growth per doubling of T: fused {growth:.3f} (goal <= 2.2), eager {eager_growth or float('nan'):.3f}; "
          f"fused speed / eager speed, lowest: {speed:.3f} (goal >= 1)")  # fmt: skip
    return {"growth": growth, "eager_growth": eager_growth, "speed": speed, "rows": rows}


def plan_cases(sizes: dict) -> list[dict]:
    w, t = sizes["width"], sizes["scale_length"]
    wide = {**w, "hidden_size": w["hidden_size"] * 3 // 2, "num_key_value_heads": w["num_key_value_heads"] // 2}
    base = {"num_aux": 3, "num_ttt_steps": NUM_TTT_STEPS}
    return [
        {**base, **w, "lengths": [t], "parallelism": "ddp"},
        {**base, **w, "lengths": [2 * t, t], "parallelism": "fsdp2"},
        {**base, **wide, "lengths": [t, t], "parallelism": "ddp", "num_layers": 2},
        {**base, **w, "lengths": [t // 2] * 4, "parallelism": "fsdp2", "checkpointing": True},
        {**base, **w, "lengths": [2 * t], "parallelism": "none", "fc_norm": True, "norm_output": True},
        {**base, **wide, "lengths": [t], "parallelism": "ddp", "encoding": {"aux_dtype": "bfloat16",
                                                                            "teacher": "topk", "teacher_topk": 32}},
    ]  # fmt: skip


def plan_table(sizes: dict, quick: bool) -> dict:
    print(f"\n{'H':>5s} {'tokens':>12s} {'mode':>18s} {'planned MiB':>12s} {'measured MiB':>13s} {'error':>7s}")
    errors = []
    for case in plan_cases(sizes):
        result = run_case(case, in_process=quick)
        error = result["planned_bytes"] / result["measured_bytes"] - 1
        errors.append(abs(error))
        mode = case["parallelism"] + (" +ckpt" if case.get("checkpointing") else "") + (
            f" L{case['num_layers']}" if case.get("num_layers") else "")  # fmt: skip
        print(f"{case['hidden_size']:5d} {'x'.join(map(str, case['lengths'])):>12s} {mode:>18s} "
              f"{result['planned_bytes'] / 2**20:12.1f} {result['measured_bytes'] / 2**20:13.1f} {error:+7.1%}")  # fmt: skip
    print(f"largest plan error: {max(errors):.1%} (goal <= 20%)")
    return {"error_max": max(errors)}


def padding_table() -> dict:
    """Padding waste of the Kimi preset's micro-batches with lengths like a chat dataset's (seeded, so repeatable)."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(400 * 32, generator=g) * 0.6 + math.log(2000)).exp().clamp(128, 4096).long().tolist()
    waste = {}
    for name, budget in (("one micro-batch per rank", 0), ("auto budget, grouped", max(4096, AUTO_MAX_TOKENS))):
        real = computed = 0
        for start in range(0, len(lengths), 4):  # 32 samples a step over 8 ranks: 4 per rank
            share = lengths[start : start + 4]
            for group in split_micro_batches(share, budget):
                real += sum(share[i] for i in group)
                computed += len(group) * max(share[i] for i in group)
        waste[name] = 1 - real / computed
    print("\npadding waste (tokens padded / tokens computed), Kimi preset, 4 samples per rank:")
    for name, value in waste.items():
        print(f"  {name:28s} {value:.3f}")
    return {"waste": waste["auto budget, grouped"], "waste_one_micro_batch": waste["one micro-batch per rank"]}


def scale_job(root: Path, width: dict, length: int, steps: int):
    """A one-process TrainJob over a synthetic run of 2 x steps samples of `length` tokens at `width`."""
    from eyas.config import DraftConfig, TrainConfig, TrainJob
    from eyas.shards.synthetic import SyntheticSpec, write_synthetic_run

    spec = SyntheticSpec(hidden=width["hidden_size"], num_aux=3, vocab=width["target_vocab_size"], min_len=length,
                         max_len=length, aux_layer_ids=(2, 4, 5))  # fmt: skip
    run = write_synthetic_run(root / "run", num_samples=2 * steps, per_shard=4, spec=spec)
    draft = DraftConfig(num_attention_heads=width["num_attention_heads"], num_key_value_heads=width["num_key_value_heads"],
                        head_dim=width["head_dim"], intermediate_size=width["intermediate_size"],
                        max_position_embeddings=length)  # fmt: skip
    train = TrainConfig(num_processes=1, global_batch_size=1, num_ttt_steps=NUM_TTT_STEPS, max_steps=steps,
                        save_every_steps=steps, num_warmup_steps=1)  # fmt: skip
    return TrainJob(target_path=str(run["target"]), shards_dir=str(run["shards"]), vocab_path=str(run["vocab"]),
                    output_dir=str(root / "out"), aux_layer_ids=[2, 4, 5], draft=draft, train=train)  # fmt: skip


def trainer_against_bare(width: dict, length: int, steps: int) -> dict:
    """Seconds of the Trainer's `steps` steps (reading shards, metrics, TensorBoard, a checkpoint) and of a bare loop
    over the same micro-batches, made beforehand, with the same draft (one process, gloo)."""
    import tempfile
    import time

    import torch.distributed as dist

    from eyas.train.data import batch_at, collate
    from eyas.train.parallel import Dist
    from eyas.train.setup import build_setup
    from eyas.train.step import TTTObjective, make_optimizer, make_scheduler, train_step
    from eyas.train.trainer import Trainer

    if not dist.is_initialized():  # --quick measured the other cases in this process, in this group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = scale_job(Path(tmp), width, length, steps)
            warm = job.model_copy(update={"output_dir": str(Path(tmp) / "warm-up"),
                                          "train": job.train.model_copy(update={"max_steps": 1})})  # fmt: skip
            Trainer(warm, Dist(rank=0, world=1, device=torch.device("cpu"))).run()  # kernels and caches warmed
            trainer = Trainer(job, Dist(rank=0, world=1, device=torch.device("cpu")))
            start = time.perf_counter()
            trainer.run()
            trainer_s = time.perf_counter() - start
            setup, t = build_setup(job), job.train
            batches = []  # the samples the trainer's steps read, in its order, collated beforehand
            for step in range(steps):
                ids = batch_at(step, len(setup.samples), 1, t.seed)[1]
                batches.append(collate([setup.samples.load_sample(i) for i in ids], length, min_len=NUM_TTT_STEPS + 1))
            objective = TTTObjective(setup.draft, setup.head_rows, NUM_TTT_STEPS, t.ttt_decay, bf16=False)
            optimizer = make_optimizer(setup.draft, t.lr, t.weight_decay)
            scheduler = make_scheduler(optimizer, t.num_warmup_steps, steps)
            start = time.perf_counter()
            for batch in batches:
                train_step(objective, optimizer, scheduler, [batch], t.max_grad_norm)
            bare_s = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    return {"trainer_s": trainer_s, "bare_s": bare_s, "ratio": bare_s / trainer_s}


def speed_table(sizes: dict, steps: int) -> dict:
    result = trainer_against_bare(sizes["width"], sizes["scale_length"], steps)
    print(f"\ntrainer {result['trainer_s']:.2f} s, bare loop {result['bare_s']:.2f} s for {steps} steps at "
          f"H {sizes['width']['hidden_size']}, T {sizes['scale_length']}: trainer/bare {result['ratio']:.3f} "
          "(goal >= 0.90)")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, the same code paths (for the test suite)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    print(f"host memory available: {host_available_bytes() / GIB:.1f} GiB")
    memory = memory_table(sizes, args.quick)
    plan = plan_table(sizes, args.quick)
    padding = padding_table()
    speed = speed_table(sizes, steps=3 if args.quick else 4)
    print(json.dumps({
        "attention_memory_growth_per_doubling": round(memory["growth"], 4),
        "eager_memory_growth_per_doubling": memory["eager_growth"] and round(memory["eager_growth"], 4),
        "fused_vs_eager_speed": round(memory["speed"], 4),
        "plan_error_max": round(plan["error_max"], 4),
        "padding_waste": round(padding["waste"], 4),
        "padding_waste_one_micro_batch": round(padding["waste_one_micro_batch"], 4),
        "steps_ratio": round(speed["ratio"], 4),
        "trainer_s": round(speed["trainer_s"], 3),
        "bare_s": round(speed["bare_s"], 3),
        "quick": args.quick,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
