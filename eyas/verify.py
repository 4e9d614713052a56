"""Verification of hidden-state shards against their manifest, the run config and the dataset.

    report = verify_shards(shards_dir=..., tokenized_path=..., expected=ExpectedShardMeta(...), mode="full")
    write_verify_report(report, "verify/report.parquet"); raise_if_bad(report)

Cheap mode reads headers, metadata, sizes, offsets and the manifest; full mode also reads every byte
once (checksum and finiteness in the same streamed pass, see `eyas.verify_checks`) and compares
`input_ids` and `loss_mask` with the tokenized dataset. Shards are checked in parallel threads
(hashlib, numpy and file reads release the GIL). Each shard stops at its first failing check, which
becomes its reason. `quarantine_bad_shards(dir, report)` moves bad shards aside with their reasons;
the next extraction run re-extracts them.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eyas.fsio import atomic_write_bytes
from eyas.manifest import ManifestRow, quarantine_shards, read_manifest
from eyas.shards import SHARD_NAME_RE, TokenizedDataset, read_dataset_hash, shard_files
from eyas.verify_checks import (
    CHEAP_CHECKS,
    FIX,
    FULL_CHECKS,
    Bad,
    ExpectedShardMeta,
    ShardState,
    VerifyContext,
)

__all__ = [
    "ExpectedShardMeta",
    "ShardReportRow",
    "ShardVerificationError",
    "VerifyReport",
    "expected_shard_meta",
    "quarantine_bad_shards",
    "raise_if_bad",
    "verify_shard",
    "verify_shards",
    "write_verify_report",
]

DEFAULT_CHUNK_BYTES = 512 << 10  # fits a core's L2 cache: read once from memory, then hashed and tested in cache


class ShardVerificationError(RuntimeError):
    """Some shards failed verification; `.report` holds every row."""

    def __init__(self, message: str, report: "VerifyReport"):
        super().__init__(message)
        self.report = report


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
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.status == "ok" for r in self.rows)

    @property
    def bad_files(self) -> list[str]:
        return [r.file for r in self.rows if r.status != "ok"]

    @property
    def bad_reasons(self) -> dict[str, str]:
        return {r.file: r.reason for r in self.rows if r.status != "ok"}

    def summary(self) -> dict:
        good = [r for r in self.rows if r.status == "ok"]
        num_bytes = sum(r.num_bytes for r in self.rows)
        return {
            "mode": self.mode,
            "shards": len(self.rows),
            "ok": len(good),
            "bad": len(self.rows) - len(good),
            "tokens": sum(r.num_tokens for r in good),
            "bytes": num_bytes,
            "problems": len(self.problems),
            "seconds": round(self.seconds, 3),
            "gib_per_s": round(num_bytes / (1 << 30) / self.seconds, 3) if self.seconds > 0 else 0.0,
        }

    def outcome_table(self, *, max_examples: int = 3) -> list[dict]:
        """One row per outcome ('ok', or the first failed check): shards, tokens, bytes, example reasons."""
        groups: dict[str, list[ShardReportRow]] = {}
        for r in self.rows:
            groups.setdefault("ok" if r.status == "ok" else f"failed: {_failed_check(r)}", []).append(r)
        table = [
            {
                "outcome": outcome,
                "shards": len(rows),
                "tokens": sum(r.num_tokens for r in rows),
                "bytes": sum(r.num_bytes for r in rows),
                "seconds": round(sum(r.seconds for r in rows), 3),
                "examples": " | ".join(r.reason for r in rows[:max_examples]),
            }
            for outcome, rows in sorted(groups.items(), key=lambda kv: kv[0] != "ok")
        ]
        table += [
            {"outcome": "directory problem", "shards": 0, "tokens": 0, "bytes": 0, "seconds": 0.0, "examples": p}
            for p in self.problems
        ]
        return table


def _failed_check(row: ShardReportRow) -> str:
    order = [name for name, _ in FULL_CHECKS]
    done = set(row.checks_passed)
    return next((name for name in order if name not in done), "?")


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


def _check_mode(mode: str) -> None:
    if mode not in ("cheap", "full"):
        raise ValueError(f"verify mode {mode!r}: expected 'cheap' or 'full'")


def verify_shard(path: str | Path, *, row: ManifestRow | None, ctx: VerifyContext, mode: str) -> ShardReportRow:
    """Run the mode's checks on one shard file, stopping at the first failure."""
    t0, path = time.perf_counter(), os.fspath(path)
    s = ShardState(path=path, name=os.path.basename(path), row=row, ctx=ctx)
    passed, reason = [], ""
    try:
        for name, check in FULL_CHECKS if mode == "full" else CHEAP_CHECKS:
            check(s)
            passed.append(name)
    except Bad as e:
        reason = f"{s.name}: {e}"
    except OSError as e:  # a read that fails (EIO, permissions) is this shard's fault, not the run's
        reason = f"{s.name}: reading it failed ({e}); check the disk, then {FIX}"
    finally:
        if s.fd is not None:
            os.close(s.fd)
    match = SHARD_NAME_RE.match(s.name)
    return ShardReportRow(
        shard=row.shard_index if row else int(match.group(1)) if match else -1,
        file=s.name,
        status="bad" if reason else "ok",
        checks_passed=passed,
        reason=reason,
        num_tokens=row.num_tokens if row else 0,
        num_bytes=s.size,
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
    num_workers: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[dict], None] | None = None,
) -> VerifyReport:
    """Verify every manifest row and every shard file in `shards_dir` on `num_workers` threads
    (0 = one per core), reading at most `chunk_bytes` per thread at a time; never raises for bad shards."""
    _check_mode(mode)
    if num_workers < 0 or chunk_bytes < 1 << 12:
        raise ValueError(f"verify_shards: num_workers={num_workers} must be >= 0 and chunk_bytes={chunk_bytes} >= 4096")
    t0, shards_dir = time.perf_counter(), Path(shards_dir)
    if not shards_dir.is_dir():
        raise FileNotFoundError(f"shards dir {shards_dir}: no such directory; run extraction first")
    dataset = TokenizedDataset(Path(tokenized_path))
    token_starts = np.concatenate([[0], np.cumsum(dataset.num_tokens)]).astype("<i8")
    ctx = VerifyContext(expected, dataset, token_starts, chunk_bytes)
    manifest = read_manifest(shards_dir)
    by_file = {r.file: r for r in manifest}
    files = sorted({p.name for p in shard_files(shards_dir)} | set(by_file))

    def batch(names: list[str]) -> list[ShardReportRow]:
        return [verify_shard(os.path.join(root, n), row=by_file.get(n), ctx=ctx, mode=mode) for n in names]

    root, workers = str(shards_dir), num_workers or os.cpu_count() or 1
    # contiguous batches, several per thread: few hand-offs for tiny shards, balanced for big ones
    size = max(1, min(64, len(files) // (4 * workers)))
    rows: list[ShardReportRow] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        for done in pool.map(batch, [files[i : i + size] for i in range(0, len(files), size)]):
            rows += done
            if progress is not None:
                progress({"shards_done": len(rows), "shards_total": len(files), "bad": len(rows) - _num_ok(rows)})
    problems = _coverage_problems(manifest, len(dataset), shards_dir)
    if dataset.dataset_hash != expected.dataset_hash:
        problems.append(
            f"tokenized dataset {tokenized_path}: content hash {dataset.dataset_hash!r}, expected "
            f"{expected.dataset_hash!r}; verify against the dataset the run extracted from"
        )
    return VerifyReport(mode=mode, rows=rows, problems=problems, seconds=time.perf_counter() - t0)


def _num_ok(rows: list[ShardReportRow]) -> int:
    return sum(r.status == "ok" for r in rows)


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


def quarantine_bad_shards(shards_dir: str | Path, report: VerifyReport) -> list[Path]:
    """Move every bad shard of the report into `quarantine/` beside a `.reason.txt` holding its reason,
    and drop its manifest row, so that the next extraction run re-extracts it. Returns the reason files.

    Refuses when every shard's metadata disagrees with the run config: then the config (or the
    directory) is wrong, not the shards, and re-extracting everything would not be a repair."""
    bad = [r for r in report.rows if r.status != "ok"]
    if len(bad) > 1 and len(bad) == len(report.rows) and all(_failed_check(r) == "metadata" for r in bad):
        raise ShardVerificationError(
            f"{shards_dir}: all {len(bad)} shards' metadata disagree with the run config (first: {bad[0].reason}); "
            f"not quarantining: the config changed since extraction or points at another run's shards; fix the "
            f"config, or use a new shards_dir",
            report,
        )
    return quarantine_shards(Path(shards_dir), report.bad_reasons)


def raise_if_bad(report: VerifyReport, *, heal_rounds: int | None = None) -> None:
    """Raise ShardVerificationError listing every bad shard and every directory-level problem."""
    if report.ok:
        return
    bad = [r for r in report.rows if r.status != "ok"]
    lines = [r.reason for r in bad] + report.problems
    after = "" if heal_rounds is None else f" after {heal_rounds} healing round{'s' * (heal_rounds != 1)}"
    raise ShardVerificationError(
        f"shard verification ({report.mode}) failed{after}: {len(bad)} of {len(report.rows)} shards bad, "
        f"{len(report.problems)} directory problems:\n  " + "\n  ".join(lines),
        report,
    )
