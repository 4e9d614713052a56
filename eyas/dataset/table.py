"""The tokenized table: written once by the dataset stage, read by every later stage.

`tokenized.parquet` has one row per sample, in dataset order: columns sample_index (0..n-1), id,
input_ids (int32 list), loss_mask (uint8 list, 1 on the response), num_tokens; its schema metadata
holds `eyas.content_hash` (a hash of ids, tokens and masks: the dataset's identity, recorded in
every shard) and `eyas.cache_key` (prompts, dataset config and target: when to rebuild).

Readers that need only the count or the lengths never read the token columns: the count comes
from the Parquet footer (`tokenized_num_samples`), the lengths from one column (`sample_lengths`).
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from eyas.fsio import commit_temp, temp_path

DATASET_HASH_KEY = b"eyas.content_hash"
CACHE_KEY = b"eyas.cache_key"


def content_hash(ids: list[list[int]], masks: list[list[int]], sample_ids: list[str]) -> str:
    """The dataset's identity: sha256 over every sample's id, token ids (int32) and mask (uint8), 16 hex digits."""
    h = hashlib.sha256()
    for sid, x, m in zip(sample_ids, ids, masks, strict=True):
        h.update(sid.encode())
        h.update(np.asarray(x, dtype=np.int32).tobytes())
        h.update(np.asarray(m, dtype=np.uint8).tobytes())
    return h.hexdigest()[:16]


def write_tokenized_table(
    path: Path,
    sample_ids: list[str],
    ids: list[list[int]],
    masks: list[list[int]],
    *,
    dataset_hash: str,
    cache_key: str,
) -> None:
    """Write the table atomically (temporary -> fsync -> rename); `dataset_hash` is content_hash(ids, masks, sample_ids)."""
    table = pa.table(
        {
            "sample_index": pa.array(range(len(ids)), pa.int64()),
            "id": pa.array(sample_ids, pa.string()),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(x) for x in ids], pa.int32()),
        }
    ).replace_schema_metadata({DATASET_HASH_KEY: dataset_hash, CACHE_KEY: cache_key})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    pq.write_table(table, tmp)
    commit_temp(tmp, path)


@contextmanager
def parquet_errors(
    path,
    what: str = "tokenized dataset",
    fix: str = "the dataset stage's tokenized.parquet: rebuild it (eyas dataset CONFIG)",
):
    """A file that is not Parquet (or lacks a column) is refused naming it, not with pyarrow's bare message."""
    try:
        yield
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowIOError, KeyError) as err:
        raise ValueError(
            f"{what} {path}: not a readable Parquet table ({type(err).__name__}: {err}); expected {fix}"
        ) from None


def read_tokenized_meta(path: Path) -> dict[str, str]:
    """The table's `eyas.*` schema metadata (reads the footer only)."""
    with parquet_errors(path):
        meta = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"eyas.")}


def read_dataset_hash(path: Path) -> str:
    """The content hash in the tokenized table's schema metadata (reads the footer only)."""
    with parquet_errors(path):
        meta = pq.read_schema(path).metadata or {}
    if DATASET_HASH_KEY not in meta:
        raise ValueError(
            f"tokenized dataset {path}: schema metadata lacks {DATASET_HASH_KEY.decode()!r}; "
            f"expected the content hash written by eyas.dataset; rebuild the dataset"
        )
    return meta[DATASET_HASH_KEY].decode()


def tokenized_num_samples(path: str | Path) -> int:
    """Samples in a tokenized table (from the Parquet footer; reads no rows)."""
    with parquet_errors(path):
        return pq.read_metadata(path).num_rows


def sample_lengths(path: str | Path) -> list[int]:
    """Tokens per sample, in dataset order (reads the num_tokens column only)."""
    with parquet_errors(path):
        return pq.read_table(path, columns=["num_tokens"]).column("num_tokens").to_pylist()


def token_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Every sample's input_ids (int64) and loss_mask (uint8), concatenated in dataset order, as numpy."""
    with parquet_errors(path):
        table = pq.read_table(path, columns=["input_ids", "loss_mask"])
    ids = table.column("input_ids").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return ids.astype(np.int64), mask.astype(np.uint8)


class TokenizedDataset:
    """The tokenized table written by eyas.dataset (columns sample_index, id, input_ids, loss_mask,
    num_tokens; schema metadata `eyas.content_hash`), checked on read."""

    COLUMNS = ("sample_index", "input_ids", "loss_mask", "num_tokens")

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenized dataset {self.path}: no such file; run the dataset stage first")
        self.dataset_hash = read_dataset_hash(self.path)
        with parquet_errors(self.path):
            table = pq.read_table(self.path, columns=list(self.COLUMNS))
        self.input_ids = table.column("input_ids").combine_chunks()
        self.loss_mask = table.column("loss_mask").combine_chunks()
        self.num_tokens = table.column("num_tokens").to_pylist()
        self._check(table)

    def _check(self, table: pa.Table) -> None:
        n = table.num_rows
        if table.column("sample_index").to_pylist() != list(range(n)):
            raise ValueError(f"tokenized dataset {self.path}: sample_index is not 0..{n - 1} in order; rebuild it")
        for name, col in (("input_ids", self.input_ids), ("loss_mask", self.loss_mask)):
            if pc.list_value_length(col).to_pylist() != self.num_tokens:
                raise ValueError(f"tokenized dataset {self.path}: {name} lengths differ from num_tokens; rebuild it")

    def __len__(self) -> int:
        return len(self.num_tokens)

    def tokens(self, sample_start: int, sample_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids int64, loss_mask uint8) of samples [start, end) concatenated."""
        n = sample_end - sample_start
        ids = self.input_ids.slice(sample_start, n).flatten().to_numpy(zero_copy_only=False)
        mask = self.loss_mask.slice(sample_start, n).flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(ids.astype("int64")), torch.from_numpy(mask.astype("uint8"))
