"""The trainer: one rank's training run of an EAGLE-3 draft on extracted hidden-state shards.

Each optimizer step takes the next `train.global_batch_size` samples of the (seed, epoch) order
(eyas.train.data), split over the ranks, and each rank's share into micro-batches of at most
`train.max_tokens_per_micro_batch` tokens (the memory plan picks it when 0: eyas.train.memory_plan); one step
is eyas.train.step.train_step, the loss `eyas.objective.ttt_loss`. AdamW updates every parameter except the
frozen embed_tokens, which every rank holds in the training dtype. `train.parallelism` picks DDP (a replica per rank) or
FSDP2 (sharded; eyas.train.parallel). Learning rate: linear warmup from lr/num_warmup_steps to lr over
`num_warmup_steps` steps, then cosine decay towards 0 at the last step.

A rank's next steps are read, collated and pinned (on CUDA) in a background thread, `train.prefetch_steps` ahead,
while the current one trains, then copied to the device without blocking, float8 aux decoded there
(eyas.train.input_pipeline; 0 reads in the loop, to the same weights). Rank 0 appends one metric record per step
(eyas.train.metrics), with the seconds the step waited for its input. Checkpoints go to
`output_dir/checkpoints/` every `save_every_steps` and at the end (eyas.train.checkpoint); a re-run
resumes from the newest complete one whose files match the checksums of its COMPLETE record (a damaged one is set
aside, and the log names its file and the older checkpoint taken instead: eyas.train.checkpoint_fallback), on any
world size and under either parallelism, continuing the same sample order. With `train.checkpoint_copy_url` set,
rank 0 copies each complete checkpoint there (eyas.train.checkpoint_copy), and a run whose output_dir lacks the copy's newest checkpoint (a fresh
machine) restores it before resuming. At the end rank 0 writes `output_dir/final.json` =
{"checkpoint", "step", "final_loss"}. The process entry is eyas/train/__main__.py.

With `train.cache_bytes` > 0 every rank reads the shards from storage through its own bounded cache in
`output_dir/shard-cache/rank-R` (eyas.shards.cache), planned with the samples it will read from the resumed
position to the last step (eyas.train.data.rank_schedule), so the cache fetches ahead of the order; with
`train.shuffle_window_shards` the order is shard-local. A cached run trains on the same bytes as one from a
local copy: the same weights, bit for bit.

Each node's local rank 0 records its node in `output_dir/nodes/` for `eyas status`, and `eyas stop` ends the run on
every rank after the same step (eyas.train.nodes), with a checkpoint saved at that step: what was trained since the
last one is kept and a resume continues from there, and the save is the same atomic one as any other.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from eyas.config import TrainJob
from eyas.fsio import atomic_write_text
from eyas.train.checkpoint import (
    FINAL_FILE,
    load_training_state,
    read_arch,
    read_best,
    update_best,
    write_checkpoint,
)
from eyas.train.checkpoint_copy import copy_checkpoint, open_copy_store, rotate_copies, sync_at_start
from eyas.train.checkpoint_fallback import resume_checkpoint
from eyas.train.checkpoint_verify import CheckpointError
from eyas.train.data import TrainSplit, rank_schedule, rank_slice, total_steps
from eyas.train.evaluate import EVAL_KEYS, add_stats, summarize_eval
from eyas.train.input_pipeline import InputPipeline, RankSteps, host_micro_batches, to_device
from eyas.train.metrics import emit_metrics, truncate_metrics
from eyas.train.nodes import NodeRecorder, StopWatch, agree_launch_id, record_stopped
from eyas.train.parallel import Dist, full_model_state, full_optimizer_state, parallelize, reshard
from eyas.train.setup import TrainSetup, build_setup, micro_batch_budget, sample_windows
from eyas.train.step import TTTObjective, make_optimizer, make_scheduler, reduce_stats, train_step, use_bf16
from eyas.train.tensorboard import TensorBoardLog


def log(ctx: Dist, message: str) -> None:
    if ctx.rank == 0:
        print(f"[eyas.train] {message}", flush=True)


def agreed_checkpoint(job: TrainJob, ctx: Dist) -> Path | None:
    """Rank 0 picks the newest complete checkpoint that verifies (eyas.train.checkpoint_fallback: a damaged one is
    set aside, and the log names it and the one taken instead); every rank gets rank 0's pick, or its error."""
    choice: list = [None]
    if ctx.rank == 0:
        try:
            checkpoint = resume_checkpoint(job.output_dir, log=lambda line: log(ctx, line))
            choice = [("ok", str(checkpoint) if checkpoint is not None else None)]
        except CheckpointError as err:
            choice = [("error", str(err))]
    dist.broadcast_object_list(choice, src=0)
    outcome, value = choice[0]
    if outcome == "error":
        raise CheckpointError(value)
    return Path(value) if value is not None else None


def resume(job: TrainJob, setup: TrainSetup, optimizer, scheduler, ctx: Dist) -> dict:
    """Restore the newest complete checkpoint that verifies; returns its trainer_state (step 0 when there is none)."""
    checkpoint = agreed_checkpoint(job, ctx)
    if checkpoint is None:
        return {"step": 0, "samples_consumed": 0, "loss": None, "checkpoint": None}
    meta = read_arch(checkpoint)
    if (meta["target_fingerprint"], meta["aux_layer_ids"]) != (setup.fingerprint, job.aux_layer_ids):
        raise ValueError(
            f"checkpoint {checkpoint}: target_fingerprint {meta['target_fingerprint']}, aux_layer_ids "
            f"{meta['aux_layer_ids']}; the job has {setup.fingerprint}, {job.aux_layer_ids}; use a new output_dir"
        )
    # rank 0 checked every file a moment ago; the other ranks check what they read themselves
    state = load_training_state(
        checkpoint,
        draft=setup.draft,
        optimizer=optimizer,
        scheduler=scheduler,
        verified=ctx.rank == 0,
        log=lambda line: log(ctx, line),
    )
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


def write_final(output_dir: Path, final: dict) -> None:
    atomic_write_text(output_dir / FINAL_FILE, json.dumps(final, indent=2) + "\n")


class Trainer:
    """One rank's training run: built from the job, resumed from the newest complete checkpoint."""

    def __init__(self, job: TrainJob, ctx: Dist):
        t = self.train_config = job.train
        self.job, self.ctx, self.output_dir = job, ctx, Path(job.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.copy_store = open_copy_store(t) if ctx.rank == 0 else None
        if t.checkpoint_copy_url:
            self.sync_copy()
        self.setup = build_setup(job, ctx.rank)
        self.split = TrainSplit.of(len(self.setup.samples), t.eval_fraction)
        self.num_train = len(self.split.train_ids)
        self.windows = self.split.windows(sample_windows(self.setup.samples, job))
        self.draft = self.setup.draft.to(ctx.device)
        bf16 = use_bf16(t.mixed_precision, ctx.device)
        dtype = torch.bfloat16 if bf16 else torch.float32
        self.draft.embed_tokens.to(dtype)  # frozen: held once per rank in the training dtype, never gathered
        head_rows = self.setup.head_rows.to(ctx.device, dtype)
        checkpointing = t.activation_checkpointing
        objective = TTTObjective(self.draft, head_rows, t.num_ttt_steps, t.ttt_decay, bf16, checkpointing=checkpointing)
        self.model = parallelize(objective, t.parallelism, ctx.device, bf16=bf16)
        self.micro_batch_tokens = micro_batch_budget(job, self.setup, ctx)
        # after parallelize: under FSDP2 the optimizer holds the sharded parameters
        self.optimizer = make_optimizer(self.draft, t.lr, t.weight_decay)
        self.last_step = total_steps(len(self.setup.samples), t)
        self.scheduler = make_scheduler(self.optimizer, t.num_warmup_steps, self.last_step)
        restore_start = time.monotonic()
        state = resume(job, self.setup, self.optimizer, self.scheduler, ctx)
        if state["checkpoint"]:
            log(ctx, f"checkpoint restored in {time.monotonic() - restore_start:.1f} s")
        self.step, self.consumed, self.loss = state["step"], state["samples_consumed"], state["loss"]
        self.last_eval, self.tokens_seen = state.get("eval"), 0
        if ctx.rank == 0:  # the steps after the checkpoint are trained again: their old records go
            truncate_metrics(self.output_dir, self.step)
            update_best(self.output_dir)  # mends a marker a kill left behind its newest checkpoint
        self.checkpoint = state["checkpoint"]
        self.tensorboard = TensorBoardLog(self.output_dir, self.step) if t.tensorboard and ctx.rank == 0 else None
        self.nodes = NodeRecorder(self.output_dir, agree_launch_id(ctx.rank))
        self.stop_watch = StopWatch(self.output_dir, ctx.device)
        schedule = rank_schedule(self.consumed, self.last_step, self.num_train, t, ctx.rank, ctx.world, self.windows)
        self.setup.samples.plan([self.split.train_ids[i] for i in schedule])

    def sync_copy(self) -> None:
        """Rank 0 restores the copy's newest checkpoint (or copies the local newest) while the others wait."""
        if self.copy_store is not None:
            started = time.monotonic()
            keep, say = self.train_config.num_checkpoints_kept, (lambda line: log(self.ctx, line))
            done = sync_at_start(self.copy_store, self.output_dir, keep, log=say)
            seconds = f" ({time.monotonic() - started:.1f} s)"
            log(self.ctx, (done or f"checkpoint copy {self.copy_store.url}: nothing to restore or to copy") + seconds)
        dist.barrier()  # the other ranks resume from what rank 0 restored

    def micro_batches(self, samples: list[dict], min_len: int) -> list[dict]:
        """Samples (aux as stored) in micro-batches on the device, aux decoded there (the held-out evaluation)."""
        meta, pin = self.setup.samples.meta, self.ctx.device.type == "cuda"
        batches = host_micro_batches(samples, max_len=self.job.draft.max_position_embeddings, min_len=min_len,
                                     micro_batch_tokens=self.micro_batch_tokens, pin_memory=pin)  # fmt: skip
        return [to_device(b, self.ctx.device, meta.encoding, num_aux=meta.num_aux) for b in batches]

    def input_pipeline(self) -> InputPipeline:
        """This rank's steps from the resumed position to the last, train.prefetch_steps ahead."""
        t, meta, device = self.train_config, self.setup.samples.meta, self.ctx.device
        steps = RankSteps(self.setup.samples, self.split.train_ids, t, self.windows, self.ctx.rank, self.ctx.world,
                          max_len=self.job.draft.max_position_embeddings, micro_batch_tokens=self.micro_batch_tokens,
                          pin_memory=device.type == "cuda")  # fmt: skip
        positions = range(self.consumed, self.last_step * t.global_batch_size, t.global_batch_size)
        return InputPipeline(steps, positions, depth=t.prefetch_steps, device=device, encoding=meta.encoding,
                             num_aux=meta.num_aux)  # fmt: skip

    def saves_now(self) -> bool:
        return self.step % self.train_config.save_every_steps == 0 or self.step == self.last_step

    def eval_due(self) -> bool:
        """Held out samples exist, and this step is a checkpoint (always evaluated) or on eval_every_steps."""
        every = self.train_config.eval_every_steps
        return bool(self.split.eval_ids) and (self.saves_now() or bool(every) and self.step % every == 0)

    def eval_batches(self) -> list[list[int]]:
        """The held-out ids in global batches of train.global_batch_size (the last one may be smaller, even
        smaller than the world: `evaluate` gives a rank without a sample a forward it does not count)."""
        ids, size = list(self.split.eval_ids), self.train_config.global_batch_size
        return [ids[i : i + size] for i in range(0, len(ids), size)]

    def evaluate(self) -> dict:
        """The held-out split's accuracy per position and estimated tau (eyas.train.evaluate), all ranks summed."""
        t, total = self.train_config, None
        num_steps = max(t.num_ttt_steps, self.job.chain_steps)
        world, rank = self.ctx.world, self.ctx.rank
        with torch.no_grad():
            for ids in self.eval_batches():
                mine = rank_slice(ids, rank, world) if len(ids) >= world else ids[rank : rank + 1]
                # fewer held-out samples than ranks: a rank without one still runs the forward (FSDP2's
                # collectives need every rank) on the batch's first sample, and counts nothing of it
                samples = [self.setup.samples.load_sample(i, decoded=False) for i in mine or ids[:1]]
                for batch in self.micro_batches(samples, min_len=num_steps + 1):
                    stats = self.model(batch, num_steps, self.job.chain_steps)
                    if not mine:
                        stats = {k: torch.zeros_like(stats[k]) for k in EVAL_KEYS}
                    total = add_stats(total, stats)
        reshard(self.model)
        flat = torch.cat([total[k] for k in EVAL_KEYS]).to(self.ctx.device)
        if dist.is_initialized():
            dist.all_reduce(flat)
        flat = flat.cpu()
        sizes = [total[k].numel() for k in EVAL_KEYS]
        summed = dict(zip(EVAL_KEYS, flat.split(sizes)))
        return summarize_eval(summed, self.job.chain_steps, t.ttt_decay, t.num_ttt_steps)

    def train_one_step(self, start: float, pipeline: InputPipeline) -> dict:
        t = self.train_config
        step_start = time.perf_counter()
        data = pipeline.next(self.consumed)
        epoch, ids = data.epoch, data.ids
        stats = train_step(self.model, self.optimizer, self.scheduler, data.micro_batches, t.max_grad_norm)
        self.step, self.consumed = self.step + 1, self.consumed + len(ids)
        reduced = reduce_stats(stats, t.ttt_decay)  # its all-reduce ends the step on every rank
        step_s, elapsed = time.perf_counter() - step_start, time.monotonic() - start
        record = {
            "step": self.step,
            "epoch": epoch,
            "samples_consumed": self.consumed,
            **reduced,
            "lr": stats["lr"],
            "grad_norm": stats["grad_norm"],
            "micro_batches": stats["num_micro_batches"],
            "elapsed_s": round(elapsed, 3),
            "data_wait_s": round(data.wait_s, 4),
            "data_stall_fraction": round(data.wait_s / max(step_s, 1e-9), 4),
            "sample_ids": ids,
        }
        self.tokens_seen += record["num_tokens"]
        record["tokens_per_s"] = round(self.tokens_seen / max(elapsed, 1e-9), 1)
        if self.ctx.device.type == "cuda":  # this rank's peak so far, to hold against the memory plan
            record["peak_memory_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        if self.eval_due():
            record["eval"] = self.evaluate()
            self.last_eval = record["eval"]
        self.loss = record["loss"]
        if self.ctx.rank == 0:
            emit_metrics(record, self.output_dir)
        if self.tensorboard is not None:
            self.tensorboard.add(record)
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
            started = time.monotonic()
            trainer_state = {
                "samples_consumed": self.consumed,
                "epoch": epoch,
                "world_size": self.ctx.world,
                "parallelism": t.parallelism,
                "global_batch_size": t.global_batch_size,
                "loss": self.loss,
                "eval": self.last_eval if self.split.eval_ids else None,
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
                keep_last=t.num_checkpoints_kept,
            )
            self.checkpoint, written = str(path), time.monotonic()
            if self.copy_store is not None:
                copy_checkpoint(self.copy_store, path)
                rotate_copies(self.copy_store, t.num_checkpoints_kept)
            self.log_save(path, written - started, time.monotonic() - written)
            self.log_cache()
        dist.barrier()

    def log_save(self, path: Path, write_s: float, copy_s: float) -> None:
        """How long the other ranks waited for rank 0's save, against the collective timeout they wait under."""
        size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
        copied = f", copied in {copy_s:.1f} s" if self.copy_store is not None else ""
        timeout = self.train_config.collective_timeout_s
        risk = " (over half of train.collective_timeout_s: raise it)" if write_s + copy_s > timeout / 2 else ""
        log(self.ctx, f"checkpoint {path.name}: {size / 2**30:.2f} GiB written in {write_s:.1f} s{copied}{risk}")

    def log_cache(self) -> None:
        cache = self.setup.samples.cache
        if cache is not None:
            s = cache.stats
            log(
                self.ctx,
                f"shard cache (rank 0): {s.fetched} shards fetched ({s.fetched_bytes / 2**20:.1f} MiB), {s.evicted} "
                f"evicted, {s.wait_s:.1f} s waited, {cache.bytes_on_disk() / 2**20:.1f} MiB on disk of "
                f"{self.train_config.cache_bytes / 2**20:.1f} MiB",
            )

    def run(self) -> dict:
        """Train to the last step, saving on schedule and at the end; returns the final.json contents."""
        log(
            self.ctx,
            f"training steps {self.step + 1}..{self.last_step} on {self.num_train} samples"
            + (f" ({len(self.split.eval_ids)} more held out for evaluation)" if self.split.eval_ids else "")
            + ", "
            f"world size {self.ctx.world}, {self.train_config.parallelism}",
        )
        start, stopped = time.monotonic(), False
        pipeline = self.input_pipeline()
        self.nodes.write(self.step, "training")
        try:
            while self.step < self.last_step and not stopped:
                record = self.train_one_step(start, pipeline)
                # every rank, every step: a stop requested mid-run ends it here on all ranks (a save included)
                stopped = self.stop_watch.agreed() and self.step < self.last_step
                if self.saves_now() or stopped:
                    self.nodes.write(self.step, "saving")
                    self.save(record["epoch"])
                self.nodes.update(self.step)
        finally:
            pipeline.stop()
            self.setup.samples.close()  # after stop: a read waiting on the shard cache is released
            pipeline.join()
            if self.tensorboard is not None:
                self.tensorboard.close()
        if self.setup.samples.read_checks is not None:  # every rank: what it hashed and what it took on trust
            print(f"[eyas.train] rank {self.ctx.rank}: {self.setup.samples.read_checks.stats.summary()}", flush=True)
        self.nodes.write(self.step, "stopped" if stopped else "finished")
        if stopped:
            return self.stopped()
        final = {"checkpoint": self.checkpoint, "step": self.step, "final_loss": self.loss}
        if self.ctx.rank == 0:
            final["best"] = read_best(self.output_dir)
            write_final(self.output_dir, final)
            log(self.ctx, f"done: step {self.step}, loss {self.loss}, checkpoint {self.checkpoint}")
        return final

    def stopped(self) -> dict:
        """Every rank stopped on `eyas stop` after the same step, whose checkpoint is saved: no final.json; rank 0
        adds the step to the stop request, which the launcher reads (eyas.train.nodes)."""
        if self.ctx.rank == 0:
            record_stopped(self.output_dir, step=self.step, checkpoint=self.checkpoint)
            log(self.ctx, f"stopped by `eyas stop` at step {self.step}; checkpoint {self.checkpoint}")
        return {"stopped_at_step": self.step, "checkpoint": self.checkpoint}


def train(job: TrainJob, ctx: Dist) -> dict:
    """Train (resuming if possible) to the last step; returns the final.json contents."""
    return Trainer(job, ctx).run()
