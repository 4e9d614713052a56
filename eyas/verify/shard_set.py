"""Verification of hidden-state shards against their manifest, the run config and the dataset.

    report = verify_run(config, facts)           # the stage entry: verify RUN/shards, write the report
    report = verify_shards(shards_dir=..., tokenized_path=..., expected=expected_shard_meta(facts, "float32"))
    notes = quarantine_run(config, facts, report)
    raise_if_bad(report)

Cheap mode reads headers, metadata, sizes, offsets and the manifest; full mode also reads every byte
once (checksum and finiteness in the same streamed pass, see eyas.verify.checks) and compares
`input_ids` and `loss_mask` with the tokenized dataset. Shards are checked in parallel: on threads where
reads, hashing and numpy release the GIL (full mode, or cheap mode over S3), on one thread or forked
processes where parsing headers holds it (cheap mode over local files), measured (eyas.verify.workers). Each shard stops at its first failing check, which
becomes its reason (eyas.verify.report). Quarantine moves bad shards aside with their reasons; the
next extraction run re-extracts them.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal

import numpy as np

from eyas.config import RunConfig
from eyas.dataset.table import TokenizedDataset, read_dataset_hash, sample_lengths
from eyas.facts import RunFacts
from eyas.shards.encoding import ShardEncoding, extract_encoding
from eyas.shards.format import SHARD_NAME_RE, shard_names
from eyas.shards.manifest import ManifestRow, coverage_problems, drop_manifest_rows, read_manifest
from eyas.shards.shard_set import quarantine_shards
from eyas.storage import Storage, as_storage
from eyas.verify.checks import (
    CHEAP_CHECKS,
    FIX,
    FULL_CHECKS,
    Bad,
    ExpectedShardMeta,
    FileBytes,
    RangeBytes,
    ShardState,
    VerifyContext,
)
from eyas.verify.report import ShardReportRow, VerifyReport, failed_check, write_verify_report
from eyas.verify.workers import run_batches

DEFAULT_CHUNK_BYTES = 512 << 10  # fits a core's L2 cache: read once from memory, then hashed and tested in cache


class ShardVerificationError(RuntimeError):
    """Some shards failed verification; `.report` holds every row."""

    def __init__(self, message: str, report: VerifyReport):
        super().__init__(message)
        self.report = report


def expected_shard_meta(facts: RunFacts, encoding: "ShardEncoding | str") -> ExpectedShardMeta:
    """What every shard's metadata must say: from the run's facts (target files, configured layer ids, dataset)
    and the configured encoding (a dtype name: every state in it, teacher last_hidden), not from the shards."""
    enc = encoding if isinstance(encoding, ShardEncoding) else ShardEncoding(encoding, "last_hidden", 0, encoding)
    return ExpectedShardMeta(
        target_fingerprint=facts.target.fingerprint,
        aux_layer_ids=tuple(facts.aux_layer_ids),
        hidden_size=facts.hidden_size,
        num_aux=facts.num_aux,
        dtype=enc.dtype,
        dataset_hash=facts.dataset_hash,
        aux_dtype=enc.aux_dtype,
        teacher=enc.teacher,
        teacher_topk=enc.teacher_topk,
    )


def _check_mode(mode: str) -> None:
    if mode not in ("cheap", "full"):
        raise ValueError(f"verify mode {mode!r}: expected 'cheap' or 'full'")


def verify_shard(
    *, row: ManifestRow | None, ctx: VerifyContext, mode: str, name: str, opener: Callable[[], FileBytes | RangeBytes]
) -> ShardReportRow:
    """Run the mode's checks on one shard, `name`, read through `opener` (a local file or an object in storage),
    stopping at the first failure."""
    t0 = time.perf_counter()
    s = ShardState(name=name, row=row, ctx=ctx, opener=opener)
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
        if s.src is not None:
            s.src.close()
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


def verify_shards(
    *,
    shards_dir: str | Path | Storage,
    tokenized_path: str | Path,
    expected: ExpectedShardMeta,
    mode: Literal["cheap", "full"] = "full",
    num_workers: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Callable[[dict], None] | None = None,
) -> VerifyReport:
    """Verify every manifest row and every shard file in `shards_dir` on at most `num_workers` workers (0 = one
    per usable core; threads or processes, eyas.verify.workers), each reading at most `chunk_bytes` at a time;
    never raises for bad shards.

    `shards_dir` may be a storage without a local path (S3): cheap mode then reads each header and the small
    tensors it checks by range requests; full mode streams each shard into a temporary file (one per thread,
    unlinked once open, so a crash leaves nothing) and checks it there."""
    _check_mode(mode)
    if num_workers < 0 or chunk_bytes < 1 << 12:
        raise ValueError(f"verify_shards: num_workers={num_workers} must be >= 0 and chunk_bytes={chunk_bytes} >= 4096")
    t0 = time.perf_counter()
    store = as_storage(shards_dir)
    if store.local_path() is not None:
        shards_dir = store.local_path()
        if not shards_dir.is_dir():
            raise FileNotFoundError(f"shards dir {shards_dir}: no such directory; run extraction first")
    tokenized_path = Path(tokenized_path)
    if not tokenized_path.is_file():
        raise FileNotFoundError(f"tokenized dataset {tokenized_path}: no such file; run the dataset stage first")
    ctx = verify_context(tokenized_path, expected, mode, chunk_bytes)
    manifest = read_manifest(store)
    by_file = {r.file: r for r in manifest}
    with contextlib.ExitStack() as stack:
        if store.local_path() is not None:
            files = sorted(set(shard_names(shards_dir)) | set(by_file))

            def opener_of(name: str) -> Callable[[], FileBytes | RangeBytes]:
                return lambda: FileBytes(os.path.join(shards_dir, name))
        else:
            listing = {n: size for n, size in store.list().items() if n.endswith(".safetensors")}
            files = sorted(set(listing) | set(by_file))
            spool = stack.enter_context(tempfile.TemporaryDirectory(prefix="eyas-verify-"))

            def opener_of(name: str) -> Callable[[], FileBytes | RangeBytes]:
                return remote_opener(store, name, listing, mode, spool)

        def batch(names: list[str]) -> list[ShardReportRow]:
            return [verify_shard(row=by_file.get(n), ctx=ctx, mode=mode, name=n, opener=opener_of(n)) for n in names]

        def on_batch(rows: list[ShardReportRow]) -> None:
            if progress is not None:
                progress({"shards_done": len(rows), "shards_total": len(files), "bad": len(rows) - _num_ok(rows)})

        # only cheap mode over local files holds the GIL (eyas.verify.workers)
        holds_gil = mode == "cheap" and store.local_path() is not None
        rows, workers = run_batches(batch, files, holds_gil=holds_gil, num_workers=num_workers, on_batch=on_batch)
    problems = coverage_problems(manifest, len(ctx.token_starts) - 1, where=store.url)
    problems += [p for p in [dataset_hash_problem(tokenized_path, expected)] if p]
    return VerifyReport(mode=mode, rows=rows, problems=problems, seconds=time.perf_counter() - t0, workers=workers)


def verify_context(tokenized_path: Path, expected: ExpectedShardMeta, mode: str, chunk_bytes: int) -> VerifyContext:
    """What every shard is checked against: the samples' token counts (both modes) and, in full mode, the tokens."""
    lengths = sample_lengths(tokenized_path)  # cheap mode needs only these; full mode compares every token
    dataset = TokenizedDataset(tokenized_path) if mode == "full" else None
    token_starts = np.concatenate([[0], np.cumsum(lengths)]).astype("<i8")
    return VerifyContext(expected, dataset, token_starts, chunk_bytes)


def dataset_hash_problem(tokenized_path: Path, expected: ExpectedShardMeta) -> str:
    """Why the tokenized dataset is not the one the shards were extracted from, or "" when it is."""
    dataset_hash = read_dataset_hash(tokenized_path)
    if dataset_hash == expected.dataset_hash:
        return ""
    return (
        f"tokenized dataset {tokenized_path}: content hash {dataset_hash!r}, expected "
        f"{expected.dataset_hash!r}; verify against the dataset the run extracted from"
    )


def remote_opener(store: Storage, name: str, listing: dict[str, int], mode: str, spool: str):
    """How a shard in storage is read: by range requests (cheap), or streamed whole into a temporary file of
    `spool` (full: every byte is read anyway; the file is unlinked as soon as it is open)."""

    def opener() -> FileBytes | RangeBytes:
        if name not in listing:
            raise FileNotFoundError(f"{store.url}/{name}")
        if mode == "cheap":
            return RangeBytes(store, name, listing[name])
        fd, tmp = tempfile.mkstemp(dir=spool, suffix=".safetensors")
        os.close(fd)
        try:
            store.download_to(name, tmp)
            return FileBytes(tmp)
        finally:
            os.unlink(tmp)

    return opener


def _num_ok(rows: list[ShardReportRow]) -> int:
    return sum(r.status == "ok" for r in rows)


def quarantine_bad_shards(where: str | Path | Storage, report: VerifyReport) -> list[str]:
    """Move every bad shard of the report into `quarantine/` beside a `.reason.txt` holding its reason,
    and drop its manifest row, so that the next extraction run re-extracts it (a local directory or a
    storage). Returns the reason objects' names.

    Refuses when every shard's metadata disagrees with the run config: then the config (or the
    directory) is wrong, not the shards, and re-extracting everything would not be a repair."""
    bad = [r for r in report.rows if r.status != "ok"]
    if len(bad) > 1 and len(bad) == len(report.rows) and all(failed_check(r) == "metadata" for r in bad):
        raise ShardVerificationError(
            f"{as_storage(where).url}: all {len(bad)} shards' metadata disagree with the run config (first: {bad[0].reason}); "
            f"not quarantining: the config changed since extraction or points at another run's shards; fix the "
            f"config, or use a new shards_dir",
            report,
        )
    return quarantine_shards(where, report.bad_reasons)


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


def verify_run(config: RunConfig, facts: RunFacts, *, progress: Callable[[dict], None] | None = None) -> VerifyReport:
    """The stage entry: verify the run's shards (its local copy, or without one the storage) in the configured
    mode and write its report."""
    v = config.verify
    report = verify_shards(
        shards_dir=facts.shards(),
        tokenized_path=facts.tokenized_path,
        expected=expected_shard_meta(facts, extract_encoding(config.extract)),
        mode=v.mode,
        num_workers=v.num_workers,
        chunk_bytes=v.chunk_bytes,
        progress=progress,
    )
    write_verify_report(report, config.paths.verify_report)
    return report


def quarantine_run(config: RunConfig, facts: RunFacts, report: VerifyReport) -> list[str]:
    """Quarantine the report's bad shards where they were verified; when that was a local copy of shards written
    elsewhere (S3), drop their rows there too, so that the next extraction writes them again. Returns the
    reason objects' URLs."""
    store = facts.shards()
    notes = quarantine_bad_shards(store, report)
    if facts.shards_dir and config.extract.storage_url:  # the copy is set aside; the source must re-extract them
        drop_manifest_rows(facts.storage(), sorted(report.bad_reasons))
    return [f"{store.url}/{n}" for n in notes]
