"""One probe per pipeline stage for eyas.status: each reads the files that stage leaves and returns
(state, detail, evidence). Probes only read; a file that cannot be read is reported as such."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from eyas.checkpoint import TRAINER_STATE_FILE, latest_complete, list_checkpoints
from eyas.config import RunConfig, RunPaths
from eyas.dataset import read_tokenized_meta
from eyas.export import read_export_provenance
from eyas.extract import LOCK_NAME, RUN_META_NAME
from eyas.fsio import TMP_MARKER
from eyas.manifest import QUARANTINE_DIR, read_manifest
from eyas.preflight import alive_recorded
from eyas.target import read_safetensors_header
from eyas.train import total_steps

DONE, PARTIAL, RUNNING, FAILED, STALE = "done", "partial", "running", "failed", "stale"
NOT_STARTED, UNREADABLE = "not started", "unreadable"
STATES = (DONE, PARTIAL, RUNNING, FAILED, STALE, NOT_STARTED, UNREADABLE)
# What a damaged or foreign file raises when read (pyarrow's errors are ValueErrors, json's too).
READ_ERRORS = (OSError, ValueError, KeyError, TypeError)
# The sections the approval gate fingerprints (flows/gate.py GATE_SECTIONS; tests/test_status.py pins them equal).
APPROVAL_SECTIONS = ("target", "dataset", "extract", "draft", "train")
METRICS_TAIL_BYTES = 256 << 10


@dataclass
class Context:
    """What the probes share: the run's paths, its config (if known), and the figures they find."""

    workdir: Path
    config: RunConfig | None
    progress: dict = field(default_factory=dict)
    manifest_files: set[str] = field(default_factory=set)

    @property
    def paths(self) -> RunPaths:
        return RunPaths(self.workdir)

    def rel(self, path: Path) -> str:
        return str(Path(path).relative_to(self.workdir)) if Path(path).is_relative_to(self.workdir) else str(path)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def probe_dataset(ctx: Context) -> tuple[str, str, str]:
    paths = ctx.paths
    if not paths.tokenized.is_file():
        return NOT_STARTED, "no tokenized dataset yet", ctx.rel(paths.tokenized)
    rows = pq.read_metadata(paths.tokenized).num_rows
    content_hash = read_tokenized_meta(paths.tokenized).get("eyas.content_hash", "?")
    report_path = paths.dataset_dir / "report.json"
    report = read_json(report_path) if report_path.is_file() else {}
    ctx.progress["dataset"] = {"num_samples": rows, "content_hash": content_hash, **report}
    detail = (
        f"{rows:,} samples, {report.get('num_tokens', 0):,} tokens ({report.get('num_loss_tokens', 0):,} loss-masked)"
    )
    if not paths.vocab.is_file():
        return PARTIAL, f"{detail}; the draft vocab mapping is missing", ctx.rel(paths.vocab)
    draft_vocab = read_safetensors_header(paths.vocab)["d2t"]["shape"][0]
    ctx.progress["dataset"]["draft_vocab_size"] = draft_vocab
    return DONE, f"{detail}, hash {content_hash}; draft vocab {draft_vocab:,}", ctx.rel(paths.tokenized)


def extraction_lock_held(lock_path: Path) -> bool:
    """Whether a process on this machine holds the extraction lock, read from /proc/locks (taking the
    lock to find out would race a starting coordinator). A holder on another machine is not seen."""
    try:
        st, locks = lock_path.stat(), Path("/proc/locks").read_text()
    except OSError:
        return False
    lock_id = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(lock_id in line.split() for line in locks.splitlines() if "->" not in line)


def probe_extract(ctx: Context) -> tuple[str, str, str]:
    shards = ctx.paths.shards_dir
    meta_path = shards / RUN_META_NAME
    rows = read_manifest(shards) if shards.is_dir() else []
    ctx.manifest_files = {r.file for r in rows}
    if not meta_path.is_file():
        return NOT_STARTED, "no extraction recorded", ctx.rel(meta_path)
    meta = read_json(meta_path)
    planned = meta["num_shards"]
    quarantined = sorted((shards / QUARANTINE_DIR).glob("*.reason.txt")) if (shards / QUARANTINE_DIR).is_dir() else []
    ctx.progress["shards"] = {
        "done": len(rows),
        "planned": planned,
        "tokens_done": sum(r.num_tokens for r in rows),
        "bytes_done": sum(r.num_bytes for r in rows),
        "interrupted_writes": sum(1 for p in shards.rglob(f".*{TMP_MARKER}*") if p.is_file()),
        "quarantined": len(quarantined),
        "last_quarantine_reason": quarantined[-1].read_text().strip() if quarantined else "",
        "running_here": extraction_lock_held(shards / LOCK_NAME),
    }
    detail = f"{len(rows):,} of {planned:,} shards ({ctx.progress['shards']['tokens_done']:,} tokens, {meta['dtype']})"
    if ctx.config is not None and ctx.config.extract.storage_url:
        detail += f"; written to {ctx.config.extract.storage_url}, counted here from the local copy"
    mismatch = extract_mismatch(ctx, meta)
    if mismatch:
        return STALE, f"{detail}; {mismatch}", ctx.rel(meta_path)
    if ctx.progress["shards"]["running_here"]:
        return RUNNING, f"{detail}; an extraction holds {LOCK_NAME} now", ctx.rel(meta_path)
    return (DONE if len(rows) == planned else PARTIAL), detail, ctx.rel(shards / "manifest.parquet")


def extract_mismatch(ctx: Context, meta: dict) -> str:
    """What extract.json records that the config (or the tokenized dataset) now contradicts; '' if nothing."""
    wanted = {}
    if ctx.config is not None:
        e = ctx.config.extract
        wanted = {"dtype": e.dtype, "shard_bytes": e.shard_bytes, "backend": e.backend}
        wanted["target_dtype"] = ctx.config.target.dtype
        if ctx.config.target.aux_layer_ids is not None:
            wanted["aux_layer_ids"] = ctx.config.target.aux_layer_ids
    if "dataset" in ctx.progress:
        wanted["dataset_hash"] = ctx.progress["dataset"]["content_hash"]
    diffs = [f"{k}={meta.get(k)!r} there, {v!r} now" for k, v in wanted.items() if meta.get(k) != v]
    if not diffs:
        return ""
    return (
        f"extract.json records other parameters ({'; '.join(diffs)}): a resume is refused; use a new workdir or "
        f"move {ctx.paths.shards_dir} aside"
    )


def probe_verify(ctx: Context) -> tuple[str, str, str]:
    path = ctx.paths.verify_report
    if not path.is_file():
        return NOT_STARTED, "no verification report", ctx.rel(path)
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    mode = meta.get(b"eyas.verify.mode", b"?").decode()
    problems = [p for p in meta.get(b"eyas.verify.problems", b"").decode().split("\n") if p]
    rows = table.select(["file", "status", "reason"]).to_pylist()
    ok = {r["file"] for r in rows if r["status"] == "ok"}
    bad = [f"{r['file']}: {r['reason']}" for r in rows if r["status"] != "ok"]
    verified = len(ok & ctx.manifest_files)
    unverified = len(ctx.manifest_files - ok)
    ctx.progress["verified"] = {"ok": verified, "bad": len(bad), "unverified": unverified, "mode": mode}
    detail = f"{verified:,} shards ok ({mode} mode)"
    if bad or problems:
        shown = "; ".join((bad + problems)[:3])
        return FAILED, f"{detail}, {len(bad)} bad, {len(problems)} directory problems: {shown}", ctx.rel(path)
    if unverified:
        return STALE, f"{detail}; {unverified:,} shards extracted since were not verified", ctx.rel(path)
    shards = ctx.progress.get("shards", {})
    state = DONE if shards and shards["done"] == shards["planned"] else PARTIAL
    return state, detail, ctx.rel(path)


def probe_smoke(ctx: Context) -> tuple[str, str, str]:
    path = ctx.paths.smoke_dir / "smoke.json"
    if not path.is_file():
        return NOT_STARTED, "no smoke run", ctx.rel(path)
    smoke = read_json(path)
    detail = f"loss {smoke['first']:.3f} -> {smoke['last']:.3f} in {smoke['num_steps']} steps"
    return (DONE if smoke["passed"] else FAILED), detail, ctx.rel(path)


def probe_approval(ctx: Context) -> tuple[str, str, str]:
    path = ctx.paths.root / "approval.json"
    if not path.is_file():
        return NOT_STARTED, "not approved yet", ctx.rel(path)
    record = read_json(path)
    detail = f"approved by {record['reviewer']} at {record['decided_at']}" + (
        f" ({record['note']})" if record.get("note") else ""
    )
    if ctx.config is not None and record["config_fingerprint"] != ctx.config.fingerprint(*APPROVAL_SECTIONS):
        return STALE, f"{detail}, for another configuration: the gate asks again", ctx.rel(path)
    return DONE, detail, ctx.rel(path)


def last_metrics(path: Path) -> dict | None:
    """The newest complete line of metrics.jsonl (a crash can cut the last one short)."""
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - METRICS_TAIL_BYTES))
        tail = f.read()
    for line in reversed(tail.splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def planned_train_steps(ctx: Context) -> int | None:
    if ctx.config is None or "dataset" not in ctx.progress:
        return None
    return total_steps(ctx.progress["dataset"]["num_samples"], ctx.config.train)


def probe_train(ctx: Context) -> tuple[str, str, str]:
    train_dir = ctx.paths.train_dir
    latest, planned = latest_complete(train_dir), planned_train_steps(ctx)
    incomplete = [path for _, path, done in list_checkpoints(train_dir) if not done]
    alive = alive_recorded(train_dir) if train_dir.is_dir() else []
    metrics = last_metrics(train_dir / "metrics.jsonl") if (train_dir / "metrics.jsonl").is_file() else None
    info = {
        "planned_steps": planned,
        "running_pids": [e["pid"] for e in alive],
        "incomplete_checkpoints": len(incomplete),
    }
    if latest is not None:
        state = read_json(latest / TRAINER_STATE_FILE)
        info |= {"checkpoint": str(latest), "step": state["step"], "samples_consumed": state["samples_consumed"]}
    if metrics is not None:
        keep = ("step", "epoch", "loss", "acc_k", "lr", "grad_norm", "elapsed_s")
        info["last_metrics"] = {k: metrics[k] for k in keep if k in metrics}
    ctx.progress["train"] = info
    of = f" of {planned:,}" if planned else ""
    at = f"newest complete checkpoint step {info['step']:,}{of}" if latest else "no complete checkpoint"
    if alive:
        return (
            RUNNING,
            f"trainer running (pid {', '.join(map(str, info['running_pids']))}); {at}",
            "train/processes.json",
        )
    final_path = train_dir / "final.json"
    if final_path.is_file() and latest is not None:
        final = read_json(final_path)
        if final["step"] == info["step"] and (planned is None or final["step"] >= planned):
            loss = final.get("final_loss")
            loss_text = f", loss {loss:.3f}" if isinstance(loss, (int, float)) else ""
            return DONE, f"finished at step {final['step']:,}{loss_text}", ctx.rel(final_path)
    if latest is None and metrics is None and not (train_dir / "torchrun.log").is_file():
        return NOT_STARTED, "not started", ctx.rel(train_dir / "checkpoints")
    last = f"; last logged step {metrics['step']:,}" if metrics else ""
    return PARTIAL, f"stopped: {at}{last}; a re-run resumes from the checkpoint", ctx.rel(train_dir / "checkpoints")


def probe_export(ctx: Context) -> tuple[str, str, str]:
    out = ctx.paths.export_dir / "sglang"
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        return NOT_STARTED, "no export", ctx.rel(out)
    provenance = read_export_provenance(out) or {}
    source = provenance.get("source_checkpoint", "")
    ctx.progress["export"] = {"dir": str(out), "source_checkpoint": source}
    detail = f"SGLang format from {Path(source).name or 'an unknown checkpoint'}"
    newest = ctx.progress.get("train", {}).get("checkpoint")
    if newest and Path(source).name != Path(newest).name:
        return STALE, f"{detail}; the newest complete checkpoint is {Path(newest).name}", ctx.rel(out)
    return DONE, detail, ctx.rel(out)


def probe_bench(ctx: Context) -> tuple[str, str, str]:
    bench, diagnosis = ctx.paths.bench_dir / "benchmark.json", ctx.paths.bench_dir / "diagnosis.json"
    if not bench.is_file():
        return NOT_STARTED, "no benchmark", ctx.rel(bench)
    result = read_json(bench)
    keep = ("engine", "tau_mean", "tau_ngram", "tau_random", "accept_rate_per_position", "speedup_vs_greedy")
    ctx.progress["acceptance"] = {k: result[k] for k in keep if k in result}
    detail = f"tau {result['tau_mean']:.2f} ({result['engine']} engine, {result.get('num_prompts', '?')} prompts)"
    if diagnosis.is_file() and diagnosis.stat().st_mtime >= bench.stat().st_mtime:
        conclusion = read_json(diagnosis).get("conclusion", "see the diagnosis")
        return FAILED, f"{detail}, below the floor: {conclusion}", ctx.rel(diagnosis)
    if ctx.config is not None and result["tau_mean"] < ctx.config.bench.min_tau:
        return FAILED, f"{detail}, below bench.min_tau {ctx.config.bench.min_tau}", ctx.rel(bench)
    exported = ctx.paths.export_dir / "sglang" / "model.safetensors"
    if exported.is_file() and exported.stat().st_mtime > bench.stat().st_mtime:
        return STALE, f"{detail}, of an earlier export", ctx.rel(bench)
    return DONE, detail, ctx.rel(bench)


def file_table(ctx: Context) -> list[dict]:
    """Where every file of the run lives, and whether it exists yet."""
    p, shards = ctx.paths, ctx.paths.shards_dir
    entries = [
        ("run config", p.root / "run.json"),
        ("tokenized dataset", p.tokenized),
        ("dataset report", p.dataset_dir / "report.json"),
        ("regenerated responses", p.dataset_dir / "responses.jsonl"),
        ("draft vocab mapping", p.vocab),
        ("shards", shards),
        ("extraction parameters", shards / "extract.json"),
        ("manifest", shards / "manifest.parquet"),
        ("quarantined shards", shards / "quarantine"),
        ("verification report", p.verify_report),
        ("smoke run", p.smoke_dir / "smoke.json"),
        ("approval", p.root / "approval.json"),
        ("trainer job", p.train_dir / "job.json"),
        ("trainer log", p.train_dir / "torchrun.log"),
        ("training metrics", p.train_dir / "metrics.jsonl"),
        ("checkpoints", p.train_dir / "checkpoints"),
        ("final training state", p.train_dir / "final.json"),
        ("exported drafter", p.export_dir / "sglang"),
        ("benchmark", p.bench_dir / "benchmark.json"),
        ("acceptance plots", p.bench_dir / "acceptance.png"),
        ("low-tau diagnosis", p.bench_dir / "diagnosis.json"),
    ]
    rows = [{"what": what, "path": str(path), "exists": path.exists()} for what, path in entries]
    if ctx.config is not None and ctx.config.extract.storage_url:
        rows.insert(6, {"what": "shards (source)", "path": ctx.config.extract.storage_url, "exists": None})
    return rows
