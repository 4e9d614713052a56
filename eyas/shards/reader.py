"""The trainer's reader of a shard set: a global sample index -> its shard file and token range.

    samples = ShardSamples("run/shards")          # every row of manifest.parquet, checked
    sample = samples.load_sample(17)              # input_ids [T], loss_mask [T], aux_hidden [T, nH], last_hidden [T, H]
                                                  # (teacher topk: topk_ids, topk_logprobs [T, K] for last_hidden)
    samples = ShardSamples(open_storage("s3://b/run"), cache_dir="out/shard-cache/rank-0", cache_bytes=8 << 30)
    samples.plan(sample_ids_in_read_order)        # the cache fetches ahead of it (eyas.shards.cache)

A sample is addressed by its global index (the dataset order extraction used). The manifest is read
through eyas.shards.manifest and must cover samples 0..n-1 without a gap or an overlap; every shard's
`__metadata__` is parsed strictly (eyas.shards.format.ShardMeta) when the shard is first opened and
must agree with its manifest row and with the first shard's run-wide fields; its size must be the
manifest's `num_bytes`, and with `verify_reads` its XXH3 checksum the manifest's `checksum` (one read of the
file, on first open, shared by the ranks of a launch on a node: eyas.shards.read_checks), so a shard damaged
after verification is refused, named, before a step trains on it.
A sample is read with one large sequential read (pread) per tensor, never a whole shard, into its own tensors
(`load_sample`) or straight into a batch's rows (`read_sample_into`, the trainer's input pipeline); float8 aux
states are decoded (times their scales, eyas.shards.encoding.decode_aux) as they are read, into float32, or handed
on as stored (`decoded=False`, read_sample_into: the trainer decodes them on its device). With `cache_bytes` > 0 the shards
are read from a storage (S3, or any eyas.storage) through a bounded local cache (eyas.shards.cache), whose
fetches are checked against the manifest checksum; without, they are the files of a local directory.
With `stream` (TrainJob.stream: extraction still going on) the index, the shard boundaries and the run-wide
metadata come from the shard plan and extract.json instead of the manifest and shard 0, and a shard is opened only
once it is verified, waiting for it as long as it takes (eyas.shards.streamed).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eyas.config import StreamSource
from eyas.shards.cache import ShardCache
from eyas.shards.encoding import TEACHER_KEYS, decode_aux
from eyas.shards.format import BASE_TENSOR_NAMES, ShardMeta
from eyas.shards.manifest import MANIFEST_NAME, coverage_problems, read_manifest
from eyas.shards.read_checks import NodeReadChecks
from eyas.shards.streamed import planned_rows, stream_meta, verified_now, wait_for_shard
from eyas.shards.wait_record import WaitRecord
from eyas.storage import Storage, as_storage

# ShardMeta fields every shard of one extraction run shares.
RUN_FIELDS = (
    "target_fingerprint",
    "aux_layer_ids",
    "layer_id_convention",
    "hidden_size",
    "num_aux",
    "dtype",
    "backend",
    "dataset_hash",
    "aux_dtype",
    "teacher",
    "teacher_topk",
    "format_version",
)


class ShardDataError(ValueError):
    """The shards on disk do not form the dataset the trainer expects."""


ST_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
            "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's rows lie in a safetensors file: row 0 at byte `start`, `row_bytes` a row."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    start: int
    row_bytes: int


def tensor_layout(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file (its header: 8 bytes of length, then JSON) as StoredTensors."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in ST_TORCH:
            raise ShardDataError(f"shard {path.name}: tensor {name} has dtype {info['dtype']}, expected one of "
                                 f"{sorted(ST_TORCH)}; run eyas verify")  # fmt: skip
        dtype, shape = ST_TORCH[info["dtype"]], tuple(info["shape"])
        out[name] = StoredTensor(dtype, shape[1:], 8 + length + info["data_offsets"][0],
                                 math.prod(shape[1:]) * dtype.itemsize)  # fmt: skip
    return out


def read_rows(path: Path, layout: dict[str, StoredTensor], names: list[str], a: int, b: int, into=None) -> dict:
    """Rows a..b of the named tensors, each read with large sequential reads (pread) into its own tensor, or into
    `into[name]` (contiguous, b - a rows): the kernel's readahead serves them, where page faults of memory-mapped
    slices would fetch a few pages at a time."""
    fd, out = os.open(path, os.O_RDONLY), {}
    try:
        for name in names:
            t = layout[name]
            dst = into[name] if into is not None else torch.empty((b - a, *t.row_shape), dtype=t.dtype)
            view, done = memoryview(dst.view(-1).view(torch.uint8).numpy()), 0
            while done < len(view):
                got = os.preadv(fd, [view[done:]], t.start + a * t.row_bytes + done)
                if not got:
                    raise ShardDataError(f"shard {path.name}: ends inside {name} rows {a}..{b}; run eyas verify")
                done += got
            out[name] = dst
    finally:
        os.close(fd)
    return out


class ShardSamples:
    """Global sample index -> shard file + token range, read through the manifest.

    `max_samples` > 0 keeps the first N samples. `meta` is the first shard's ShardMeta; every other
    shard is checked against it when first read. `shards` is a local directory, or with `cache_bytes` > 0
    any storage (read through a ShardCache in `cache_dir`; call `plan` with the read order, `close` at the end).
    """

    def __init__(
        self,
        shards: str | Path | Storage,
        *,
        max_samples: int = 0,
        verify_reads: bool = False,
        read_checks: NodeReadChecks | None = None,
        cache_dir: str | Path | None = None,
        cache_bytes: int = 0,
        stream: StreamSource | None = None,
        log=print,
        wait_record: WaitRecord | None = None,
    ):
        store = as_storage(shards)
        self.where, self.store, self.stream, self.log = store.url, store, stream, log
        self.wait_record = wait_record  # streaming: the durable note of a wait in progress (eyas status reads it)
        # with verify_reads, the checksums found (one process hashing alone unless the launch's node record is given)
        self.read_checks = (read_checks or NodeReadChecks(None)) if verify_reads else None
        if not cache_bytes and store.local_path() is None:
            raise ShardDataError(
                f"shards {store.url}: not a local directory; read it through a cache (train.cache_bytes > 0) "
                f"or from the local copy extraction keeps (RUN/shards)"
            )
        self.shards_dir = store.local_path()
        self._rows = planned_rows(stream) if stream is not None else self._manifest_rows(store)
        total = self._rows[-1].sample_end
        if max_samples > total:
            raise ShardDataError(
                f"max_samples={max_samples}: the shards in {store.url} hold only {total} samples; "
                f"lower max_samples (0 = all) or extract more"
            )
        if cache_bytes and cache_dir is None:
            raise ValueError(f"shards {store.url}: cache_bytes={cache_bytes} needs a cache_dir")
        resolve = None
        if stream is not None:  # the cache fetches ahead only what is verified
            planned = list(self._rows)
            resolve = lambda k: verified_now(store, planned[k], mode=stream.verify_mode)  # noqa: E731
        self.cache = (
            ShardCache(store, self._rows, cache_dir, cache_bytes, log=log, resolve=resolve, wait_record=wait_record)
            if cache_bytes
            else None
        )
        self._starts = [r.sample_start for r in self._rows]
        self.num_samples = max_samples or total
        self._offsets: dict[int, torch.Tensor] = {}
        self._checked: set[int] = set()
        self._verified: set[int] = set()  # streaming: the shards whose committed row a verdict names
        self._layouts: dict[int, dict[str, StoredTensor]] = {}
        self._read_lock = threading.Lock()  # the input pipeline's thread and the loop's evaluation both read
        if stream is not None:  # extract.json precedes every shard: no shard is waited for before step 1
            self.meta = stream_meta(store, stream, log=log, record=wait_record)
        else:
            with self._opened(0) as path, safe_open(path, framework="pt") as f:
                self.meta = self._parse(0, f)
        self._feature_names = [n for n in self.meta.tensor_names() if n not in BASE_TENSOR_NAMES]

    @staticmethod
    def _manifest_rows(store: Storage) -> list:
        """The manifest's rows, covering samples 0..n-1 without a gap or an overlap."""
        if not store.exists(MANIFEST_NAME):
            raise ShardDataError(f"shards_dir {store.url!r}: no {MANIFEST_NAME}; run extraction (eyas extract) first")
        rows = read_manifest(store)
        if not rows:
            raise ShardDataError(
                f"{store.url}/{MANIFEST_NAME}: the manifest has no rows; extraction wrote no shard: run "
                "extraction (eyas extract) again"
            )
        problems = coverage_problems(rows, rows[-1].sample_end, where=f"{store.url}/{MANIFEST_NAME}")
        if problems:
            raise ShardDataError("; ".join(problems))
        return rows

    def __len__(self) -> int:
        return self.num_samples

    def shard_starts(self) -> tuple[int, ...]:
        """The first sample of every shard (for a shard-local order, eyas.train.data.ShardWindows)."""
        return tuple(self._starts)

    def plan(self, sample_ids: list[int]) -> None:
        """The samples this reader will load, in order: a cache fetches their shards ahead (no-op without)."""
        if self.cache is not None:
            self.cache.plan([self.locate(i)[0] for i in sample_ids])

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
        if self.read_checks is not None:
            self.read_checks.close()

    def _path(self, shard: int) -> Path:
        return self.shards_dir / self._rows[shard].file

    @contextmanager
    def _opened(self, shard: int):
        """The shard's local file: through the cache (which checked its checksum on fetch), or in the local
        directory (its size checked on first use, with verify_reads its checksum; before safe_open, so a
        truncated file is named, not a parse error)."""
        if self.cache is not None:
            with self.cache.opened(shard) as path:
                yield path
            return
        if shard not in self._checked:
            self._await_verified(shard)
            self._check_file(shard)
            self._checked.add(shard)
        yield self._path(shard)

    def _await_verified(self, shard: int) -> None:
        """Streaming: block until the shard's committed bytes are verified and take its committed row; outside the
        read lock, so a read of a shard already here (an evaluation) does not wait behind a wait for a later one."""
        if self.stream is None or shard in self._verified:
            return
        row = wait_for_shard(self.store, self._rows[shard], mode=self.stream.verify_mode, log=self.log,
                             record=self.wait_record)  # fmt: skip
        if self.cache is not None:
            self.cache.resolved(shard, row)
        with self._read_lock:
            self._rows[shard] = row
            self._verified.add(shard)

    def _check_file(self, shard: int) -> None:
        """The file is the one the manifest lists: its size always, its checksum with verify_reads."""
        row, path = self._rows[shard], self._path(shard)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ShardDataError(
                f"shard {row.file}: listed in the manifest, missing on disk; run eyas verify"
            ) from None
        if size != row.num_bytes:
            raise ShardDataError(
                f"shard {row.file}: {size} bytes, the manifest says {row.num_bytes}; the file changed after "
                "extraction (truncated or replaced): run eyas verify, which quarantines and re-extracts it"
            )
        problem = self.read_checks.checksum_problem(row, path) if self.read_checks is not None else None
        if problem:
            raise ShardDataError(problem)

    def _parse(self, shard: int, f) -> ShardMeta:
        """The shard's metadata, checked against its manifest row."""
        row = self._rows[shard]
        try:
            meta = ShardMeta.from_metadata(f.metadata(), source=f"shard {self.where}/{row.file}")
        except ValueError as e:
            raise ShardDataError(str(e)) from e
        if (meta.shard_index, meta.sample_start, meta.sample_end) != (
            row.shard_index,
            row.sample_start,
            row.sample_end,
        ):
            raise ShardDataError(
                f"shard {row.file}: holds shard {meta.shard_index} (samples {meta.sample_start}..{meta.sample_end}), "
                f"the manifest says shard {row.shard_index} (samples {row.sample_start}..{row.sample_end}); files "
                f"swapped or renamed: run eyas verify, which quarantines it"
            )
        return meta

    def locate(self, index: int) -> tuple[int, int]:
        """(shard row, index within that shard) of a global sample index."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index}: expected 0 <= index < {self.num_samples}")
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._rows[shard].sample_start

    def _shard_offsets(self, shard: int, f) -> torch.Tensor:
        if shard not in self._offsets:
            row, meta = self._rows[shard], self._parse(shard, f)
            for key in RUN_FIELDS:
                if getattr(meta, key) != getattr(self.meta, key):
                    raise ShardDataError(
                        f"shard {row.file}: metadata {key}={getattr(meta, key)!r}, expected "
                        f"{getattr(self.meta, key)!r} as in {self._meta_source()}; the shards come from different "
                        f"extraction runs; re-extract into an empty shards_dir"
                    )
            offsets = f.get_tensor("sample_offsets")
            if offsets.numel() - 1 != row.sample_end - row.sample_start:
                raise ShardDataError(
                    f"shard {row.file}: {offsets.numel() - 1} samples in sample_offsets, manifest says "
                    f"{row.sample_end - row.sample_start}; run eyas verify and re-extract it"
                )
            self._offsets[shard] = offsets
        return self._offsets[shard]

    def _meta_source(self) -> str:
        return f"{self.where}/extract.json" if self.stream is not None else self._rows[0].file

    def stored_tensors(self) -> dict[str, StoredTensor]:
        """The dtype and row shape of every per-token tensor a sample has (the first shard's; every shard agrees)."""
        # streaming: shard 0 may not exist yet, and every verified shard holds exactly these (eyas.verify.checks)
        if self.stream is not None:
            layout = {**self.meta.encoding.feature_layout(0, num_aux=self.meta.num_aux, hidden_size=self.meta.hidden_size),
                      "input_ids": ("I64", (0,)), "loss_mask": ("U8", (0,))}  # fmt: skip
            return {n: StoredTensor(ST_TORCH[dt], shape[1:], 0, 0) for n, (dt, shape) in layout.items()
                    if n in [*self._feature_names, "input_ids", "loss_mask"]}  # fmt: skip
        with self._read_lock:
            if 0 not in self._layouts:
                with self._opened(0) as path:
                    self._layouts[0] = tensor_layout(path)
            return {n: self._layouts[0][n] for n in [*self._feature_names, "input_ids", "loss_mask"]}

    def num_tokens(self, index: int) -> int:
        """The sample's token count (its shard's sample_offsets, read once per shard)."""
        shard, local = self.locate(index)
        self._await_verified(shard)
        with self._read_lock:
            if shard not in self._offsets:
                with self._opened(shard) as path, safe_open(path, framework="pt") as f:
                    self._shard_offsets(shard, f)
            offsets = self._offsets[shard]
        return int(offsets[local + 1] - offsets[local])

    def read_sample_into(self, index: int, into: dict[str, torch.Tensor]) -> None:
        """The sample's first n tokens of each stored tensor (input_ids, loss_mask and the features as stored, by
        their names in the shard) read straight into `into[name]`, contiguous [n, ...] (a batch's row): no copy
        in between. Checked as load_sample checks."""
        self._await_verified(self.locate(index)[0])
        with self._read_lock:
            self._load_sample(index, decoded=False, into=into)

    def load_sample(self, index: int, *, decoded: bool = True) -> dict[str, torch.Tensor | int]:
        """One sample as tensors: input_ids [T], loss_mask [T], aux_hidden [T, nH] (decoded), and the teacher:
        last_hidden [T, H], or topk_ids and topk_logprobs [T, K]. `decoded=False` leaves float8 aux as stored,
        with their aux_scales [T, n_aux], for decode_aux where the batch lies (eyas.train.input_pipeline).
        Safe to call from several threads (one read at a time)."""
        self._await_verified(self.locate(index)[0])
        with self._read_lock:
            return self._load_sample(index, decoded)

    def _load_sample(self, index: int, decoded: bool, into: dict | None = None) -> dict[str, torch.Tensor | int]:
        shard, local = self.locate(index)
        with self._opened(shard) as path, safe_open(path, framework="pt") as f:
            offsets = self._shard_offsets(shard, f)
            stored = int(f.get_slice("sample_indices")[local : local + 1][0])
            if stored != index:
                raise ShardDataError(
                    f"shard {self._rows[shard].file}: position {local} holds sample {stored}, expected "
                    f"{index} from the manifest; the shard and manifest disagree; run eyas verify"
                )
            a, b = int(offsets[local]), int(offsets[local + 1])
            if shard not in self._layouts:
                self._layouts[shard] = tensor_layout(path)
            names = [*self._feature_names, "input_ids", "loss_mask"]
            if into is not None:
                n = into["input_ids"].shape[0]
                read_rows(path, self._layouts[shard], names, a, a + n, into)
                return {}
            rows = read_rows(path, self._layouts[shard], names, a, b)
        stored = {name: rows[name] for name in self._feature_names}
        sample: dict = {name: rows[name] for name in ("input_ids", "loss_mask")}
        if decoded:
            sample["aux_hidden"] = decode_aux(stored, self.meta.encoding, num_aux=self.meta.num_aux)
        else:
            sample["aux_hidden"] = stored["aux_hidden_states"]
            if "aux_scales" in stored:
                sample["aux_scales"] = stored["aux_scales"]
        sample.update({key: stored[name] for name, key in TEACHER_KEYS.items() if name in stored})
        sample["sample_index"] = index
        return sample
