"""Hidden-state shards: the plan, the file format, the manifest, and the tokenized input table.

A shard is `shard-{index:05d}.safetensors` holding a run of whole samples packed along the token
axis (`input_ids` int64 [T], `loss_mask` uint8 [T], `aux_hidden_states` [T, n_aux*H],
`last_hidden_states` [T, H], `sample_offsets` int64 [n+1], `sample_indices` int64 [n]) with
string `__metadata__` (see `ShardMeta`). Which samples go into which shard (`plan_shards`) depends
only on the sample order and the shard size, never on the number of workers.

Durability: a shard is written to a temporary name in the same directory, fsynced, renamed and
the directory fsynced; only then is its row appended to `manifest.parquet`, itself rewritten
atomically. A shard file without a manifest row is therefore an unfinished write.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors.torch import save as safetensors_bytes

from eyas.fsio import TMP_MARKER, atomic_write_bytes, fsync_path

FORMAT_VERSION = "1"
MANIFEST_NAME = "manifest.parquet"
QUARANTINE_DIR = "quarantine"
DATASET_HASH_KEY = b"eyas.content_hash"
SHARD_NAME_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
# Per-token bytes besides the hidden states: input_ids (int64) + loss_mask (uint8).
TOKEN_OVERHEAD_BYTES = 9
SHARD_TENSOR_NAMES = (
    "input_ids",
    "loss_mask",
    "aux_hidden_states",
    "last_hidden_states",
    "sample_offsets",
    "sample_indices",
)
MANIFEST_SCHEMA = pa.schema(
    [
        ("shard_index", pa.int64()),
        ("file", pa.string()),
        ("sample_start", pa.int64()),
        ("sample_end", pa.int64()),
        ("num_tokens", pa.int64()),
        ("num_bytes", pa.int64()),
        ("sha256", pa.string()),
    ]
)


def shard_filename(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def dtype_itemsize(dtype: str) -> int:
    sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
    if dtype not in sizes:
        raise ValueError(f"hidden-state dtype {dtype!r}: expected one of {sorted(sizes)}")
    return sizes[dtype]


def bytes_per_token(*, hidden_size: int, num_aux: int, dtype: str) -> int:
    """Shard bytes per token: (n_aux + 1) * H hidden values plus TOKEN_OVERHEAD_BYTES for ids and mask."""
    return (num_aux + 1) * hidden_size * dtype_itemsize(dtype) + TOKEN_OVERHEAD_BYTES


@dataclass(frozen=True)
class ShardPlan:
    index: int
    sample_start: int
    sample_end: int  # exclusive
    num_tokens: int


def plan_shards(num_tokens_per_sample: Sequence[int], bytes_per_token: int, shard_bytes: int) -> list[ShardPlan]:
    """Pack whole samples, in order, into shards of at most `shard_bytes` (a sample larger than that
    gets a shard of its own). A pure function of the sample lengths and the shard size."""
    if bytes_per_token < 1 or shard_bytes < 1:
        raise ValueError(f"plan_shards: bytes_per_token={bytes_per_token} and shard_bytes={shard_bytes} must be >= 1")
    plans: list[ShardPlan] = []
    start, tokens = 0, 0
    for i, n in enumerate(num_tokens_per_sample):
        if n < 1:
            raise ValueError(f"sample {i}: num_tokens={n}, expected >= 1; drop empty samples from the dataset")
        if i > start and (tokens + n) * bytes_per_token > shard_bytes:
            plans.append(ShardPlan(len(plans), start, i, tokens))
            start, tokens = i, 0
        tokens += n
    if tokens:
        plans.append(ShardPlan(len(plans), start, len(num_tokens_per_sample), tokens))
    return plans


@dataclass(frozen=True)
class ShardMeta:
    """The `__metadata__` of a shard (stored as strings; `aux_layer_ids` as a JSON list)."""

    target_fingerprint: str
    aux_layer_ids: tuple[int, ...]
    layer_id_convention: str
    hidden_size: int
    num_aux: int
    dtype: str
    backend: str
    dataset_hash: str
    shard_index: int
    sample_start: int
    sample_end: int
    format_version: str = FORMAT_VERSION

    def to_metadata(self) -> dict[str, str]:
        out = {k: str(v) for k, v in asdict(self).items()}
        out["aux_layer_ids"] = json.dumps(list(self.aux_layer_ids))
        return out

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None, *, source: str) -> "ShardMeta":
        metadata = metadata or {}
        names = [f.name for f in fields(cls)]
        missing = sorted(set(names) - set(metadata))
        if missing:
            raise ValueError(
                f"{source}: __metadata__ lacks keys {missing}; expected all of {sorted(names)}; "
                f"the file was not written by eyas.shards.write_shard: re-extract it"
            )
        try:
            ids = json.loads(metadata["aux_layer_ids"])
            values = {n: metadata[n] for n in names}
            values["aux_layer_ids"] = tuple(int(i) for i in ids)
            for n in ("hidden_size", "num_aux", "shard_index", "sample_start", "sample_end"):
                values[n] = int(values[n])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: __metadata__ has a malformed value ({e}); re-extract the shard") from e
        return cls(**values)


@dataclass(frozen=True)
class ManifestRow:
    shard_index: int
    file: str
    sample_start: int
    sample_end: int
    num_tokens: int
    num_bytes: int
    sha256: str


def sha256_file(path: Path, *, chunk_bytes: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def write_shard(shards_dir: Path, tensors: dict[str, torch.Tensor], meta: ShardMeta) -> ManifestRow:
    """Write one shard durably and return its manifest row (the caller appends it)."""
    if sorted(tensors) != sorted(SHARD_TENSOR_NAMES):
        raise ValueError(
            f"shard {meta.shard_index:05d}: tensors {sorted(tensors)}, expected {sorted(SHARD_TENSOR_NAMES)}"
        )
    data = safetensors_bytes({k: v.contiguous() for k, v in tensors.items()}, metadata=meta.to_metadata())
    name = shard_filename(meta.shard_index)
    atomic_write_bytes(Path(shards_dir) / name, data)
    return ManifestRow(
        shard_index=meta.shard_index,
        file=name,
        sample_start=meta.sample_start,
        sample_end=meta.sample_end,
        num_tokens=int(tensors["input_ids"].shape[0]),
        num_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )


def read_manifest(shards_dir: Path) -> list[ManifestRow]:
    """The manifest's rows sorted by shard index; empty when there is no manifest yet."""
    path = Path(shards_dir) / MANIFEST_NAME
    if not path.exists():
        return []
    table = pq.read_table(path)
    if table.schema.names != MANIFEST_SCHEMA.names:
        raise ValueError(
            f"{path}: columns {table.schema.names}, expected {MANIFEST_SCHEMA.names}; "
            f"the manifest is not eyas's: move the shards directory aside and re-extract"
        )
    columns = table.to_pydict()
    rows = [ManifestRow(*values) for values in zip(*(columns[n] for n in MANIFEST_SCHEMA.names))]
    indices = [r.shard_index for r in rows]
    if len(set(indices)) != len(indices):
        dupes = sorted({i for i in indices if indices.count(i) > 1})
        raise ValueError(f"{path}: shard indices {dupes} appear more than once; expected one row per shard")
    return sorted(rows, key=lambda r: r.shard_index)


def write_manifest(shards_dir: Path, rows: Sequence[ManifestRow]) -> None:
    rows = sorted(rows, key=lambda r: r.shard_index)
    table = pa.Table.from_pylist([asdict(r) for r in rows], schema=MANIFEST_SCHEMA)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(Path(shards_dir) / MANIFEST_NAME, sink.getvalue().to_pybytes())


def append_manifest_row(shards_dir: Path, row: ManifestRow) -> None:
    rows = read_manifest(shards_dir)
    if any(r.shard_index == row.shard_index for r in rows):
        raise ValueError(
            f"{Path(shards_dir) / MANIFEST_NAME}: shard {row.shard_index:05d} already has a row; "
            f"quarantine it (eyas.shards.quarantine_shards) before re-extracting"
        )
    write_manifest(shards_dir, [*rows, row])


def shard_files(shards_dir: Path) -> list[Path]:
    """The `*.safetensors` files in the directory (not temporaries, not the quarantine), sorted."""
    with os.scandir(shards_dir) as entries:
        names = sorted(e.name for e in entries if e.name.endswith(".safetensors") and e.is_file())
    return [Path(shards_dir) / n for n in names]


def remove_stray_temporaries(shards_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted atomic writes (`.NAME.tmp-PID`); return what was deleted."""
    strays = sorted(p for p in Path(shards_dir).glob(f".*{TMP_MARKER}*") if p.is_file())
    for p in strays:
        p.unlink()
    return strays


def quarantine_shards(shards_dir: Path, reasons: Mapping[str, str]) -> list[Path]:
    """Move each named shard file (a key of `reasons`) into `quarantine/` as `NAME.STAMP`, beside
    `NAME.STAMP.reason.txt` holding its reason, and drop its manifest row, so that the next extraction
    run re-extracts it. A file already gone still gets its reason file. Returns the reason files."""
    shards_dir = Path(shards_dir)
    qdir = shards_dir / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    written = []
    for name, reason in sorted(reasons.items()):
        if not reason:
            raise ValueError(f"quarantine {shards_dir / name}: empty reason; say why the shard is set aside")
        dst, k = qdir / f"{name}.{stamp}", 1
        while dst.exists() or dst.with_name(dst.name + ".reason.txt").exists():
            dst, k = qdir / f"{name}.{stamp}-{k}", k + 1
        src = shards_dir / name
        found = src.exists()
        if found:
            os.replace(src, dst)
        note = dst.with_name(dst.name + ".reason.txt")
        atomic_write_bytes(note, (reason + "\n" + ("" if found else "(the file was already missing)\n")).encode())
        written.append(note)
    fsync_path(qdir)
    fsync_path(shards_dir)
    rows = read_manifest(shards_dir)
    kept = [r for r in rows if r.file not in reasons]
    if len(kept) != len(rows):
        write_manifest(shards_dir, kept)
    return written


def load_shard(path: Path) -> tuple[dict[str, torch.Tensor], ShardMeta]:
    """All tensors of one shard and its parsed metadata. The tensors may be memory-mapped: do not
    modify the file in place while they live (eyas never does; it writes new files and renames)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = ShardMeta.from_metadata(f.metadata(), source=str(path))
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def read_dataset_hash(path: Path) -> str:
    """The content hash in the tokenized table's schema metadata (reads the footer only)."""
    meta = pq.read_schema(path).metadata or {}
    if DATASET_HASH_KEY not in meta:
        raise ValueError(
            f"tokenized dataset {path}: schema metadata lacks {DATASET_HASH_KEY.decode()!r}; "
            f"expected the content hash written by eyas.dataset; rebuild the dataset"
        )
    return meta[DATASET_HASH_KEY].decode()


class TokenizedDataset:
    """The tokenized table written by eyas.dataset (columns sample_index, id, input_ids, loss_mask,
    num_tokens; schema metadata `eyas.content_hash`), checked on read."""

    COLUMNS = ("sample_index", "input_ids", "loss_mask", "num_tokens")

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenized dataset {self.path}: no such file; run the dataset stage first")
        self.dataset_hash = read_dataset_hash(self.path)
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
