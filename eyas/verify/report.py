"""The verification report: one row per shard file (ok, or bad with the reason of its first failed check),
and the directory-level problems; written as `RUN/verify/report.parquet` and read back only here.

    write_verify_report(report, path);  report = read_verify_report(path)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from eyas.fsio import atomic_write_bytes
from eyas.verify.checks import FULL_CHECKS


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
    workers: str = ""  # what checked the shards: "one thread", "2 threads", "2 processes" (eyas.verify.workers)

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

    @staticmethod
    def describe(summary: dict) -> str:
        """One sentence of a verification's summary (summary(), plus the flow's heal_rounds, quarantined and
        report), for logs."""
        s = summary
        healed = (
            f"; {s['quarantined']} quarantined and re-extracted in {s['heal_rounds']} healing "
            f"round{'s' * (s['heal_rounds'] != 1)}"
            if s.get("heal_rounds")
            else ""
        )
        return (
            f"verification ({s['mode']}): {s['ok']:,} of {s['shards']:,} shards ok, {s['bad']:,} bad "
            f"({s['tokens']:,} tokens, {s['bytes'] / (1 << 20):,.1f} MiB in {s['seconds']:.1f} s){healed}"
            + (f"; report {s['report']}" if s.get("report") else "")
        )

    def outcome_table(self, *, max_examples: int = 3) -> list[dict]:
        """One row per outcome ('ok', or the first failed check): shards, tokens, bytes, example reasons."""
        groups: dict[str, list[ShardReportRow]] = {}
        for r in self.rows:
            groups.setdefault("ok" if r.status == "ok" else f"failed: {failed_check(r)}", []).append(r)
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


def failed_check(row: ShardReportRow) -> str:
    """The name of the first check a bad row failed (eyas.verify.checks order)."""
    order = [name for name, _ in FULL_CHECKS]
    done = set(row.checks_passed)
    return next((name for name in order if name not in done), "?")


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


MODE_KEY, PROBLEMS_KEY = b"eyas.verify.mode", b"eyas.verify.problems"


def write_verify_report(report: VerifyReport, path: str | Path) -> Path:
    """The per-shard rows as Parquet (mode and directory-level problems in the schema metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {MODE_KEY: report.mode.encode(), PROBLEMS_KEY: "\n".join(report.problems).encode()}
    table = pa.Table.from_pylist([asdict(r) for r in report.rows], schema=REPORT_SCHEMA.with_metadata(meta))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())
    return path


def read_verify_report(path: str | Path) -> VerifyReport:
    """A report written by `write_verify_report`; a file with other columns or metadata is refused."""
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    if table.schema.names != REPORT_SCHEMA.names or MODE_KEY not in meta:
        raise ValueError(
            f"{path}: columns {table.schema.names}, expected {REPORT_SCHEMA.names} and {MODE_KEY.decode()!r} in its "
            "schema metadata; it is not an eyas verification report: run eyas verify again"
        )
    problems = [p for p in meta.get(PROBLEMS_KEY, b"").decode().split("\n") if p]
    return VerifyReport(
        mode=meta[MODE_KEY].decode(), rows=[ShardReportRow(**r) for r in table.to_pylist()], problems=problems
    )
