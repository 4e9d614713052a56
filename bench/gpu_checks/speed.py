"""The trainer's speed at the Kimi draft's shape against a bare loop, and its model FLOP utilization.

Data: a synthetic run at H 7168, 3 aux layers, a 32,000-token draft vocab (64,000-token target stub), samples of
1,536-2,048 tokens in the preset's shard encoding (eyas.shards.synthetic). eyas's Trainer (one process, the
preset's parallelism, unroll and bf16 autocast) runs `speed_steps` optimizer steps, the first two untimed; the
bare loop runs train_step alone on the same model over micro-batches collated beforehand and already on the
device. trainer/bare (tokens/s) is the loader's and the step's bookkeeping cost. MFU = tokens/s x the draft's training FLOPs
per token (eyas.train.flops, at the token-weighted mean sample length) / a peak: the bf16 dense peak of the
device's data sheet (989 TFLOP/s on an H100 or H200 SXM) and the rate of one large bf16 matrix product measured
here. The trainer runs with train.verify_reads on (the default), then off when time is left.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from eyas.config import TrainConfig, TrainJob
from eyas.shards.synthetic import write_synthetic_run
from eyas.train.flops import train_flops_per_token
from eyas.train.step import train_step
from eyas.train.trainer import Trainer
from gpu_checks.parity import one_process_group
from gpu_checks.runner import CheckContext
from gpu_checks.shapes import kimi_config, sizes

BF16_DENSE_PEAK = {"H100": 989e12, "H200": 989e12}  # FLOP/s, SXM data sheets, without sparsity
UNTIMED_STEPS = 2


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_flops_per_s(device: torch.device, size: int, repeats: int = 10) -> float:
    """The mean rate of a size^3 bf16 matrix product after three warm-ups."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def data_sheet_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_DENSE_PEAK.items() if key in name), None)


def speed_job(run: dict, ctx: CheckContext, *, verify_reads: bool) -> TrainJob:
    s, preset = sizes(ctx.quick), kimi_config().train
    cuda = ctx.device == "cuda"
    train = TrainConfig(
        num_processes=1,
        backend="nccl" if cuda else "gloo",
        global_batch_size=s.speed_batch,
        max_steps=2 * s.speed_steps,  # the trainer's steps, then the bare loop's from the same pipeline
        num_epochs=-(-2 * s.speed_steps * s.speed_batch // s.speed_samples),
        save_every_steps=10 * s.speed_steps,  # no checkpoint is written: the steps are driven one by one
        eval_fraction=0.0,
        num_warmup_steps=1,
        verify_reads=verify_reads,
        parallelism=preset.parallelism,
        num_ttt_steps=preset.num_ttt_steps,
        ttt_decay=preset.ttt_decay,
        mixed_precision=preset.mixed_precision if cuda else "auto",
        lr=preset.lr,
        max_grad_norm=preset.max_grad_norm,
    )
    name = "speed-verified" if verify_reads else "speed-unverified"
    return TrainJob(target_path=str(run["target"]), shards_dir=str(run["shards"]), vocab_path=str(run["vocab"]),
                    output_dir=str(ctx.work / name), aux_layer_ids=list(s.speed_spec.aux_layer_ids),
                    draft=s.speed_draft, train=train)  # fmt: skip


def rate(seconds: list[float], lengths: list[list[int]]) -> dict:
    """Tokens/s over the timed steps, and the token-weighted mean sample length the FLOPs are counted at."""
    flat = [n for step in lengths for n in step]
    return {
        "step_s": sum(seconds) / len(seconds),
        "tokens_per_s": sum(flat) / sum(seconds),
        "mean_length": sum(n * n for n in flat) / sum(flat),
    }


def time_trainer(job: TrainJob, lengths_of, ctx: CheckContext, *, bare: bool) -> dict:
    """`speed_steps` steps of the Trainer through its input pipeline (the first two untimed); with `bare`, then
    train_step alone over the pipeline's next steps, all taken onto the device before the first is timed."""
    s, device = sizes(ctx.quick), torch.device(ctx.device)
    with one_process_group(device) as rank:
        trainer = Trainer(job, rank)
        pipeline = trainer.input_pipeline()
        try:
            seconds, lengths, stalls, record = [], [], [], {}
            for step in range(s.speed_steps):
                started = time.perf_counter()
                record = trainer.train_one_step(started, pipeline)
                synchronize(device)
                if step >= UNTIMED_STEPS:
                    seconds.append(time.perf_counter() - started)
                    lengths.append(lengths_of(record["sample_ids"]))
                    stalls.append(record["data_stall_fraction"])
                    ctx.partial[f"{Path(job.output_dir).name}_step_s"] = list(seconds)
            result = {"trainer": {**rate(seconds, lengths), "data_stall_fraction_max": max(stalls)},
                      "micro_batches": record["micro_batches"], "padding_waste": record["padding_waste"],
                      "peak_memory_bytes": record.get("peak_memory_bytes"), "arch": trainer.draft.arch,
                      "num_ttt_steps": job.train.num_ttt_steps}  # fmt: skip
            if bare:
                result["bare"] = bare_loop(trainer, pipeline, lengths_of, s.speed_steps - UNTIMED_STEPS + 1, device)
        finally:
            pipeline.stop()
            trainer.setup.samples.close()
            pipeline.join()
    return result


def bare_loop(trainer: Trainer, pipeline, lengths_of, num_steps: int, device: torch.device) -> dict:
    """train_step alone on the trainer's model over the pipeline's next steps, all on the device before the first
    runs (the first untimed)."""
    steps = []
    for _ in range(num_steps):
        data = pipeline.next(trainer.consumed)
        trainer.consumed += len(data.ids)
        steps.append(data)
    seconds, t = [], trainer.train_config
    for data in steps:
        started = time.perf_counter()
        train_step(trainer.model, trainer.optimizer, trainer.scheduler, data.micro_batches, t.max_grad_norm)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return rate(seconds[1:], [lengths_of(data.ids) for data in steps[1:]])


def speed(ctx: CheckContext) -> dict:
    s, device = sizes(ctx.quick), torch.device(ctx.device)
    gemm = gemm_flops_per_s(device, s.gemm_size)
    ctx.partial["gemm_flops_per_s"] = gemm
    ctx.log(f"  bf16 matrix product {s.gemm_size}^3: {gemm / 1e12:.1f} TFLOP/s")
    written_from = time.monotonic()
    run = write_synthetic_run(ctx.work / "speed-run", num_samples=s.speed_samples, per_shard=8, spec=s.speed_spec,
                              encoding=s.encoding)  # fmt: skip
    sample_lengths = [int(sample["input_ids"].numel()) for sample in run.pop("samples")]

    def lengths_of(ids: list[int]) -> list[int]:
        return [sample_lengths[i] for i in ids]

    started = time.monotonic()
    ctx.partial["data_written_s"] = round(started - written_from, 1)
    timed = time_trainer(speed_job(run, ctx, verify_reads=True), lengths_of, ctx, bare=True)
    trainer, bare = timed["trainer"], timed["bare"]
    flops = train_flops_per_token(timed["arch"], timed["num_ttt_steps"], trainer["mean_length"])
    peak = data_sheet_peak(device)
    figures = {
        "gemm_flops_per_s": gemm,
        "flops_per_token": flops,
        "trainer": trainer,
        "bare": bare,
        "trainer_vs_bare": trainer["tokens_per_s"] / bare["tokens_per_s"],
        "tokens_per_s": trainer["tokens_per_s"],
        "mfu": trainer["tokens_per_s"] * flops / peak if peak else None,
        "mfu_vs_gemm": trainer["tokens_per_s"] * flops / gemm,
        "bare_mfu": bare["tokens_per_s"] * flops / peak if peak else None,
        "data_sheet_peak_flops_per_s": peak,
        **{k: timed[k] for k in ("micro_batches", "padding_waste", "peak_memory_bytes")},
    }
    ctx.log(f"  trainer {trainer['tokens_per_s']:,.0f} tokens/s, bare {bare['tokens_per_s']:,.0f}; "
            f"{flops / 1e9:.1f} GFLOP/token; MFU {figures['mfu']} (vs the GEMM {figures['mfu_vs_gemm']:.3f})")  # fmt: skip
    ctx.partial.update(figures)
    if ctx.seconds_left() > 1.5 * (time.monotonic() - started):
        unverified = time_trainer(speed_job(run, ctx, verify_reads=False), lengths_of, ctx, bare=False)["trainer"]
        figures["trainer_unverified"] = unverified
        figures["verify_reads_cost"] = unverified["tokens_per_s"] / trainer["tokens_per_s"] - 1
    else:
        figures["trainer_unverified"] = "skipped: too little of the check's limit left"
    return figures
