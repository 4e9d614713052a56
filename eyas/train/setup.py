"""What a rank trains with, checked before any step: the draft built for the job's target and vocab, its shards
opened (a local copy, or storage through the rank's cache) and checked against the target and the job, the
order's shard windows, and the micro-batch budget (train.max_tokens_per_micro_batch, or the memory plan's).

    setup = build_setup(job, rank)                 # TrainSetup: draft, head_rows, samples, fingerprint
    tokens = micro_batch_budget(job, setup, ctx)
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eyas.config import TrainJob
from eyas.dataset.vocab import load_vocab
from eyas.draft import DraftArch, Eagle3Draft, build_draft
from eyas.shards.read_checks import NodeReadChecks
from eyas.shards.reader import ShardSamples
from eyas.shards.wait_record import WaitRecord
from eyas.storage import open_storage
from eyas.target import load_embed_and_lm_head, target_fingerprint
from eyas.train.data import ShardWindows, shard_windows
from eyas.train.memory_plan import GIB, PlanShape, device_bytes, pick_micro_batch_tokens, plan_memory
from eyas.train.parallel import Dist
from eyas.train.step import use_bf16


@dataclass
class TrainSetup:
    """A fresh draft and everything a step needs, checked against the shards and the target."""

    draft: Eagle3Draft
    head_rows: torch.Tensor  # the target lm_head rows of the draft vocab [Vd, H]
    samples: ShardSamples
    fingerprint: str


def _check_shards(samples: ShardSamples, job: TrainJob, hidden_size: int, fingerprint: str) -> None:
    meta = samples.meta
    found = (meta.target_fingerprint, list(meta.aux_layer_ids), meta.hidden_size, meta.num_aux)
    expected = (fingerprint, job.aux_layer_ids, hidden_size, len(job.aux_layer_ids))
    if found != expected:
        raise ValueError(
            f"shards {job.shards_dir}: (target_fingerprint, aux_layer_ids, hidden_size, num_aux) = {found}, "
            f"expected {expected} from the target {job.target_path} and the job; the shards were extracted "
            f"from another target or with other layers; re-extract or fix the job"
        )


CACHE_DIR = "shard-cache"


def open_samples(job: TrainJob, rank: int = 0) -> ShardSamples:
    """The job's shards: the local directory, or (train.cache_bytes > 0) its storage through rank's cache; with
    job.stream, each shard waited for until it is verified (the wait said through the rank's log, and noted in
    OUTPUT/waits/ while it lasts: eyas.shards.wait_record)."""
    t = job.train

    def rank_log(message: str) -> None:
        print(f"[eyas.train] rank {rank}: {message}", flush=True)

    record = WaitRecord(job.output_dir, rank) if job.stream is not None else None  # read by `eyas status`

    if not t.cache_bytes:
        checks = NodeReadChecks.for_this_launch() if t.verify_reads else None  # each shard hashed once per node
        return ShardSamples(job.shards_dir, max_samples=job.max_samples, verify_reads=t.verify_reads,
                            read_checks=checks, stream=job.stream, log=rank_log, wait_record=record)  # fmt: skip
    return ShardSamples(
        open_storage(job.shards_dir, endpoint_url=job.shards_endpoint_url),
        max_samples=job.max_samples,
        cache_dir=cache_root(job) / f"rank-{rank}",
        cache_bytes=t.cache_bytes,
        stream=job.stream,
        log=rank_log,
        wait_record=record,
    )


def cache_root(job: TrainJob) -> Path:
    """Where the job's ranks keep their shard caches: OUTPUT/shard-cache, or under train.cache_dir (a node's own
    disk) a folder named by a hash of the output directory, so that two runs on one node never share a cache (a
    cache deletes every file that is not one of its run's shards)."""
    if not job.train.cache_dir:
        return Path(job.output_dir) / CACHE_DIR
    run = hashlib.sha256(str(Path(job.output_dir).resolve()).encode()).hexdigest()[:16]
    return Path(job.train.cache_dir) / f"{Path(job.output_dir).parent.name}-{run}"


def sample_windows(samples: ShardSamples, job: TrainJob) -> ShardWindows:
    """The order's shard windows (train.shuffle_window_shards; UNIFORM when 0)."""
    return shard_windows(samples.shard_starts(), job.train.shuffle_window_shards)


def build_setup(job: TrainJob, rank: int = 0) -> TrainSetup:
    """A fresh draft for the job, its shards opened and checked against the target and the job."""
    samples = open_samples(job, rank)
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
    arch = DraftArch(
        hidden_size=hidden,
        num_aux=len(job.aux_layer_ids),
        target_vocab_size=vocab,
        draft_vocab_size=d2t.numel(),
        **job.draft.arch_fields(),  # the layer's shape and the variant's options
    )
    draft = build_draft(arch, embed, d2t, t2d, seed=job.train.seed)
    head_rows = lm_head[torch.arange(d2t.numel()) + d2t].float()
    return TrainSetup(draft=draft, head_rows=head_rows, samples=samples, fingerprint=fingerprint)


def micro_batch_budget(job: TrainJob, setup: TrainSetup, ctx: Dist) -> int:
    """train.max_tokens_per_micro_batch, or when 0 (auto) the largest budget the memory plan fits on this device."""
    t = job.train
    if t.max_tokens_per_micro_batch:
        return t.max_tokens_per_micro_batch
    shape = PlanShape(
        arch=setup.draft.arch,
        num_ttt_steps=t.num_ttt_steps,
        bf16=use_bf16(t.mixed_precision, ctx.device),
        parallelism=t.parallelism,
        world=ctx.world,
        checkpointing=t.activation_checkpointing,
        encoding=setup.samples.meta.encoding,
        longest_sample=max(job.draft.max_position_embeddings, t.num_ttt_steps + 1),
        share_tokens=-(-t.global_batch_size // ctx.world) * max(job.draft.max_position_embeddings, t.num_ttt_steps + 1),
    )
    budget = device_bytes(ctx.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    tokens = pick_micro_batch_tokens(shape, budget)
    if not tokens:
        plan = plan_memory(shape, shape.longest_sample, budget)
        raise MemoryError(
            f"train.max_tokens_per_micro_batch=0 (auto): one sample of {shape.longest_sample} tokens needs "
            f"{plan.peak_bytes / GIB:.1f} GiB on {ctx.device}, {budget / GIB:.1f} GiB available; use "
            f"train.parallelism='fsdp2', train.activation_checkpointing, or a smaller draft.max_position_embeddings"
        )
    return tokens
