"""The smoke run: overfit a fresh draft on a handful of samples before the gate, where training will run.

    result = smoke_run(config, facts)          # the stage entry: raises SmokeRunFailed when the loss does not fall
    result = smoke_train(job, smoke, device)   # job: TrainJob, smoke: SmokeConfig, device: cpu or cuda:N
    python -m eyas.train.smoke --job job.json --smoke smoke.json --device cuda:0    # a GPU run's smoke process

It trains `smoke.num_steps` steps, each on the same batch of the first `smoke.num_samples` samples (in
token-budget micro-batches, as the trainer does), at the constant learning rate `smoke.lr` (no warmup, no
decay), and passes when the mean loss of the last 5 steps is below (1 - `smoke.min_loss_drop`) x the mean of
the first 5. The draft is saved as a normal checkpoint in `job.output_dir` (so it can be exported and
benchmarked; the seconds the save took are recorded) and the result as `job.output_dir/smoke.json`.

Where it runs: a GPU run (train.backend nccl) smokes in a process of its own on the first visible GPU, after the
device preflight, in the training precision and at the run's real shape, so its tokens/s are the device's and the
gate's estimate scales them; no GPU run trains on the CPU. A CPU run smokes in this process, refused first when
its planned cost (eyas.train.flops at this host's measured matrix-product rate) exceeds smoke.max_cpu_minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eyas.config import RunConfig, SmokeConfig, TrainJob
from eyas.facts import RunFacts
from eyas.fsio import atomic_write_text, read_json_record
from eyas.train.checkpoint import TRAINER_STATE_FILE, list_checkpoints, save_checkpoint
from eyas.train.data import collate, padded_length, split_micro_batches
from eyas.train.flops import matmul_flops_per_s, train_flops_per_token
from eyas.train.launch import train_job, write_train_job
from eyas.train.memory_plan import PlanShape, device_bytes, pick_micro_batch_tokens
from eyas.train.modules import module_table
from eyas.train.setup import build_setup
from eyas.train.step import TTTObjective, make_optimizer, reduce_stats, train_step, use_bf16

LOSS_WINDOW = 5
SMOKE_FILE = "smoke.json"
PROGRESS_INTERVAL_S = 30
CPU_EFFICIENCY = 0.5  # of the host's best matrix-product rate a training step sustains, for the cost bound


@dataclass
class SmokeResult:
    losses: list[float]
    tokens_per_s: float  # real (unpadded) tokens of the batch over the median step time after the first
    device: str  # where it ran (the estimate at the gate scales this speed)
    precision: str  # fp32 | bf16
    first: float  # mean loss of the first LOSS_WINDOW steps
    last: float  # mean loss of the last LOSS_WINDOW steps
    passed: bool
    seconds: float
    save_s: float  # the checkpoint save, at the run's real shape
    peak_bytes: int  # measured on CUDA (max_memory_allocated); 0 on CPU
    micro_batches: int
    checkpoint: str
    modules: list[dict]  # module_table of the trained draft
    num_steps: int
    num_samples: int
    min_loss_drop: float

    def to_dict(self) -> dict:
        return asdict(self)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _clear_previous_smoke(output_dir: Path) -> None:
    """Delete checkpoints of earlier smoke runs (so this one is the newest); refuse real training ones."""
    for _, path, complete in list_checkpoints(output_dir):
        state_file = path / TRAINER_STATE_FILE
        if complete and not json.loads(state_file.read_text()).get("smoke", False):
            raise ValueError(
                f"smoke output_dir {output_dir}: holds training checkpoint {path.name}; the smoke run would mix "
                f"its checkpoint with a real run's; give the smoke run its own output_dir"
            )
        shutil.rmtree(path)


def _micro_batches(job: TrainJob, samples: list[dict], arch, encoding, device: torch.device, bf16: bool) -> list[dict]:
    """The smoke batch split as the trainer splits a rank's share: at train.max_tokens_per_micro_batch, or the
    budget the memory plan fits on this device for one plain process."""
    t, max_len, min_len = job.train, job.draft.max_position_embeddings, job.train.num_ttt_steps + 1
    lengths = [padded_length(int(s["input_ids"].shape[0]), max_len, min_len) for s in samples]
    budget = t.max_tokens_per_micro_batch
    if not budget:
        shape = PlanShape(arch=arch, num_ttt_steps=t.num_ttt_steps, bf16=bf16, parallelism="none", world=1,
                          checkpointing=t.activation_checkpointing, encoding=encoding, longest_sample=max(lengths),
                          share_tokens=len(lengths) * max(lengths))  # fmt: skip
        budget = pick_micro_batch_tokens(shape, device_bytes(device)) or max(lengths)
    groups = split_micro_batches(lengths, budget)
    return [
        {k: v.to(device) for k, v in collate([samples[i] for i in g], max_len, min_len=min_len).items()} for g in groups
    ]


def smoke_train(job: TrainJob, smoke: SmokeConfig, device: torch.device | str = "cpu") -> SmokeResult:
    """Overfit a fresh draft on the first `smoke.num_samples` samples on `device`; see the module docstring."""
    start, device = time.monotonic(), torch.device(device)
    output_dir = Path(job.output_dir)
    setup = build_setup(job.model_copy(update={"max_samples": 0}))
    if smoke.num_samples > len(setup.samples):
        raise ValueError(
            f"smoke.num_samples={smoke.num_samples}: the shards hold only {len(setup.samples)} samples; lower it"
        )
    _clear_previous_smoke(output_dir)
    t = job.train
    try:  # with train.cache_bytes the samples come through a shard cache, whose thread ends here
        setup.samples.plan(list(range(smoke.num_samples)))
        samples = [setup.samples.load_sample(i) for i in range(smoke.num_samples)]
    finally:
        setup.samples.close()
    bf16 = use_bf16(t.mixed_precision, device)
    draft = setup.draft.to(device)
    draft.embed_tokens.to(torch.bfloat16 if bf16 else torch.float32)
    head_rows = setup.head_rows.to(device, torch.bfloat16 if bf16 else torch.float32)
    batches = _micro_batches(job, samples, draft.arch, setup.samples.meta.encoding, device, bf16)
    optimizer = make_optimizer(draft, smoke.lr, t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    objective = TTTObjective(draft, head_rows, t.num_ttt_steps, t.ttt_decay, bf16,
                             checkpointing=t.activation_checkpointing)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_s, shown = [], [], time.monotonic()
    for step in range(1, smoke.num_steps + 1):
        step_start = time.perf_counter()
        stats = train_step(objective, optimizer, scheduler, batches, t.max_grad_norm)
        losses.append(reduce_stats(stats, t.ttt_decay)["loss"])  # a host value: the step is done
        step_s.append(time.perf_counter() - step_start)
        if time.monotonic() - shown >= PROGRESS_INTERVAL_S:
            print(f"smoke run on {device}: step {step}/{smoke.num_steps}, loss {losses[-1]:.4f}", flush=True)
            shown = time.monotonic()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    window = min(LOSS_WINDOW, smoke.num_steps // 2)
    first, last = _mean(losses[:window]), _mean(losses[-window:])
    trainer_state = {
        "samples_consumed": smoke.num_steps * smoke.num_samples,
        "epoch": 0,
        "world_size": 1,
        "global_batch_size": smoke.num_samples,
        "loss": losses[-1],
        "smoke": True,
    }
    save_start = time.perf_counter()
    checkpoint = save_checkpoint(
        output_dir,
        smoke.num_steps,
        draft=draft,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=trainer_state,
        aux_layer_ids=job.aux_layer_ids,
        target_fingerprint=setup.fingerprint,
        keep_last=t.num_checkpoints_kept,
    )
    result = SmokeResult(
        losses=losses,
        tokens_per_s=round(sum(int(b["valid"].sum()) for b in batches) / statistics.median(step_s[1:] or step_s), 1),
        device=str(device),
        precision="bf16" if bf16 else "fp32",
        first=first,
        last=last,
        passed=last < (1 - smoke.min_loss_drop) * first,
        seconds=round(time.monotonic() - start, 3),
        save_s=round(time.perf_counter() - save_start, 3),
        peak_bytes=peak,
        micro_batches=len(batches),
        checkpoint=str(checkpoint),
        modules=module_table(draft),
        num_steps=smoke.num_steps,
        num_samples=smoke.num_samples,
        min_loss_drop=smoke.min_loss_drop,
    )
    atomic_write_text(output_dir / SMOKE_FILE, json.dumps(result.to_dict(), indent=2) + "\n")
    return result


class SmokeRunFailed(RuntimeError):
    """The smoke run's loss did not fall: the features or the objective are wrong."""


def check_cpu_cost(config: RunConfig, facts: RunFacts, *, flops_per_s: float | None = None) -> float:
    """The CPU smoke run's estimated seconds; refused (ValueError) above smoke.max_cpu_minutes, before it starts."""
    s, shape = config.smoke, PlanShape.of_run(config, facts.target, world=1, parallelism="none")
    lengths = [min(n, config.draft.max_position_embeddings) for n in facts.sample_lengths()[: s.num_samples]]
    per_token = train_flops_per_token(shape.arch, config.train.num_ttt_steps, _mean(lengths))
    total = s.num_steps * sum(lengths) * per_token
    rate = (flops_per_s or matmul_flops_per_s()) * CPU_EFFICIENCY
    seconds = total / rate
    if seconds > s.max_cpu_minutes * 60:
        raise ValueError(
            f"smoke run on CPU: {s.num_steps} steps on {s.num_samples} samples ({sum(lengths):,} tokens) of this draft "
            f"are {total / 1e12:,.1f} TFLOP, about {seconds / 60:,.0f} minutes at this host's {rate / 1e9:,.1f} "
            f"GFLOP/s, over smoke.max_cpu_minutes={s.max_cpu_minutes:g}; train on GPUs (train.backend='nccl': the "
            f"smoke then runs on a training GPU), lower smoke.num_samples or smoke.num_steps, or raise "
            f"smoke.max_cpu_minutes"
        )
    return seconds


def smoke_on_gpu(job: TrainJob, smoke: SmokeConfig) -> dict:
    """Run the smoke in a process of its own on the first visible GPU (the flow process never touches CUDA, so
    it holds no device memory while training runs); returns smoke.json."""
    output_dir = Path(job.output_dir)
    job_path = write_train_job(job, output_dir / "smoke-job.json")
    smoke_path = output_dir / "smoke-config.json"
    atomic_write_text(smoke_path, smoke.model_dump_json())
    (output_dir / SMOKE_FILE).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "eyas.train.smoke", "--job", str(job_path), "--smoke", str(smoke_path),
           "--device", "cuda:0"]  # fmt: skip
    log_path = output_dir / "smoke.log"
    with (
        open(log_path, "w") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:  # its progress lines, at most one every 30 s
            log.write(line)
            print(line, end="", flush=True)
    result = read_json_record(output_dir / SMOKE_FILE)
    if proc.returncode != 0 or result is None:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-20:])
        raise SmokeRunFailed(f"smoke run on cuda:0 exited with {proc.returncode}; last lines of {log_path}:\n{tail}")
    return result


def smoke_run(config: RunConfig, facts: RunFacts) -> SmokeResult | dict:
    """The stage entry: the smoke run of this run's config and shards, in RUN/smoke, on a training GPU for a GPU
    run; refuses a loss that did not fall by smoke.min_loss_drop."""
    job = train_job(config, facts, output_dir=config.paths.smoke_dir, max_samples=config.smoke.num_samples)
    if config.train.backend == "nccl":
        result = SmokeResult(**smoke_on_gpu(job, config.smoke))
    else:
        check_cpu_cost(config, facts)
        result = smoke_train(job, config.smoke)
    if not result.passed:
        s = config.smoke
        raise SmokeRunFailed(
            f"smoke run: loss went {result.first:.3f} -> {result.last:.3f} in {s.num_steps} steps on "
            f"{s.num_samples} samples, expected a drop of at least {s.min_loss_drop:.0%}; "
            f"the features or the objective are wrong: check the shard widths and the vocab mapping"
        )
    return result


def read_smoke_result(smoke_dir: str | Path) -> dict | None:
    """smoke.json of a smoke run (SmokeResult's fields), or None when there was none."""
    return read_json_record(Path(smoke_dir) / SMOKE_FILE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eyas.train.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="TrainJob JSON")
    parser.add_argument("--smoke", required=True, help="SmokeConfig JSON")
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N")
    args = parser.parse_args(argv)
    job = TrainJob.model_validate_json(Path(args.job).read_text())
    result = smoke_train(job, SmokeConfig.model_validate_json(Path(args.smoke).read_text()), args.device)
    print(f"smoke run on {result.device}: loss {result.first:.3f} -> {result.last:.3f}, {result.tokens_per_s} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
