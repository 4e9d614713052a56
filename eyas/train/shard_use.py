"""When a planned run reads each shard, first and last, from the shard plan alone; and how far a train dir's
checkpoints have put the trainer: what extract.retention (eyas.shards.retention) needs to release shards.

    use = shard_use(plan, job.train, num_samples=job.max_samples)   # plan: eyas.extract.plan.describe_extraction
    use.last_step[7]                 # the last step whose global batch reads shard 7
    step = trained_through(train_dir)  # the newest complete checkpoint's step; RUN_OVER once final.json exists

The last use walks the same order as the first need (eyas.train.stream_order: eyas.train.data.global_order over
TrainSplit.train_ids, the plan's shard windows), every epoch to the run's last step. A shard holding a held-out
sample is read by every evaluation, the last one at the run's end, so its last use is past the last step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from eyas.config import TrainConfig
from eyas.shards.format import ShardPlan
from eyas.shards.retention import RUN_OVER, ShardUse
from eyas.train.checkpoint import FINAL_FILE, latest_complete, read_trainer_state
from eyas.train.data import TrainSplit, global_order, steps_per_epoch, total_steps
from eyas.train.stream_order import check_plan, plan_windows, stream_order


def _last_train_use(plan: Sequence[ShardPlan], train: TrainConfig, num_samples: int) -> tuple[dict[int, int], int]:
    """shard -> the last step whose global batch holds one of its samples; and the run's number of steps."""
    split = TrainSplit.of(num_samples, train.eval_fraction)
    windows = plan_windows(plan, train, num_samples=num_samples)
    starts = torch.tensor([p.sample_start for p in plan])
    gbs, last_step = train.global_batch_size, total_steps(num_samples, train)
    per_epoch = steps_per_epoch(len(split.train_ids), gbs)
    shard_of_position = torch.searchsorted(starts, torch.tensor(split.train_ids), right=True) - 1
    last: dict[int, int] = {}
    for epoch in range(math.ceil(last_step / per_epoch)):
        taken = min(per_epoch, last_step - epoch * per_epoch) * gbs
        positions = torch.tensor(global_order(len(split.train_ids), train.seed, epoch, windows)[:taken])
        shards = shard_of_position[positions]
        final = torch.full((len(plan),), -1, dtype=torch.long).scatter_reduce_(
            0, shards, torch.arange(shards.numel()), reduce="amax"
        )
        for shard, pos in enumerate(final.tolist()):
            if pos >= 0:
                last[shard] = epoch * per_epoch + pos // gbs + 1
    return last, last_step


def shard_use(plan: Sequence[ShardPlan], train: TrainConfig, *, num_samples: int = 0) -> ShardUse:
    """When a run of `train` over the first `num_samples` samples (0 = all the plan holds) reads each planned
    shard: first and last step; a held-out shard's last use is past the last step (it stays to the end)."""
    check_plan(plan, num_samples)
    num_samples = num_samples or plan[-1].sample_end
    order = stream_order(plan, train, num_samples=num_samples)
    last, num_steps = _last_train_use(plan, train, num_samples)
    eval_ids = TrainSplit.of(num_samples, train.eval_fraction).eval_ids
    if eval_ids:
        starts = torch.tensor([p.sample_start for p in plan])
        for shard in (torch.searchsorted(starts, torch.tensor(eval_ids), right=True) - 1).unique().tolist():
            last[shard] = num_steps + 1
    return ShardUse(order.shards, order.first_step, last, train.save_every_steps, num_steps)


def trained_through(train_dir: str | Path) -> int:
    """The step of the newest complete checkpoint in a train dir (0 when none); RUN_OVER once final.json is
    written."""
    if (Path(train_dir) / FINAL_FILE).is_file():
        return RUN_OVER
    latest = latest_complete(train_dir)
    return int(read_trainer_state(latest)["step"]) if latest is not None else 0
