"""Trainer overhead: eyas.train's steps/s as a ratio to a minimal in-memory loop of the same model and batch.

Usage: .venv/bin/python bench/train.py [--steps 40] [--quick]

The trainer runs in-process as one rank (gloo), reading memory-mapped shards, logging metrics and
writing checkpoints every `steps // 4` steps. The baseline trains the same draft on batches that
are already collated in memory, with nothing else. Goal: steps_ratio >= 0.90 (loader, logging and
checkpoints cost at most 10%). The trainer runs again with `train.verify_reads` off (the default checks each
shard's XXH3 against the manifest when it is first opened): `verify_reads_cost` is the fraction of the
trainer's time those checked reads add. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.config import DraftConfig, TrainConfig, TrainJob
from eyas.shards.synthetic import SyntheticSpec, write_synthetic_run
from eyas.train.data import batch_at, collate
from eyas.train.parallel import Dist
from eyas.train.setup import build_setup
from eyas.train.step import TTTObjective, make_optimizer, make_scheduler, train_step
from eyas.train.trainer import Trainer

SPEC = SyntheticSpec(hidden=128, num_aux=3, vocab=2048, min_len=96, max_len=128, aux_layer_ids=(2, 4, 5))


def make_job(root: Path, steps: int) -> TrainJob:
    run = write_synthetic_run(root / "run", num_samples=64, per_shard=16, spec=SPEC)
    train = TrainConfig(
        num_processes=1,
        global_batch_size=8,
        lr=1e-3,
        num_warmup_steps=2,
        num_ttt_steps=4,
        num_epochs=1 + steps // 8,
        max_steps=steps,
        save_every_steps=max(1, steps // 4),
    )
    draft = DraftConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=512)
    return TrainJob(
        target_path=str(run["target"]),
        shards_dir=str(run["shards"]),
        vocab_path=str(run["vocab"]),
        output_dir=str(root / "out"),
        aux_layer_ids=list(SPEC.aux_layer_ids),
        draft=draft,
        train=train,
    )


def time_trainer(job: TrainJob) -> float:
    trainer = Trainer(job, Dist(rank=0, world=1, device=torch.device("cpu")))
    start = time.perf_counter()
    trainer.run()
    return time.perf_counter() - start


def time_minimal(job: TrainJob, steps: int) -> float:
    setup = build_setup(job)  # the same fresh draft (same seed) and target rows
    t = job.train
    n = len(setup.samples)
    batches = []
    for s in range(steps):
        _, ids = batch_at(s * t.global_batch_size, n, t.global_batch_size, t.seed)
        batches.append(collate([setup.samples.load_sample(i) for i in ids], 2048, min_len=t.num_ttt_steps + 1))
    objective = TTTObjective(setup.draft, setup.head_rows, t.num_ttt_steps, t.ttt_decay, bf16=False)
    optimizer = make_optimizer(setup.draft, t.lr, t.weight_decay)
    scheduler = make_scheduler(optimizer, t.num_warmup_steps, steps)
    start = time.perf_counter()
    for batch in batches:
        train_step(objective, optimizer, scheduler, [batch], t.max_grad_norm)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="2 steps: seconds, the same code path (the test suite)")
    args = parser.parse_args()
    args.steps = 2 if args.quick else args.steps
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = make_job(Path(tmp), args.steps)
            minimal_s = time_minimal(job, args.steps)
            trainer_s = time_trainer(job)  # verify_reads on, the default
            unchecked = job.model_copy(update={"output_dir": str(Path(tmp) / "out-unchecked"),
                                               "train": job.train.model_copy(update={"verify_reads": False})})  # fmt: skip
            unchecked_s = time_trainer(unchecked)
    finally:
        dist.destroy_process_group()
    ratio = minimal_s / trainer_s
    print(f"{'loop':28s} {'seconds':>8s} {'steps/s':>8s}")
    print(f"{'minimal in-memory loop':28s} {minimal_s:8.2f} {args.steps / minimal_s:8.2f}")
    print(f"{'eyas trainer':28s} {trainer_s:8.2f} {args.steps / trainer_s:8.2f}")
    print(f"{'eyas trainer, unchecked reads':28s} {unchecked_s:8.2f} {args.steps / unchecked_s:8.2f}")
    print(f"steps_ratio (trainer / minimal, goal >= 0.90): {ratio:.3f}")
    print(f"verify_reads_cost (checked / unchecked - 1): {trainer_s / unchecked_s - 1:.3f}")
    print(
        json.dumps(
            {
                "steps_ratio": round(ratio, 4),
                "steps": args.steps,
                "minimal_s": round(minimal_s, 3),
                "trainer_s": round(trainer_s, 3),
                "trainer_unchecked_s": round(unchecked_s, 3),
                "verify_reads_cost": round(trainer_s / unchecked_s - 1, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
