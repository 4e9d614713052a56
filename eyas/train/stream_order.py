"""The order in which a training run first needs its shards, from the shard plan alone (known before extraction).

    order = stream_order(plan, job.train, num_samples=job.max_samples)   # plan: eyas.extract.plan.describe_extraction
    order.shards            # shard indices, first needed first; the shards no step reads last, ascending
    order.first_step[i]     # the first optimizer step (from 1) that reads shard i; absent when none does
    order.needed_by(step)   # the shards steps 1..step read, in that order

Step s needs every shard holding a sample of its global batch (eyas.train.data.batch_at over
TrainSplit.train_ids: all ranks together, so the world size does not enter), in the order of their first
sample in that batch; the step that first evaluates the held-out split (train.eval_fraction) needs the
held-out samples' shards too, after its batch's (the evaluation runs after the step). The steps are walked
from step 1, epoch after epoch, until every shard holding a training sample is needed or the run's last step
(eyas.train.data.total_steps) is reached. The windows of train.shuffle_window_shards are built from the
plan's shard starts by the function the trainer applies to the manifest's (eyas.train.data.shard_windows),
so the order is the one an offline run over the same plan follows.

Cost (one core, CPU torch): the epoch's order (the trainer computes the same), the held-out split (one sha256
per sample) and one vectorized pass mapping the order to shards; see tests/test_stream_order.py for figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eyas.config import TrainConfig
from eyas.shards.format import ShardPlan
from eyas.train.data import ShardWindows, TrainSplit, global_order, shard_windows, steps_per_epoch, total_steps

TRAIN, EVAL = 0, 1  # within a step, the batch's shards come before the evaluation's


@dataclass(frozen=True)
class StreamOrder:
    """`shards`: every planned shard once, in the order the trainer first needs it (the ones it never reads
    last, ascending); `first_step`: shard index -> the first step that reads it (only the shards some step reads)."""

    shards: tuple[int, ...]
    first_step: dict[int, int]

    def needed_by(self, step: int) -> list[int]:
        """The shards that steps 1..step read, in the order they are first needed."""
        out = []
        for shard in self.shards:
            if self.first_step.get(shard, step + 1) > step:
                break
            out.append(shard)
        return out


def check_plan(plan: Sequence[ShardPlan], num_samples: int) -> None:
    """The plan's shards are numbered 0.. in order and cover samples 0..num_samples without gap or overlap."""
    if not plan:
        raise ValueError("shard plan: no shards; expected the plan of a dataset of at least one sample")
    end = 0
    for k, p in enumerate(plan):
        if p.index != k or p.sample_start != end or p.sample_end <= p.sample_start:
            raise ValueError(
                f"shard plan: entry {k} is shard {p.index} over samples {p.sample_start}..{p.sample_end}, expected "
                f"shard {k} starting at sample {end}; pass the plan of eyas.extract.plan.describe_extraction whole"
            )
        end = p.sample_end
    if num_samples > end:
        raise ValueError(
            f"shard plan: {len(plan)} shards hold {end} samples, the run trains over {num_samples}; lower "
            f"max_samples (0 = all) or plan the whole dataset"
        )


def first_eval_step(train: TrainConfig, last_step: int) -> int:
    """The first step the trainer evaluates the held-out split at: a checkpoint (save_every_steps, the last
    step) or eval_every_steps, whichever comes first."""
    every = train.eval_every_steps or last_step
    return min(train.save_every_steps, every, last_step)


def _first_positions(shards: torch.Tensor, num_shards: int) -> torch.Tensor:
    """For each shard, the first position it holds in `shards` (len(shards) where it is absent)."""
    first = torch.full((num_shards,), shards.numel(), dtype=torch.long)
    return first.scatter_reduce_(0, shards, torch.arange(shards.numel()), reduce="amin")


def _train_needs(
    split: TrainSplit, starts: torch.Tensor, train: TrainConfig, last_step: int, windows: ShardWindows
) -> dict:
    """shard -> (step, TRAIN, position in its global batch) of the first batch holding one of its samples."""
    gbs, num_train = train.global_batch_size, len(split.train_ids)
    per_epoch = steps_per_epoch(num_train, gbs)
    shard_of_position = torch.searchsorted(starts, torch.tensor(split.train_ids), right=True) - 1
    wanted = set(shard_of_position.unique().tolist())
    needs: dict[int, tuple[int, int, int]] = {}
    for epoch in range(math.ceil(last_step / per_epoch)):
        taken = min(per_epoch, last_step - epoch * per_epoch) * gbs
        positions = torch.tensor(global_order(num_train, train.seed, epoch, windows)[:taken])
        first = _first_positions(shard_of_position[positions], starts.numel()).tolist()
        for shard, pos in enumerate(first):
            if pos < taken:
                needs.setdefault(shard, (epoch * per_epoch + pos // gbs + 1, TRAIN, pos % gbs))
        if wanted <= needs.keys():
            break
    return needs


def plan_windows(plan: Sequence[ShardPlan], train: TrainConfig, *, num_samples: int = 0) -> ShardWindows:
    """The shard windows of the training order (in TrainSplit.train_ids positions), from the plan's shard starts
    as the trainer builds them from the manifest's (eyas.train.setup.sample_windows, then TrainSplit.windows)."""
    split = TrainSplit.of(num_samples or plan[-1].sample_end, train.eval_fraction)
    return _split_windows(split, plan, train)


def _split_windows(split: TrainSplit, plan: Sequence[ShardPlan], train: TrainConfig) -> ShardWindows:
    return split.windows(shard_windows([p.sample_start for p in plan], train.shuffle_window_shards))


def stream_order(plan: Sequence[ShardPlan], train: TrainConfig, *, num_samples: int = 0) -> StreamOrder:
    """The planned shards in the order a run of `train` over the first `num_samples` samples (0 = all the plan
    holds; TrainJob.max_samples) first reads them, and the step that first reads each."""
    check_plan(plan, num_samples)
    num_samples = num_samples or plan[-1].sample_end
    starts = torch.tensor([p.sample_start for p in plan])
    split = TrainSplit.of(num_samples, train.eval_fraction)
    windows = _split_windows(split, plan, train)
    last_step = total_steps(num_samples, train)
    needs = _train_needs(split, starts, train, last_step, windows)
    if split.eval_ids:
        step = first_eval_step(train, last_step)
        held_out = torch.searchsorted(starts, torch.tensor(split.eval_ids), right=True) - 1
        for shard in held_out.unique().tolist():  # ascending, as the evaluation reads them
            needs[shard] = min(needs.get(shard, (step, EVAL, shard)), (step, EVAL, shard))
    read = sorted(needs, key=needs.__getitem__)
    never = [p.index for p in plan if p.index not in needs]
    return StreamOrder(tuple(read + never), {shard: needs[shard][0] for shard in read})
