"""The training order and batches: which samples each step takes, on which rank, padded how.

The training order is `global_order(n, seed, epoch, windows)`, a permutation that depends only on (seed,
epoch) and, with `train.shuffle_window_shards` W > 0, on the shard boundaries: the shards are shuffled,
then the samples within each run of W consecutive shards of that order, so a stretch of steps reads W
shards (what a bounded shard cache, eyas.shards.cache, fetches ahead); W = 0 shuffles all samples. A step
takes the next `global_batch_size` ids of it and rank r trains on `rank_slice(ids, r, world)`. The data
position is the number of global samples consumed, so a run resumed on another world size continues the
same order. Steps: `num_epochs` x (samples // global_batch_size), capped by `max_steps` when it is > 0
(`total_steps`); `rank_schedule` lists the samples one rank reads from a position to the last step.

With `train.eval_fraction` f > 0 the held-out split is `held_out_ids(n, f)`: the round(f * n) sample indices
(at least one) with the smallest sha256 of "eyas-eval:{index}", a function of the index alone, so it never
changes with the world size, the seed or a resume. The training order then runs over the other samples
(`TrainSplit`): the order's positions index `TrainSplit.train_ids`, and steps count only those samples.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from eyas.config import TrainConfig
from eyas.shards.reader import ShardDataError


@dataclass(frozen=True)
class ShardWindows:
    """Shard-local shuffling: `shard_starts` are the first sample of each shard (ascending, from 0), `size`
    the shards per window (train.shuffle_window_shards); size 0 = one uniform shuffle."""

    shard_starts: tuple[int, ...] = ()
    size: int = 0


UNIFORM = ShardWindows()


def shard_windows(shard_starts: Sequence[int], size: int) -> ShardWindows:
    """The order's windows over shards whose first samples are `shard_starts` (the manifest's rows, or the shard
    plan's before extraction), `size` = train.shuffle_window_shards; UNIFORM when 0."""
    return ShardWindows(tuple(shard_starts), size) if size else UNIFORM


@lru_cache(maxsize=4)
def _cached_order(num_samples: int, seed: int, epoch: int, windows: ShardWindows = UNIFORM) -> tuple[int, ...]:
    digest = hashlib.sha256(f"eyas-order:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    if not windows.size:
        return tuple(torch.randperm(num_samples, generator=gen).tolist())
    bounds = [s for s in windows.shard_starts if s < num_samples] + [num_samples]
    shards = torch.randperm(len(bounds) - 1, generator=gen).tolist()
    order: list[int] = []
    for w in range(0, len(shards), windows.size):
        ids = torch.cat([torch.arange(bounds[s], bounds[s + 1]) for s in shards[w : w + windows.size]])
        order += ids[torch.randperm(ids.numel(), generator=gen)].tolist()
    return tuple(order)


def global_order(num_samples: int, seed: int, epoch: int, windows: ShardWindows = UNIFORM) -> list[int]:
    """The permutation of sample indices for one epoch; a function of (seed, epoch, windows) only."""
    return list(_cached_order(num_samples, seed, epoch, windows))


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full global batches per epoch; the tail of each shuffled epoch (< one batch) is skipped."""
    if num_samples < global_batch_size:
        raise ShardDataError(
            f"train.global_batch_size={global_batch_size} is larger than the {num_samples} training samples; "
            f"lower it or train on more samples"
        )
    return num_samples // global_batch_size


def batch_at(
    samples_consumed: int, num_samples: int, global_batch_size: int, seed: int, windows: ShardWindows = UNIFORM
) -> tuple[int, list[int]]:
    """(epoch, global sample ids) of the batch that follows `samples_consumed` samples."""
    epoch_len = steps_per_epoch(num_samples, global_batch_size) * global_batch_size
    epoch, offset = divmod(samples_consumed, epoch_len)
    return epoch, list(_cached_order(num_samples, seed, epoch, windows)[offset : offset + global_batch_size])


def rank_slice(global_batch_ids: list[int], rank: int, world: int) -> list[int]:
    """Rank r's contiguous share of a global batch; shares differ in size by at most one."""
    n = len(global_batch_ids)
    if n < world:
        raise ValueError(
            f"a global batch of {n} samples cannot give each of {world} ranks a sample; "
            f"raise train.global_batch_size to at least {world}"
        )
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return list(global_batch_ids[start : start + base + (rank < extra)])


def rank_schedule(
    samples_consumed: int,
    last_step: int,
    num_samples: int,
    train: TrainConfig,
    rank: int,
    world: int,
    windows: ShardWindows = UNIFORM,
) -> list[int]:
    """The sample ids rank `rank` reads, in order, from the batch after `samples_consumed` to `last_step`."""
    gbs, out = train.global_batch_size, []
    for consumed in range(samples_consumed, last_step * gbs, gbs):
        out += rank_slice(batch_at(consumed, num_samples, gbs, train.seed, windows)[1], rank, world)
    return out


def collate(
    samples: list[dict], max_len: int, *, min_len: int = 0, pin_memory: bool = False
) -> dict[str, torch.Tensor]:
    """Right-pad samples (each cut to max_len tokens) into one batch of at least `min_len` columns;
    `valid` marks real tokens, padding has loss_mask 0 (float8 aux and their scales pad with zeros, which decode
    to zeros). `pin_memory` puts the batch in page-locked memory (CUDA only), for copies that do not block."""
    if not samples:
        raise ValueError("collate: no samples; expected at least one")
    lengths = [min(int(s["input_ids"].shape[0]), max_len) for s in samples]
    width = max(*lengths, min_len)
    batch = {}
    for key in [k for k, v in samples[0].items() if isinstance(v, torch.Tensor)]:
        first = samples[0][key]
        out = torch.zeros((len(samples), width, *first.shape[1:]), dtype=first.dtype, pin_memory=pin_memory)
        for row, (s, n) in enumerate(zip(samples, lengths)):
            out[row, :n] = s[key][:n]
        batch[key] = out
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    batch["valid"] = valid.pin_memory() if pin_memory else valid
    return batch


def padded_length(num_tokens: int, max_len: int, min_len: int) -> int:
    """The columns a sample of `num_tokens` takes in a batch: cut to max_len, at least min_len (collate)."""
    return max(min(num_tokens, max_len), min_len)


def split_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """A rank's samples (their padded lengths) grouped into micro-batches of at most `budget` tokens, padding
    counted: sorted longest first (ties in order), each micro-batch takes the next samples while (samples + 1) x
    its longest <= budget, so samples of similar length share one. budget 0 = one micro-batch of all, in order."""
    if not budget:
        return [list(range(len(lengths)))] if lengths else []
    too_long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if too_long:
        raise ValueError(
            f"train.max_tokens_per_micro_batch={budget}: samples of {max(n for _, n in too_long)} tokens do not fit "
            f"one micro-batch; raise it to at least the longest sample (draft.max_position_embeddings cuts them)"
        )
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _eval_key(index: int) -> bytes:
    return hashlib.sha256(f"eyas-eval:{index}".encode()).digest()[:8]


@lru_cache(maxsize=4)
def _held_out(num_samples: int, fraction: float) -> tuple[int, ...]:
    if fraction <= 0:
        return ()
    count = max(1, round(fraction * num_samples))
    return tuple(sorted(sorted(range(num_samples), key=_eval_key)[:count]))


def held_out_ids(num_samples: int, fraction: float) -> list[int]:
    """The held-out sample indices (ascending) of a shard set of `num_samples`; empty when fraction is 0."""
    return list(_held_out(num_samples, fraction))


@dataclass(frozen=True)
class TrainSplit:
    """The samples a run trains on (`train_ids`, ascending) and the ones it evaluates on (`eval_ids`)."""

    train_ids: tuple[int, ...]
    eval_ids: tuple[int, ...]

    @classmethod
    def of(cls, num_samples: int, fraction: float) -> "TrainSplit":
        held = _held_out(num_samples, fraction)
        if len(held) >= num_samples:
            raise ShardDataError(
                f"train.eval_fraction={fraction} holds out all {num_samples} samples; lower it or train on more samples"
            )
        kept = set(held)
        return cls(tuple(i for i in range(num_samples) if i not in kept), held)

    def windows(self, windows: ShardWindows) -> ShardWindows:
        """The shard windows in the positions of train_ids (each shard start moved to its first training sample)."""
        if not windows.size or not self.eval_ids:
            return windows
        starts = sorted({bisect.bisect_left(self.train_ids, s) for s in windows.shard_starts})
        return ShardWindows(tuple(s for s in starts if s < len(self.train_ids)), windows.size)


def num_train_samples(num_samples: int, train: TrainConfig) -> int:
    """The samples of a shard set of `num_samples` that the run trains on (all but the held-out split)."""
    return num_samples - len(_held_out(num_samples, train.eval_fraction))


def total_steps(num_samples: int, train: TrainConfig) -> int:
    """Optimizer steps of a training run over a shard set of `num_samples` (the held-out split not counted)."""
    steps = train.num_epochs * steps_per_epoch(num_train_samples(num_samples, train), train.global_batch_size)
    return min(steps, train.max_steps) if train.max_steps else steps
