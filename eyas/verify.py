"""Verification of hidden-state shards against their manifest, the run config and the dataset.

    report = verify_shards(shards_dir=..., tokenized_path=..., expected=ExpectedShardMeta(...), mode="full")
    write_verify_report(report, "verify/report.parquet"); raise_if_bad(report)

Cheap mode reads headers, metadata, offsets and the manifest; full mode also hashes every byte,
checks every hidden value is finite (streamed in chunks) and compares `input_ids` and `loss_mask`
with the tokenized dataset. Each shard stops at its first failing check, which becomes its reason.
Bad shards are quarantined with `eyas.shards.quarantine_shards(dir, report.bad_files)` and the next
extraction run re-extracts them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors import SafetensorError, safe_open

from eyas.fsio import atomic_write_bytes
from eyas.shards import (
    FORMAT_VERSION,
    SHARD_NAME_RE,
    SHARD_TENSOR_NAMES,
    ManifestRow,
    ShardMeta,
    TokenizedDataset,
    read_dataset_hash,
    read_manifest,
    sha256_file,
    shard_filename,
    shard_files,
)
from eyas.target import LAYER_ID_CONVENTION

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_CHUNK_BYTES = 64 << 20
_FIX = "quarantine the shard (eyas.shards.quarantine_shards) and re-run extraction"


class ShardVerificationError(RuntimeError):
    """Some shards failed verification; `.report` holds every row."""

    def __init__(self, message: str, report: "VerifyReport"):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class ExpectedShardMeta:
    """What the run config says every shard's metadata must be."""

    target_fingerprint: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    num_aux: int
    dtype: str
    dataset_hash: str
    layer_id_convention: str = LAYER_ID_CONVENTION


@dataclass
class ShardReportRow:
    shard: int  # -1 when the file name is not a shard name
    file: str
    status: str  # "ok" or "bad"
    checks_passed: list[str]
    reason: str  # "" when ok
    num_tokens: int
    num_bytes: int
    seconds: float


@dataclass
class VerifyReport:
    mode: str
    rows: list[ShardReportRow]
    problems: list[str] = field(default_factory=list)  # directory-level: coverage, dataset identity

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.status == "ok" for r in self.rows)

    @property
    def bad_files(self) -> list[str]:
        return [r.file for r in self.rows if r.status != "ok"]

    def summary(self) -> dict:
        good = [r for r in self.rows if r.status == "ok"]
        return {
            "mode": self.mode,
            "shards": len(self.rows),
            "ok": len(good),
            "bad": len(self.rows) - len(good),
            "tokens": sum(r.num_tokens for r in good),
            "bytes": sum(r.num_bytes for r in self.rows),
            "problems": len(self.problems),
        }


def expected_shard_meta(
    *, target_path: str | Path, aux_layer_ids: list[int] | None, dtype: str, tokenized_path: str | Path
) -> ExpectedShardMeta:
    """The expectation from the run config (target files, configured layer ids, dataset), not from the shards."""
    from eyas.extract import target_dims
    from eyas.target import resolve_aux_layer_ids, target_fingerprint

    num_layers, hidden = target_dims(target_path)
    ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    return ExpectedShardMeta(
        target_fingerprint=target_fingerprint(target_path),
        aux_layer_ids=tuple(ids),
        hidden_size=hidden,
        num_aux=len(ids),
        dtype=dtype,
        dataset_hash=read_dataset_hash(Path(tokenized_path)),
    )


class _Bad(Exception):
    """One failed check; the message is the shard's reason."""


@dataclass
class _Shard:
    path: Path
    row: ManifestRow | None
    expected: ExpectedShardMeta
    dataset: TokenizedDataset
    meta: ShardMeta | None = None
    infos: dict = field(default_factory=dict)  # name -> (dtype, shape)
    offsets: torch.Tensor | None = None


def _check_listed(s: _Shard) -> None:
    if s.row is None:
        raise _Bad(
            "not in the manifest: an unfinished write (crash before its manifest row) or a foreign file; "
            "the next extraction run rewrites it, or quarantine it"
        )
    if not s.path.is_file():
        raise _Bad(f"listed in the manifest but missing on disk; {_FIX}")
    size = s.path.stat().st_size
    if size != s.row.num_bytes:
        raise _Bad(f"file has {size} bytes, the manifest says {s.row.num_bytes} (truncated or overwritten); {_FIX}")


def _check_sha256(s: _Shard) -> None:
    digest = sha256_file(s.path)
    if digest != s.row.sha256:
        raise _Bad(
            f"checksum mismatch: sha256 {digest[:16]}..., the manifest says {s.row.sha256[:16]}... "
            f"(bytes changed after writing: disk or copy corruption); {_FIX}"
        )


def _check_header(s: _Shard) -> None:
    try:
        with safe_open(str(s.path), framework="pt") as f:
            metadata = f.metadata()
            s.infos = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except SafetensorError as e:
        raise _Bad(f"safetensors header does not parse ({e}); {_FIX}") from e
    try:
        s.meta = ShardMeta.from_metadata(metadata, source="header")
    except ValueError as e:
        raise _Bad(str(e)) from e
    if s.meta.format_version != FORMAT_VERSION:
        raise _Bad(f"format_version {s.meta.format_version!r}, expected {FORMAT_VERSION!r}; {_FIX}")


def _check_expected(s: _Shard) -> None:
    m, e = s.meta, s.expected
    diffs = [
        f"{name} {found!r}, expected {want!r}"
        for name, found, want in [
            ("target_fingerprint", m.target_fingerprint, e.target_fingerprint),
            ("aux_layer_ids", list(m.aux_layer_ids), list(e.aux_layer_ids)),
            ("layer_id_convention", m.layer_id_convention, e.layer_id_convention),
            ("hidden_size", m.hidden_size, e.hidden_size),
            ("num_aux", m.num_aux, e.num_aux),
            ("dtype", m.dtype, e.dtype),
            ("dataset_hash", m.dataset_hash, e.dataset_hash),
        ]
        if found != want
    ]
    if diffs:
        raise _Bad(
            f"metadata disagrees with the run config: {'; '.join(diffs)} "
            f"(extracted with another target, layer ids or dataset); {_FIX}"
        )
    r = s.row
    if (m.shard_index, m.sample_start, m.sample_end) != (
        r.shard_index,
        r.sample_start,
        r.sample_end,
    ) or s.path.name != shard_filename(m.shard_index):
        raise _Bad(
            f"metadata says shard {m.shard_index} samples {m.sample_start}..{m.sample_end}, the manifest "
            f"says shard {r.shard_index} ({r.file}) samples {r.sample_start}..{r.sample_end}; {_FIX}"
        )


def _check_layout(s: _Shard) -> None:
    missing = sorted(set(SHARD_TENSOR_NAMES) - set(s.infos))
    unexpected = sorted(set(s.infos) - set(SHARD_TENSOR_NAMES))
    if missing or unexpected:
        raise _Bad(f"tensors missing {missing}, unexpected {unexpected}; expected {sorted(SHARD_TENSOR_NAMES)}; {_FIX}")
    m, t, n = s.meta, s.row.num_tokens, s.row.sample_end - s.row.sample_start
    hidden = _ST_DTYPES.get(m.dtype, m.dtype)
    want = {
        "input_ids": ("I64", (t,)),
        "loss_mask": ("U8", (t,)),
        "aux_hidden_states": (hidden, (t, m.num_aux * m.hidden_size)),
        "last_hidden_states": (hidden, (t, m.hidden_size)),
        "sample_offsets": ("I64", (n + 1,)),
        "sample_indices": ("I64", (n,)),
    }
    for name, (dtype, shape) in want.items():
        found_dtype, found_shape = s.infos[name]
        if found_dtype != dtype:
            raise _Bad(f"{name} dtype {found_dtype}, expected {dtype} (metadata dtype {m.dtype}); {_FIX}")
        if name == "aux_hidden_states" and found_shape[1:] != shape[1:]:
            width = found_shape[1] if len(found_shape) == 2 else list(found_shape[1:])
            raise _Bad(
                f"aux_hidden_states width {width}, expected {shape[1]} ({m.num_aux} layers x "
                f"{m.hidden_size}); the backend did not return the aux layers' states "
                f"(see eyas.extract.check_aux_width for causes); {_FIX}"
            )
        if found_shape != shape:
            raise _Bad(
                f"{name} shape {list(found_shape)}, expected {list(shape)} ({t} tokens, {n} samples, "
                f"H={m.hidden_size}); {_FIX}"
            )


def _check_offsets(s: _Shard) -> None:
    with safe_open(str(s.path), framework="pt") as f:
        offsets, indices = f.get_tensor("sample_offsets"), f.get_tensor("sample_indices")
    r, t = s.row, s.row.num_tokens
    if offsets[0] != 0 or offsets[-1] != t or not bool((offsets[1:] > offsets[:-1]).all()):
        raise _Bad(f"sample_offsets {offsets.tolist()[:8]}...: expected strictly increasing from 0 to {t}; {_FIX}")
    if not torch.equal(indices, torch.arange(r.sample_start, r.sample_end)):
        raise _Bad(f"sample_indices {indices.tolist()[:8]}..., expected {r.sample_start}..{r.sample_end - 1}; {_FIX}")
    want = torch.tensor(s.dataset.num_tokens[r.sample_start : r.sample_end], dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    if not torch.equal(lengths, want):
        i = int((lengths != want).nonzero()[0])
        raise _Bad(
            f"sample {r.sample_start + i} has {int(lengths[i])} tokens, the tokenized dataset has "
            f"{int(want[i])}; {_FIX}"
        )
    s.offsets = offsets


def _check_finite(s: _Shard) -> None:
    with safe_open(str(s.path), framework="pt") as f:
        for name in ("aux_hidden_states", "last_hidden_states"):
            sl = f.get_slice(name)
            rows, width = sl.get_shape()
            step = max(1, _CHUNK_BYTES // max(1, width * 4))
            for a in range(0, rows, step):
                bad = ~torch.isfinite(sl[a : a + step]).all(dim=1)
                if bool(bad.any()):
                    token = a + int(bad.nonzero()[0])
                    sample = s.row.sample_start + int(torch.searchsorted(s.offsets, token, right=True)) - 1
                    raise _Bad(
                        f"{name} has non-finite values (first at token {token}, sample {sample}); the target "
                        f"produced NaN/inf (float16 overflow? extract in bfloat16 or float32); {_FIX}"
                    )


def _check_dataset(s: _Shard) -> None:
    r = s.row
    ids, mask = s.dataset.tokens(r.sample_start, r.sample_end)
    with safe_open(str(s.path), framework="pt") as f:
        for name, want in (("input_ids", ids), ("loss_mask", mask)):
            found = f.get_tensor(name)
            if not torch.equal(found, want.to(found.dtype)):
                token = int((found != want.to(found.dtype)).nonzero()[0])
                sample = r.sample_start + int(torch.searchsorted(s.offsets, token, right=True)) - 1
                raise _Bad(
                    f"{name} differs from the tokenized dataset at token {token} (sample {sample}): shard "
                    f"has {int(found[token])}, dataset has {int(want[token])}; the shard was extracted from "
                    f"another dataset; {_FIX}"
                )


_CHEAP = [
    ("listed", _check_listed),
    ("header", _check_header),
    ("metadata", _check_expected),
    ("layout", _check_layout),
    ("offsets", _check_offsets),
]
_FULL = [
    ("listed", _check_listed),
    ("sha256", _check_sha256),
    *_CHEAP[1:],
    ("finite", _check_finite),
    ("dataset", _check_dataset),
]


def _check_mode(mode: str) -> None:
    if mode not in ("cheap", "full"):
        raise ValueError(f"verify mode {mode!r}: expected 'cheap' or 'full'")


def verify_shard(
    path: Path,
    *,
    row: ManifestRow | None,
    expected: ExpectedShardMeta,
    dataset: TokenizedDataset,
    mode: Literal["cheap", "full"],
) -> ShardReportRow:
    """Run the mode's checks on one shard file, stopping at the first failure."""
    _check_mode(mode)
    t0, path = time.perf_counter(), Path(path)
    s = _Shard(path=path, row=row, expected=expected, dataset=dataset)
    passed, reason = [], ""
    try:
        for name, check in _FULL if mode == "full" else _CHEAP:
            check(s)
            passed.append(name)
    except _Bad as e:
        reason = f"{path.name}: {e}"
    match = SHARD_NAME_RE.match(path.name)
    return ShardReportRow(
        shard=row.shard_index if row else int(match.group(1)) if match else -1,
        file=path.name,
        status="bad" if reason else "ok",
        checks_passed=passed,
        reason=reason,
        num_tokens=row.num_tokens if row else 0,
        num_bytes=path.stat().st_size if path.is_file() else 0,
        seconds=time.perf_counter() - t0,
    )


def _coverage_problems(rows: list[ManifestRow], num_samples: int, shards_dir: Path) -> list[str]:
    problems, pos = [], 0
    for r in rows:
        if r.sample_start > pos:
            problems.append(
                f"{shards_dir}: samples {pos}..{r.sample_start - 1} are in no shard of the manifest; "
                f"re-run extraction to fill them"
            )
        elif r.sample_start < pos:
            problems.append(
                f"{shards_dir}: {r.file} starts at sample {r.sample_start}, overlapping the previous "
                f"shard (which ends at {pos - 1}); move the directory aside and extract again"
            )
        pos = max(pos, r.sample_end)
    if pos < num_samples:
        problems.append(
            f"{shards_dir}: samples {pos}..{num_samples - 1} (of {num_samples}) are in no shard of the "
            f"manifest; re-run extraction to fill them"
        )
    return problems


def verify_shards(
    *,
    shards_dir: str | Path,
    tokenized_path: str | Path,
    expected: ExpectedShardMeta,
    mode: Literal["cheap", "full"] = "full",
) -> VerifyReport:
    """Verify every manifest row and every shard file in `shards_dir`; never raises for bad shards."""
    _check_mode(mode)
    shards_dir = Path(shards_dir)
    if not shards_dir.is_dir():
        raise FileNotFoundError(f"shards dir {shards_dir}: no such directory; run extraction first")
    dataset = TokenizedDataset(Path(tokenized_path))
    manifest = read_manifest(shards_dir)
    by_file = {r.file: r for r in manifest}
    files = sorted({p.name for p in shard_files(shards_dir)} | set(by_file))
    rows = [
        verify_shard(shards_dir / f, row=by_file.get(f), expected=expected, dataset=dataset, mode=mode) for f in files
    ]
    problems = _coverage_problems(manifest, len(dataset), shards_dir)
    if dataset.dataset_hash != expected.dataset_hash:
        problems.append(
            f"tokenized dataset {tokenized_path}: content hash {dataset.dataset_hash!r}, expected "
            f"{expected.dataset_hash!r}; verify against the dataset the run extracted from"
        )
    return VerifyReport(mode=mode, rows=rows, problems=problems)


REPORT_SCHEMA = pa.schema(
    [
        ("shard", pa.int64()),
        ("file", pa.string()),
        ("status", pa.string()),
        ("checks_passed", pa.list_(pa.string())),
        ("reason", pa.string()),
        ("num_tokens", pa.int64()),
        ("num_bytes", pa.int64()),
        ("seconds", pa.float64()),
    ]
)


def write_verify_report(report: VerifyReport, path: str | Path) -> Path:
    """The per-shard rows as Parquet (mode and directory-level problems in the schema metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {b"eyas.verify.mode": report.mode.encode(), b"eyas.verify.problems": "\n".join(report.problems).encode()}
    table = pa.Table.from_pylist([asdict(r) for r in report.rows], schema=REPORT_SCHEMA.with_metadata(meta))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    return path


def raise_if_bad(report: VerifyReport) -> None:
    """Raise ShardVerificationError listing every bad shard and every directory-level problem."""
    if report.ok:
        return
    bad = [r for r in report.rows if r.status != "ok"]
    lines = [r.reason for r in bad] + report.problems
    raise ShardVerificationError(
        f"shard verification ({report.mode}) failed: {len(bad)} of {len(report.rows)} shards bad, "
        f"{len(report.problems)} directory problems:\n  " + "\n  ".join(lines),
        report,
    )
