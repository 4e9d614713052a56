"""One probe per pipeline stage for eyas.status: each asks the owner of what that stage leaves (the module
that writes it) and returns (state, detail, evidence). Probes only read; a file that cannot be read is
reported as such."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eyas.bench.acceptance import BENCHMARK_FILE, PLOTS_FILE, read_benchmark
from eyas.bench.diagnose import DIAGNOSIS_FILE, read_diagnosis
from eyas.config import RunConfig, RunPaths
from eyas.dataset.build import REPORT_FILE, RESPONSES_FILE, read_dataset_report
from eyas.dataset.table import read_tokenized_meta, tokenized_num_samples
from eyas.dataset.vocab import vocab_sizes
from eyas.export.convert import SGLANG_EXPORT
from eyas.export.drafter_dir import MODEL_FILE, export_state
from eyas.facts import shard_source
from eyas.gate.approval import (
    APPROVAL_RECORD,
    REJECTION_RECORD,
    gate_fingerprint,
    read_approval_record,
    read_rejection_record,
)
from eyas.shards.encoding import extract_encoding
from eyas.shards.manifest import MANIFEST_NAME
from eyas.shards.shard_set import LOCK_NAME, QUARANTINE_DIR, RUN_META_NAME, ExtractRunMeta, shard_set_state
from eyas.status.launches import LAUNCHES_DIR, TAG_PREFIX
from eyas.status.nodes import job_summary, stop_text
from eyas.status.training import recorded_failure, set_aside_text
from eyas.storage import LocalStorage
from eyas.train.checkpoint import CHECKPOINTS_DIR, FINAL_FILE, read_best, train_state
from eyas.train.data import total_steps
from eyas.train.failure import FAILURES_DIR
from eyas.train.launch import JOB_FILE, LOG_FILE
from eyas.train.metrics import METRICS_FILE, last_metrics
from eyas.train.nodes import STOP_FILE
from eyas.train.preflight import REGISTRY, alive_recorded
from eyas.train.smoke import SMOKE_FILE, read_smoke_result
from eyas.verify.report import read_verify_report

DONE, PARTIAL, RUNNING, FAILED, STALE = "done", "partial", "running", "failed", "stale"
NOT_STARTED, UNREADABLE, REJECTED = "not started", "unreadable", "rejected"
STATES = (DONE, PARTIAL, RUNNING, FAILED, STALE, NOT_STARTED, UNREADABLE, REJECTED)
# What a damaged or foreign file raises when read (pyarrow's errors are ValueErrors, json's too).
READ_ERRORS = (OSError, ValueError, KeyError, TypeError)
RUN_CONFIG_NAME = "run.json"


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


def probe_dataset(ctx: Context) -> tuple[str, str, str]:
    paths = ctx.paths
    if not paths.tokenized.is_file():
        return NOT_STARTED, "no tokenized dataset yet", ctx.rel(paths.tokenized)
    rows = tokenized_num_samples(paths.tokenized)
    content_hash = read_tokenized_meta(paths.tokenized).get("eyas.content_hash", "?")
    report = read_dataset_report(paths.dataset_dir) or {}
    ctx.progress["dataset"] = {"num_samples": rows, "content_hash": content_hash, **report}
    detail = (
        f"{rows:,} samples, {report.get('num_tokens', 0):,} tokens ({report.get('num_loss_tokens', 0):,} loss-masked)"
    )
    if not paths.vocab.is_file():
        return PARTIAL, f"{detail}; the draft vocab mapping is missing", ctx.rel(paths.vocab)
    draft_vocab, _ = vocab_sizes(paths.vocab)
    ctx.progress["dataset"]["draft_vocab_size"] = draft_vocab
    return DONE, f"{detail}, hash {content_hash}; draft vocab {draft_vocab:,}", ctx.rel(paths.tokenized)


def _shards_read_from_storage(ctx: Context) -> bool:
    """Whether the run keeps no local copy of its shards (train.cache_bytes > 0: the later stages read S3)."""
    return ctx.config is not None and ctx.config.train.cache_bytes > 0


def _remote_read(store, read):
    """`read(store)`, an S3 client's errors (an unreachable endpoint, a refused request) as the OSError that makes
    the stage unreadable in the report instead of ending it."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return read(store)
    except (BotoCoreError, ClientError) as err:
        raise OSError(f"{store.url}: {type(err).__name__}: {err}") from err


def probe_extract(ctx: Context) -> tuple[str, str, str]:
    remote = _shards_read_from_storage(ctx)
    store = shard_source(ctx.config) if remote else LocalStorage(ctx.paths.shards_dir)

    def where(name: str) -> str:
        return f"{store.url}/{name}" if remote else ctx.rel(ctx.paths.shards_dir / name)

    state = _remote_read(store, shard_set_state) if remote else shard_set_state(store)
    rows = state.rows
    ctx.manifest_files = {r.file for r in rows}
    if state.run is None:
        return NOT_STARTED, "no extraction recorded", where(RUN_META_NAME)
    planned = state.num_planned
    ctx.progress["shards"] = {
        "done": len(rows),
        "planned": planned,
        "tokens_done": sum(r.num_tokens for r in rows),
        "bytes_done": sum(r.num_bytes for r in rows),
        "interrupted_writes": state.interrupted_writes,
        "quarantined": len(state.quarantine_reasons),
        "last_quarantine_reason": state.quarantine_reasons[-1] if state.quarantine_reasons else "",
        "running_here": state.running_here,
    }
    detail = (
        f"{len(rows):,} of {planned:,} shards ({ctx.progress['shards']['tokens_done']:,} tokens, "
        f"{state.run.encoding.label()})"
    )
    if remote:
        detail += f"; in {store.url}, no local copy (train.cache_bytes)"
    elif ctx.config is not None and ctx.config.extract.storage_url:
        detail += f"; written to {ctx.config.extract.storage_url}, counted here from the local copy"
    mismatch = extract_mismatch(ctx, state.run, store.url)
    if mismatch:
        return STALE, f"{detail}; {mismatch}", where(RUN_META_NAME)
    if state.running_here:
        return RUNNING, f"{detail}; an extraction holds {LOCK_NAME} now", where(RUN_META_NAME)
    return (DONE if state.complete else PARTIAL), detail, where(MANIFEST_NAME)


def extract_mismatch(ctx: Context, run: ExtractRunMeta, where: str) -> str:
    """What extract.json records that the config (or the tokenized dataset) now contradicts; '' if nothing."""
    wanted = {}
    if ctx.config is not None:
        e = ctx.config.extract
        enc = extract_encoding(e)
        wanted = {"dtype": e.dtype, "shard_bytes": e.shard_bytes, "backend": e.backend, "aux_dtype": enc.aux_dtype,
                  "teacher": enc.teacher, "teacher_topk": enc.teacher_topk}  # fmt: skip
        wanted["target_dtype"] = ctx.config.target.dtype
        if ctx.config.target.aux_layer_ids is not None:
            wanted["aux_layer_ids"] = ctx.config.target.aux_layer_ids
    if "dataset" in ctx.progress:
        wanted["dataset_hash"] = ctx.progress["dataset"]["content_hash"]
    diffs = [f"{k}={getattr(run, k)!r} there, {v!r} now" for k, v in wanted.items() if getattr(run, k) != v]
    if not diffs:
        return ""
    return (
        f"{RUN_META_NAME} records other parameters ({'; '.join(diffs)}): a resume is refused; use a new workdir or "
        f"move {where} aside"
    )


def probe_verify(ctx: Context) -> tuple[str, str, str]:
    path = ctx.paths.verify_report
    if not path.is_file():
        return NOT_STARTED, "no verification report", ctx.rel(path)
    report = read_verify_report(path)
    ok = {r.file for r in report.rows if r.status == "ok"}
    bad = [f"{r.file}: {r.reason}" for r in report.rows if r.status != "ok"]
    verified = len(ok & ctx.manifest_files)
    unverified = len(ctx.manifest_files - ok)
    ctx.progress["verified"] = {"ok": verified, "bad": len(bad), "unverified": unverified, "mode": report.mode}
    detail = f"{verified:,} shards ok ({report.mode} mode)"
    if bad or report.problems:
        shown = "; ".join((bad + report.problems)[:3])
        return FAILED, f"{detail}, {len(bad)} bad, {len(report.problems)} directory problems: {shown}", ctx.rel(path)
    if unverified:
        return STALE, f"{detail}; {unverified:,} shards extracted since were not verified", ctx.rel(path)
    shards = ctx.progress.get("shards", {})
    state = DONE if shards and shards["done"] == shards["planned"] else PARTIAL
    return state, detail, ctx.rel(path)


def probe_smoke(ctx: Context) -> tuple[str, str, str]:
    smoke = read_smoke_result(ctx.paths.smoke_dir)
    path = ctx.paths.smoke_dir / SMOKE_FILE
    if smoke is None:
        return NOT_STARTED, "no smoke run", ctx.rel(path)
    detail = f"loss {smoke['first']:.3f} -> {smoke['last']:.3f} in {smoke['num_steps']} steps"
    return (DONE if smoke["passed"] else FAILED), detail, ctx.rel(path)


def probe_approval(ctx: Context) -> tuple[str, str, str]:
    path = ctx.paths.root / APPROVAL_RECORD
    record = read_approval_record(ctx.paths.root)
    rejection = read_rejection_record(ctx.paths.root)
    if rejection is not None and (record is None or rejection["decided_at"] > record["decided_at"]):
        ctx.progress["rejection"] = rejection
        detail = f"{rejection['decision']} by {rejection['reviewer']} at {rejection['decided_at']}: " + (
            rejection.get("note") or "no note"
        )
        if ctx.config is not None and rejection["config_fingerprint"] != gate_fingerprint(ctx.config):
            detail += "; the configuration has changed since: the gate asks again"
        return REJECTED, detail, ctx.rel(ctx.paths.root / REJECTION_RECORD)
    if record is None:
        return NOT_STARTED, "not approved yet", ctx.rel(path)
    detail = f"approved by {record['reviewer']} at {record['decided_at']}" + (
        f" ({record['note']})" if record.get("note") else ""
    )
    if ctx.config is not None and record["config_fingerprint"] != gate_fingerprint(ctx.config):
        return STALE, f"{detail}, for another configuration: the gate asks again", ctx.rel(path)
    return DONE, detail, ctx.rel(path)


def planned_train_steps(ctx: Context) -> int | None:
    if ctx.config is None or "dataset" not in ctx.progress:
        return None
    return total_steps(ctx.progress["dataset"]["num_samples"], ctx.config.train)


def probe_train(ctx: Context) -> tuple[str, str, str]:
    train_dir = ctx.paths.train_dir
    state, planned = train_state(train_dir), planned_train_steps(ctx)
    latest = state.latest
    alive = alive_recorded(train_dir) if train_dir.is_dir() else []
    metrics = last_metrics(train_dir / METRICS_FILE) if (train_dir / METRICS_FILE).is_file() else None
    info = {
        "planned_steps": planned,
        "running_pids": [e["pid"] for e in alive],
        "incomplete_checkpoints": state.num_incomplete,
        "nodes": job_summary(train_dir),  # the newest launch's nodes (eyas.train.nodes), on any machine
    }
    if latest is not None:
        ts = state.trainer_state
        info |= {"checkpoint": str(latest), "step": ts["step"], "samples_consumed": ts["samples_consumed"]}
        if ts.get("eval"):  # every checkpoint of a run with a held-out split was evaluated
            info["eval"] = {"step": ts["step"], **ts["eval"]}
    best = read_best(train_dir)
    if best is not None:
        info["best"] = best
    if metrics is not None:
        keep = ("step", "epoch", "loss", "acc_k", "lr", "grad_norm", "elapsed_s", "tokens_per_s", "padding_waste",
                "micro_batches", "peak_memory_bytes")  # fmt: skip
        info["last_metrics"] = {k: metrics[k] for k in keep if k in metrics}
        if metrics.get("eval"):  # an evaluation newer than the checkpoint's
            info["eval"] = {"step": metrics["step"], **metrics["eval"]}
    if state.set_aside:
        info["set_aside"] = state.set_aside
    ctx.progress["train"] = info
    stage_state, detail, evidence = train_stage(ctx, state, info, metrics, alive)
    return stage_state, detail + (f"; {set_aside_text(state.set_aside, ctx.rel)}" if state.set_aside else ""), evidence


def train_stage(ctx: Context, state, info: dict, metrics: dict | None, alive: list) -> tuple[str, str, str]:
    """The train stage's state from what probe_train read (the checkpoints set aside are added by the caller):
    running, failed (the last launch's ranks recorded why, eyas.status.training), finished, or stopped."""
    train_dir, planned, latest = ctx.paths.train_dir, info["planned_steps"], state.latest
    of = f" of {planned:,}" if planned else ""
    at = f"newest complete checkpoint step {info['step']:,}{of}" if latest else "no complete checkpoint"
    nodes, stop = info["nodes"], info["nodes"]["stop"]
    if alive or nodes["alive"]:
        where = f"pid {', '.join(map(str, info['running_pids']))}" if alive else "no launcher recorded on this host"
        on = f" on {nodes['alive']} node(s)" if nodes["alive"] else ""
        asked = f"; {stop_text(stop)}" if stop else ""
        return RUNNING, f"trainer running{on} ({where}); {at}{asked}", ctx.rel(train_dir / REGISTRY)
    failure = recorded_failure(train_dir)
    if failure is not None:
        info["failure"] = failure
        return FAILED, f"{failure['reason']}; {at}; the whole log: {failure['log']}", ctx.rel(train_dir / FAILURES_DIR)
    final = state.final
    if final is not None and latest is not None:
        if final["step"] == info["step"] and (planned is None or final["step"] >= planned):
            loss = final.get("final_loss")
            loss_text = f", loss {loss:.3f}" if isinstance(loss, (int, float)) else ""
            return DONE, f"finished at step {final['step']:,}{loss_text}", ctx.rel(train_dir / FINAL_FILE)
    if stop and "stopped_at_step" in stop:
        return PARTIAL, f"{stop_text(stop)}; {at}; a re-run resumes from the checkpoint", ctx.rel(train_dir / STOP_FILE)
    if latest is None and metrics is None and not (train_dir / LOG_FILE).is_file():
        return NOT_STARTED, "not started", ctx.rel(train_dir / CHECKPOINTS_DIR)
    last = f"; last logged step {metrics['step']:,}" if metrics else ""
    return PARTIAL, f"stopped: {at}{last}; a re-run resumes from the checkpoint", ctx.rel(train_dir / CHECKPOINTS_DIR)


def probe_export(ctx: Context) -> tuple[str, str, str]:
    out = ctx.paths.export_dir / SGLANG_EXPORT
    state = export_state(out)
    if not state.complete:
        return NOT_STARTED, "no export", ctx.rel(out)
    source = state.provenance.get("source_checkpoint", "")
    ctx.progress["export"] = {"dir": str(out), "source_checkpoint": source}
    detail = f"SGLang format from {Path(source).name or 'an unknown checkpoint'}"
    wanted, why = export_source(ctx)
    if wanted and Path(source).name != wanted:
        return STALE, f"{detail}; the export stage exports {wanted} now, {why}", ctx.rel(out)
    return DONE, f"{detail}, {why}" if wanted else detail, ctx.rel(out)


def export_source(ctx: Context) -> tuple[str | None, str]:
    """(the checkpoint the export stage would export now, why) as eyas.export.convert.export_run chooses it:
    export.checkpoint best (the default, assumed without a config) = the one the BEST marker names, else the
    newest complete one; last = the newest complete one. (None, '') before any complete checkpoint."""
    train = ctx.progress.get("train", {})
    newest, best = train.get("checkpoint"), train.get("best")
    choice = ctx.config.export.checkpoint if ctx.config is not None else "best"
    setting = f"export.checkpoint={choice}" + ("" if ctx.config is not None else ", the default: no config found")
    if choice == "best" and best:
        return best["checkpoint"], f"the one BEST names ({setting})"
    if newest is None:
        return None, ""
    reason = "the newest complete checkpoint" + (", as no BEST marker names one" if choice == "best" else "")
    return Path(newest).name, f"{reason} ({setting})"


def probe_bench(ctx: Context) -> tuple[str, str, str]:
    bench_dir = ctx.paths.bench_dir
    bench, diagnosis = bench_dir / BENCHMARK_FILE, bench_dir / DIAGNOSIS_FILE
    result = read_benchmark(bench_dir)
    if result is None:
        return NOT_STARTED, "no benchmark", ctx.rel(bench)
    keep = ("engine", "tau_mean", "tau_ngram", "tau_random", "accept_rate_per_position", "speedup_vs_greedy")
    ctx.progress["acceptance"] = {k: result[k] for k in keep if k in result}
    detail = f"tau {result['tau_mean']:.2f} ({result['engine']} engine, {result.get('num_prompts', '?')} prompts)"
    if diagnosis.is_file() and diagnosis.stat().st_mtime >= bench.stat().st_mtime:
        conclusion = (read_diagnosis(bench_dir) or {}).get("conclusion", "see the diagnosis")
        return FAILED, f"{detail}, below the floor: {conclusion}", ctx.rel(diagnosis)
    if ctx.config is not None and result["tau_mean"] < ctx.config.bench.min_tau:
        return FAILED, f"{detail}, below bench.min_tau {ctx.config.bench.min_tau}", ctx.rel(bench)
    exported = ctx.paths.export_dir / SGLANG_EXPORT / MODEL_FILE
    if exported.is_file() and exported.stat().st_mtime > bench.stat().st_mtime:
        return STALE, f"{detail}, of an earlier export", ctx.rel(bench)
    return DONE, detail, ctx.rel(bench)


def file_table(ctx: Context) -> list[dict]:
    """Where every file of the run lives, and whether it exists yet."""
    p, shards = ctx.paths, ctx.paths.shards_dir
    entries = [
        ("run config", p.root / RUN_CONFIG_NAME),
        ("tokenized dataset", p.tokenized),
        ("dataset report", p.dataset_dir / REPORT_FILE),
        ("regenerated responses", p.dataset_dir / RESPONSES_FILE),
        ("draft vocab mapping", p.vocab),
        ("shards", shards),
        ("extraction parameters", shards / RUN_META_NAME),
        ("manifest", shards / MANIFEST_NAME),
        ("quarantined shards", shards / QUARANTINE_DIR),
        ("verification report", p.verify_report),
        ("smoke run", p.smoke_dir / SMOKE_FILE),
        ("approval", p.root / APPROVAL_RECORD),
        ("rejection", p.root / REJECTION_RECORD),
        ("trainer job", p.train_dir / JOB_FILE),
        ("trainer log", p.train_dir / LOG_FILE),
        ("training metrics", p.train_dir / METRICS_FILE),
        ("checkpoints", p.train_dir / CHECKPOINTS_DIR),
        ("final training state", p.train_dir / FINAL_FILE),
        ("exported drafter", p.export_dir / SGLANG_EXPORT),
        ("benchmark", p.bench_dir / BENCHMARK_FILE),
        ("acceptance plots", p.bench_dir / PLOTS_FILE),
        ("low-tau diagnosis", p.bench_dir / DIAGNOSIS_FILE),
    ]
    rows = [{"what": what, "path": str(path), "exists": path.exists()} for what, path in entries]
    if _shards_read_from_storage(ctx):  # no local copy: the shard set's rows name the objects (not probed here)
        url = ctx.config.extract.storage_url.rstrip("/")
        for row, name in zip(rows[5:9], ("", RUN_META_NAME, MANIFEST_NAME, QUARANTINE_DIR)):
            row["path"], row["exists"] = f"{url}/{name}" if name else url, None
    elif ctx.config is not None and ctx.config.extract.storage_url:
        rows.insert(6, {"what": "shards (source)", "path": ctx.config.extract.storage_url, "exists": None})
    return rows


EVIDENCE_EXAMPLES = ("dataset/tokenized.parquet", "shards/extract.json", "train/checkpoints", "export/sglang")


def run_evidence(workdir: Path) -> list[str]:
    """What of a run `workdir` holds: the launch records of `eyas` commands, and every file of the run's file
    table that exists (a bare `shards/` directory aside: the name is too common to tell a run by)."""
    launches = sorted(str(p) for p in (Path(workdir) / LAUNCHES_DIR).glob(f"{TAG_PREFIX}*.json"))
    rows = file_table(Context(workdir=Path(workdir), config=None))
    return launches + [r["path"] for r in rows if r["exists"] and r["what"] != "shards"]
