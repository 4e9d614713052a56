"""Train an EAGLE-3 draft on extracted hidden-state shards, with DDP or FSDP2 (gloo on CPU, nccl on GPUs).

Usage:
    torchrun --nproc_per_node=2 -m eyas.train --config job.json
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-endpoint=HOST:PORT -m eyas.train --config job.json
    python -m eyas.train --config job.json        # one process, no torchrun needed

`job.json` is an `eyas.config.TrainJob`. Each optimizer step takes the next
`train.global_batch_size` samples of the (seed, epoch) order (`eyas.data`), split over the ranks;
the loss is `eyas.draft.ttt_loss`. AdamW updates every parameter except the frozen embed_tokens.
`train.parallelism` picks DDP (a replica per rank) or FSDP2 (sharded; `eyas.parallel`).
Learning rate: linear warmup from lr/warmup_steps to lr over `warmup_steps` steps, then cosine
decay towards 0 at the last step. Steps: `num_epochs` x (samples // global_batch_size), capped by
`max_steps` when it is > 0.

Rank 0 appends one JSON object per step to `output_dir/metrics.jsonl` and prints the same line
to stdout as `EYAS_METRIC {...}` (keys: step, epoch, samples_consumed, loss, loss_k, acc_k, lr,
grad_norm, num_tokens, elapsed_s, sample_ids). Checkpoints go to `output_dir/checkpoints/`
every `save_every_steps` and at the end (`eyas.checkpoint`); a re-run resumes from the newest
complete one, on any world size and under either parallelism, continuing the same sample order.
With `train.checkpoint_copy_url` set, rank 0 copies each complete checkpoint there
(`eyas.checkpoint_copy`), and a run whose output_dir lacks the copy's newest checkpoint (a fresh
machine) restores it before resuming. At the end rank 0 writes `output_dir/final.json` =
{"checkpoint", "step", "final_loss"}.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eyas.checkpoint import latest_complete, load_training_state, read_arch, write_checkpoint
from eyas.checkpoint_copy import copy_checkpoint, open_copy_store, rotate_copies, sync_at_start
from eyas.config import TrainConfig, TrainJob
from eyas.data import ShardSamples, batch_at, collate, rank_slice, steps_per_epoch
from eyas.draft import DraftArch, Eagle3Draft, build_draft, ttt_loss
from eyas.fsio import atomic_write_text
from eyas.parallel import Dist, full_model_state, full_optimizer_state, init_distributed, local_value, parallelize
from eyas.target import load_embed_and_lm_head, target_fingerprint
from eyas.vocab import load_vocab

METRIC_PREFIX = "EYAS_METRIC "
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def load_job(path: str | Path) -> TrainJob:
    return TrainJob.model_validate_json(Path(path).read_text())


@dataclass
class TrainSetup:
    """A fresh draft and everything a step needs, checked against the shards and the target."""

    draft: Eagle3Draft
    head_rows: torch.Tensor  # the target lm_head rows of the draft vocab [Vd, H]
    samples: ShardSamples
    fingerprint: str


def _check_shards(samples: ShardSamples, job: TrainJob, hidden_size: int, fingerprint: str) -> None:
    meta = samples.metadata
    found = (meta["target_fingerprint"], meta["aux_layer_ids"], meta["hidden_size"], meta["num_aux"])
    expected = (fingerprint, job.aux_layer_ids, hidden_size, len(job.aux_layer_ids))
    if found != expected:
        raise ValueError(
            f"shards {job.shards_dir}: (target_fingerprint, aux_layer_ids, hidden_size, num_aux) = {found}, "
            f"expected {expected} from the target {job.target_path} and the job; the shards were extracted "
            f"from another target or with other layers; re-extract or fix the job"
        )


def build_setup(job: TrainJob) -> TrainSetup:
    samples = ShardSamples(job.shards_dir, max_samples=job.max_samples)
    embed, lm_head = load_embed_and_lm_head(job.target_path)
    d2t, t2d, _ = load_vocab(job.vocab_path)
    vocab, hidden = embed.shape
    if lm_head.shape != embed.shape or t2d.numel() != vocab:
        raise ValueError(
            f"target {job.target_path}: embed {list(embed.shape)}, lm_head {list(lm_head.shape)}, vocab t2d "
            f"[{t2d.numel()}]; expected equal shapes and t2d over the target vocab; rebuild the vocab for this target"
        )
    fingerprint = target_fingerprint(job.target_path)
    _check_shards(samples, job, hidden, fingerprint)
    d = job.draft
    arch = DraftArch(
        hidden_size=hidden,
        num_aux=len(job.aux_layer_ids),
        target_vocab_size=vocab,
        draft_vocab_size=d2t.numel(),
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        intermediate_size=d.intermediate_size,
        rms_norm_eps=d.rms_norm_eps,
        rope_theta=d.rope_theta,
        max_position_embeddings=d.max_position_embeddings,
    )
    draft = build_draft(arch, embed, d2t, t2d, seed=job.train.seed)
    head_rows = lm_head[torch.arange(d2t.numel()) + d2t].float()
    return TrainSetup(draft=draft, head_rows=head_rows, samples=samples, fingerprint=fingerprint)


class TTTObjective(nn.Module):
    """The draft plus its loss, so that the wrapper's forward (DDP arms gradient sync, FSDP2 gathers the
    parameters) runs the TTT unroll."""

    def __init__(self, draft: Eagle3Draft, head_rows: torch.Tensor, num_steps: int, decay: float, bf16: bool):
        super().__init__()
        self.draft = draft
        self.head_rows = head_rows  # a plain attribute: constant, neither saved nor broadcast
        self.num_steps, self.decay, self.bf16 = num_steps, decay, bf16

    def forward(self, batch: dict):
        # the soft cross-entropy itself is computed in fp32 inside ttt_loss
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            return ttt_loss(self.draft, batch, self.head_rows, self.num_steps, self.decay)


def use_bf16(mixed_precision: str, device: torch.device) -> bool:
    """auto: bf16 autocast on CUDA, fp32 on CPU; an explicit bf16 without CUDA is refused."""
    if mixed_precision == "bf16" and device.type != "cuda":
        raise ValueError(
            f"train.mixed_precision='bf16' on {device}: bf16 autocast is for CUDA devices; use 'auto' or 'off' on CPU"
        )
    return device.type == "cuda" and mixed_precision != "off"


def make_optimizer(draft: Eagle3Draft, lr: float, weight_decay: float) -> torch.optim.AdamW:
    trainable = [p for p in draft.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)


def make_scheduler(optimizer, warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak lr over `warmup_steps`, then cosine decay towards 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(num_samples: int, train: TrainConfig) -> int:
    steps = train.num_epochs * steps_per_epoch(num_samples, train.global_batch_size)
    return min(steps, train.max_steps) if train.max_steps else steps


def train_step(model: nn.Module, optimizer, scheduler, batch: dict, max_grad_norm: float) -> dict:
    """One optimizer step; returns this rank's per-step stats (tensors) and the lr it used."""
    optimizer.zero_grad(set_to_none=True)
    total, losses, accs, counts = model(batch)
    total.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)  # FSDP2: over all shards (DTensors)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    return {"losses": losses, "accs": accs, "counts": counts, "grad_norm": float(local_value(grad_norm)), "lr": lr}


def reduce_stats(stats: dict, decay: float) -> dict:
    """Token-weighted loss and accuracy per TTT step over all ranks; loss = sum_k decay^k loss_k."""
    counts = torch.stack(stats["counts"]).float()
    table = torch.stack([torch.stack(stats["losses"]) * counts, torch.stack(stats["accs"]) * counts, counts])
    table = table.detach().cpu().double()
    if dist.is_initialized():
        dist.all_reduce(table)
    n = table[2].clamp(min=1.0)
    loss_k, acc_k = (table[0] / n).tolist(), (table[1] / n).tolist()
    return {
        "loss": sum(decay**k * v for k, v in enumerate(loss_k)),
        "loss_k": loss_k,
        "acc_k": acc_k,
        "num_tokens": int(table[2, 0]),
    }


def log(ctx: Dist, message: str) -> None:
    if ctx.rank == 0:
        print(f"[eyas.train] {message}", flush=True)


def resume(job: TrainJob, setup: TrainSetup, optimizer, scheduler, ctx: Dist) -> dict:
    """Restore the newest complete checkpoint; returns its trainer_state (step 0 when there is none)."""
    checkpoint = latest_complete(job.output_dir)
    if checkpoint is None:
        return {"step": 0, "samples_consumed": 0, "loss": None, "checkpoint": None}
    meta = read_arch(checkpoint)
    if (meta["target_fingerprint"], meta["aux_layer_ids"]) != (setup.fingerprint, job.aux_layer_ids):
        raise ValueError(
            f"checkpoint {checkpoint}: target_fingerprint {meta['target_fingerprint']}, aux_layer_ids "
            f"{meta['aux_layer_ids']}; the job has {setup.fingerprint}, {job.aux_layer_ids}; use a new output_dir"
        )
    state = load_training_state(checkpoint, draft=setup.draft, optimizer=optimizer, scheduler=scheduler)
    if state["global_batch_size"] != job.train.global_batch_size:
        raise ValueError(
            f"checkpoint {checkpoint}: saved with train.global_batch_size={state['global_batch_size']}, the job "
            f"has {job.train.global_batch_size}; the data position would shift; restore it or use a new output_dir"
        )
    log(
        ctx,
        f"resumed from {checkpoint} at step {state['step']} ({state['samples_consumed']} samples consumed, "
        f"saved with world size {state['world_size']}, now {ctx.world}; saved under "
        f"{state.get('parallelism', 'ddp')}, now {job.train.parallelism})",
    )
    return {**state, "checkpoint": str(checkpoint)}


def emit_metrics(record: dict, output_dir: Path) -> None:
    line = json.dumps(record)
    with open(output_dir / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    print(METRIC_PREFIX + line, flush=True)


def write_final(output_dir: Path, final: dict) -> None:
    atomic_write_text(output_dir / "final.json", json.dumps(final, indent=2) + "\n")


class Trainer:
    """One rank's training run: built from the job, resumed from the newest complete checkpoint."""

    def __init__(self, job: TrainJob, ctx: Dist):
        t = self.train_config = job.train
        self.job, self.ctx, self.output_dir = job, ctx, Path(job.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.copy_store = open_copy_store(t) if ctx.rank == 0 else None
        if t.checkpoint_copy_url:
            self.sync_copy()
        self.setup = build_setup(job)
        self.draft = self.setup.draft.to(ctx.device)
        bf16 = use_bf16(t.mixed_precision, ctx.device)
        objective = TTTObjective(self.draft, self.setup.head_rows.to(ctx.device), t.ttt_steps, t.ttt_decay, bf16)
        self.model = parallelize(objective, t.parallelism, ctx.device)
        # after parallelize: under FSDP2 the optimizer holds the sharded parameters
        self.optimizer = make_optimizer(self.draft, t.lr, t.weight_decay)
        self.last_step = total_steps(len(self.setup.samples), t)
        self.scheduler = make_scheduler(self.optimizer, t.warmup_steps, self.last_step)
        state = resume(job, self.setup, self.optimizer, self.scheduler, ctx)
        self.step, self.consumed, self.loss = state["step"], state["samples_consumed"], state["loss"]
        self.checkpoint = state["checkpoint"]

    def sync_copy(self) -> None:
        """Rank 0 restores the copy's newest checkpoint (or copies the local newest) while the others wait."""
        if self.copy_store is not None:
            done = sync_at_start(self.copy_store, self.output_dir, self.train_config.keep_last_checkpoints)
            log(self.ctx, done or f"checkpoint copy {self.copy_store.url}: nothing to restore or to copy")
        dist.barrier()  # the other ranks resume from what rank 0 restored

    def next_batch(self) -> tuple[int, list[int], dict]:
        """(epoch, global batch ids, this rank's collated share) after `consumed` samples."""
        t = self.train_config
        epoch, ids = batch_at(self.consumed, len(self.setup.samples), t.global_batch_size, t.seed)
        mine = [self.setup.samples.load_sample(i) for i in rank_slice(ids, self.ctx.rank, self.ctx.world)]
        # ttt_loss needs more columns than TTT steps; padding is masked out, so this changes no result.
        batch = collate(mine, self.job.draft.max_position_embeddings, min_len=t.ttt_steps + 1)
        return epoch, ids, {k: v.to(self.ctx.device) for k, v in batch.items()}

    def train_one_step(self, start: float) -> dict:
        t = self.train_config
        epoch, ids, batch = self.next_batch()
        stats = train_step(self.model, self.optimizer, self.scheduler, batch, t.max_grad_norm)
        self.step, self.consumed = self.step + 1, self.consumed + len(ids)
        record = {
            "step": self.step,
            "epoch": epoch,
            "samples_consumed": self.consumed,
            **reduce_stats(stats, t.ttt_decay),
            "lr": stats["lr"],
            "grad_norm": stats["grad_norm"],
            "elapsed_s": round(time.monotonic() - start, 3),
            "sample_ids": ids,
        }
        self.loss = record["loss"]
        if self.ctx.rank == 0:
            emit_metrics(record, self.output_dir)
        if not math.isfinite(self.loss):  # every rank sees the same all-reduced loss, so all stop together
            raise FloatingPointError(
                f"step {self.step}: loss {self.loss} (per TTT step {record['loss_k']}); training diverged or a "
                f"shard holds non-finite hidden states; run eyas verify in full mode, or lower train.lr={t.lr}"
            )
        return record

    def save(self, epoch: int) -> None:
        """Every rank hands in its part of the full state (FSDP2 gathers it); rank 0 writes the checkpoint
        and copies it while the other ranks wait."""
        t = self.train_config
        model_state = full_model_state(self.draft)
        optimizer_state = full_optimizer_state(self.draft, self.optimizer)
        if self.ctx.rank == 0:
            trainer_state = {
                "samples_consumed": self.consumed,
                "epoch": epoch,
                "world_size": self.ctx.world,
                "parallelism": t.parallelism,
                "global_batch_size": t.global_batch_size,
                "loss": self.loss,
            }
            path = write_checkpoint(
                self.output_dir,
                self.step,
                model_state=model_state,
                optimizer_state=optimizer_state,
                scheduler_state=self.scheduler.state_dict(),
                arch=self.draft.arch,
                trainer_state=trainer_state,
                aux_layer_ids=self.job.aux_layer_ids,
                target_fingerprint=self.setup.fingerprint,
                keep_last=t.keep_last_checkpoints,
            )
            self.checkpoint = str(path)
            if self.copy_store is not None:
                copy_checkpoint(self.copy_store, path)
                rotate_copies(self.copy_store, t.keep_last_checkpoints)
        dist.barrier()

    def run(self) -> dict:
        """Train to the last step, saving on schedule and at the end; returns the final.json contents."""
        log(
            self.ctx,
            f"training steps {self.step + 1}..{self.last_step} on {len(self.setup.samples)} samples, "
            f"world size {self.ctx.world}, {self.train_config.parallelism}",
        )
        start = time.monotonic()
        while self.step < self.last_step:
            record = self.train_one_step(start)
            if self.step % self.train_config.save_every_steps == 0 or self.step == self.last_step:
                self.save(record["epoch"])
        final = {"checkpoint": self.checkpoint, "step": self.step, "final_loss": self.loss}
        if self.ctx.rank == 0:
            write_final(self.output_dir, final)
            log(self.ctx, f"done: step {self.step}, loss {self.loss}, checkpoint {self.checkpoint}")
        return final


def train(job: TrainJob, ctx: Dist) -> dict:
    """Train (resuming if possible) to the last step; returns the final.json contents."""
    return Trainer(job, ctx).run()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eyas.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TrainJob JSON (eyas.config.TrainJob)")
    return parser.parse_args(argv)


def die_with_launcher() -> None:
    """Under torchrun (Linux), have the kernel SIGKILL this worker when the launcher dies.

    torchrun starts each worker in a session of its own, so killing the launcher (a cancelled
    flow, `kill -9`) would otherwise leave orphans that go on training and hold their GPUs.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG, SIGKILL) failed for the eyas.train worker")
    if os.getppid() == 1:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    job = load_job(parse_args(argv).config)
    die_with_launcher()
    ctx = init_distributed(job.train.backend)
    try:
        train(job, ctx)
    finally:
        dist.destroy_process_group()
    return 0


def exit_without_finalizing(code: int) -> None:
    """Leave at once after a finished run, skipping interpreter finalization.

    A gloo worker thread can still be dropping the last reference to a finished collective (whose tensors
    are Python objects) when the main thread returns; if Python is finalizing by then, the thread aborts the
    process (SIGABRT, "terminate called without an active exception"; 4 of 90 two-rank runs on a loaded
    2-core machine, none of 90 with this exit). Everything the trainer writes is durable before this
    point; stdio is flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalizing(main())  # an exception raised by main() propagates as usual
