"""Training data: samples read from hidden-state shards, their order, and batching.

A sample is addressed by its global index (the dataset order extraction used). `ShardSamples`
maps it to a shard file and a token range through `manifest.parquet` and reads it as
memory-mapped slices, never a whole shard. The training order is `global_order(n, seed, epoch)`,
a permutation that depends only on (seed, epoch); a step takes the next `global_batch_size`
ids of it and rank r trains on `rank_slice(ids, r, world)`. The data position is the number of
global samples consumed, so a run resumed on another world size continues the same order.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

MANIFEST_NAME = "manifest.parquet"
# Shard tensor name -> batch key (the names `eyas.draft.ttt_loss` reads).
SAMPLE_TENSORS = {
    "input_ids": "input_ids",
    "loss_mask": "loss_mask",
    "aux_hidden_states": "aux_hidden",
    "last_hidden_states": "last_hidden",
}
# Metadata every shard of one extraction run shares.
SHARED_METADATA = ("aux_layer_ids", "hidden_size", "num_aux", "dtype", "target_fingerprint")


class ShardDataError(ValueError):
    """The shards on disk do not form the dataset the trainer expects."""


def parse_metadata(raw: dict[str, str] | None, shard: str) -> dict:
    """Typed view of a shard's `__metadata__` (all values are strings on disk)."""
    raw = raw or {}
    missing = sorted(set(SHARED_METADATA) - raw.keys())
    if missing:
        raise ShardDataError(
            f"shard {shard}: __metadata__ lacks {missing}; expected a shard written by eyas.shards "
            f"(fields {list(SHARED_METADATA)}); re-extract it"
        )
    return {
        **raw,
        "aux_layer_ids": [int(i) for i in json.loads(raw["aux_layer_ids"])],
        "hidden_size": int(raw["hidden_size"]),
        "num_aux": int(raw["num_aux"]),
    }


def _read_manifest(shards_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    path = shards_dir / MANIFEST_NAME
    if not path.is_file():
        raise ShardDataError(f"shards_dir {str(shards_dir)!r}: no {MANIFEST_NAME}; run extraction (eyas extract) first")
    rows = sorted(pq.read_table(path).to_pylist(), key=lambda r: r["sample_start"])
    if not rows:
        raise ShardDataError(f"{path}: the manifest has no rows; extraction wrote no shard")
    expected_start = 0
    for row in rows:
        if row["sample_start"] != expected_start or row["sample_end"] <= row["sample_start"]:
            raise ShardDataError(
                f"{path}: shard {row['file']} covers samples [{row['sample_start']}, {row['sample_end']}), "
                f"expected it to start at {expected_start} with at least one sample; samples are missing "
                f"or duplicated; resume extraction to fill the gap"
            )
        expected_start = row["sample_end"]
    return rows


class ShardSamples:
    """Global sample index -> shard file + token range, read through the manifest.

    `max_samples` > 0 keeps the first N samples. `metadata` is the first shard's (typed); every
    other shard is checked against it when first read.
    """

    def __init__(self, shards_dir: str | Path, *, max_samples: int = 0):
        self.shards_dir = Path(shards_dir)
        self._rows = _read_manifest(self.shards_dir)
        self._starts = [r["sample_start"] for r in self._rows]
        total = self._rows[-1]["sample_end"]
        if max_samples > total:
            raise ShardDataError(
                f"max_samples={max_samples}: the shards in {self.shards_dir} hold only {total} samples; "
                f"lower max_samples (0 = all) or extract more"
            )
        self.num_samples = max_samples or total
        self._offsets: dict[int, torch.Tensor] = {}
        with safe_open(self._path(0), framework="pt") as f:
            self.metadata = parse_metadata(f.metadata(), self._rows[0]["file"])

    def __len__(self) -> int:
        return self.num_samples

    def _path(self, shard: int) -> Path:
        return self.shards_dir / self._rows[shard]["file"]

    def locate(self, index: int) -> tuple[int, int]:
        """(shard row, index within that shard) of a global sample index."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index}: expected 0 <= index < {self.num_samples}")
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._rows[shard]["sample_start"]

    def _shard_offsets(self, shard: int, f) -> torch.Tensor:
        if shard not in self._offsets:
            name = self._rows[shard]["file"]
            meta = parse_metadata(f.metadata(), name)
            for key in SHARED_METADATA:
                if meta[key] != self.metadata[key]:
                    raise ShardDataError(
                        f"shard {name}: metadata {key}={meta[key]!r}, expected {self.metadata[key]!r} "
                        f"as in {self._rows[0]['file']}; the shards come from different extraction runs; "
                        f"re-extract into an empty shards_dir"
                    )
            offsets = f.get_tensor("sample_offsets")
            row = self._rows[shard]
            if offsets.numel() - 1 != row["sample_end"] - row["sample_start"]:
                raise ShardDataError(
                    f"shard {name}: {offsets.numel() - 1} samples in sample_offsets, manifest says "
                    f"{row['sample_end'] - row['sample_start']}; run eyas verify and re-extract it"
                )
            self._offsets[shard] = offsets
        return self._offsets[shard]

    def load_sample(self, index: int) -> dict[str, torch.Tensor | int]:
        """One sample as tensors: input_ids [T], loss_mask [T], aux_hidden [T, nH], last_hidden [T, H]."""
        shard, local = self.locate(index)
        with safe_open(self._path(shard), framework="pt") as f:
            offsets = self._shard_offsets(shard, f)
            stored = int(f.get_slice("sample_indices")[local : local + 1][0])
            if stored != index:
                raise ShardDataError(
                    f"shard {self._rows[shard]['file']}: position {local} holds sample {stored}, expected "
                    f"{index} from the manifest; the shard and manifest disagree; run eyas verify"
                )
            a, b = int(offsets[local]), int(offsets[local + 1])
            sample: dict = {key: f.get_slice(name)[a:b] for name, key in SAMPLE_TENSORS.items()}
        sample["sample_index"] = index
        return sample


@lru_cache(maxsize=4)
def _cached_order(num_samples: int, seed: int, epoch: int) -> tuple[int, ...]:
    digest = hashlib.sha256(f"eyas-order:{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return tuple(torch.randperm(num_samples, generator=gen).tolist())


def global_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The permutation of sample indices for one epoch; a function of (seed, epoch) only."""
    return list(_cached_order(num_samples, seed, epoch))


def steps_per_epoch(num_samples: int, global_batch_size: int) -> int:
    """Full global batches per epoch; the tail of each shuffled epoch (< one batch) is skipped."""
    if num_samples < global_batch_size:
        raise ShardDataError(
            f"train.global_batch_size={global_batch_size} is larger than the {num_samples} training samples; "
            f"lower it or train on more samples"
        )
    return num_samples // global_batch_size


def batch_at(samples_consumed: int, num_samples: int, global_batch_size: int, seed: int) -> tuple[int, list[int]]:
    """(epoch, global sample ids) of the batch that follows `samples_consumed` samples."""
    epoch_len = steps_per_epoch(num_samples, global_batch_size) * global_batch_size
    epoch, offset = divmod(samples_consumed, epoch_len)
    return epoch, list(_cached_order(num_samples, seed, epoch)[offset : offset + global_batch_size])


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


def collate(samples: list[dict], max_len: int, *, min_len: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples (each cut to max_len tokens) into one batch of at least `min_len` columns;
    `valid` marks real tokens, padding has loss_mask 0."""
    if not samples:
        raise ValueError("collate: no samples; expected at least one")
    lengths = [min(int(s["input_ids"].shape[0]), max_len) for s in samples]
    width = max(*lengths, min_len)
    batch = {}
    for key in SAMPLE_TENSORS.values():
        first = samples[0][key]
        out = torch.zeros((len(samples), width, *first.shape[1:]), dtype=first.dtype)
        for row, (s, n) in enumerate(zip(samples, lengths)):
            out[row, :n] = s[key][:n]
        batch[key] = out
    batch["valid"] = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return batch
