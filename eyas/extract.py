"""Extraction of the target's hidden states into shards: plan, resume, fan-out to workers, finish.

    from eyas.extract import extract_hidden_states
    summary = extract_hidden_states(tokenized_path=..., shards_dir="runs/x/shards" or "s3://b/p",
                                    target_path=..., aux_layer_ids=None, extract_cfg=ExtractConfig())

    python -m eyas.extract --tokenized T.parquet --shards DIR --target MODEL [--num-workers 2]

Per token it stores the aux hidden states of `n_aux` layers concatenated (width n_aux * H) and the
last hidden state (width H). The shard plan depends only on the dataset and `shard_bytes`, never on
batch size, device or worker count, so a crashed run resumes anywhere: `prepare_extraction` reads
the manifest, deletes what interrupted writes left, and lists the missing shards; `assign_shards`
splits them into disjoint lists, one per worker (eyas.extract_worker); `finish_extraction` compacts
the manifest and checks that every planned shard has exactly one row. `extract.json` records the
run's parameters; a resume with different ones is refused. One coordinator per local directory at a
time (`.extract.lock`); the workers it starts may be threads here or flow runs elsewhere.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from eyas.config import ExtractConfig
from eyas.extract_worker import assign_shards, extract_worker
from eyas.manifest import compact_manifest, done_shard_indices, read_manifest
from eyas.shards import (
    FORMAT_VERSION,
    ShardMeta,
    ShardPlan,
    TokenizedDataset,
    bytes_per_token,
    plan_shards,
    shard_filename,
)
from eyas.storage import Storage, open_storage
from eyas.target import (
    HF_LOAD_LOCK,
    LAYER_ID_CONVENTION,
    resolve_aux_layer_ids,
    target_fingerprint,
)

RUN_META_NAME = "extract.json"
LOCK_NAME = ".extract.lock"


class ExtractConfigMismatchError(ValueError):
    """The shards directory holds an extraction made with other parameters."""


@dataclass(frozen=True)
class ExtractRunMeta:
    """What `extract.json` records; every field must match for a run to resume into the directory."""

    format_version: str
    target_fingerprint: str
    aux_layer_ids: list[int]
    layer_id_convention: str
    hidden_size: int
    num_aux: int
    dtype: str
    target_dtype: str
    backend: str
    dataset_hash: str
    shard_bytes: int
    num_shards: int

    def shard_meta(self, plan: ShardPlan) -> ShardMeta:
        return ShardMeta(
            target_fingerprint=self.target_fingerprint,
            aux_layer_ids=tuple(self.aux_layer_ids),
            layer_id_convention=self.layer_id_convention,
            hidden_size=self.hidden_size,
            num_aux=self.num_aux,
            dtype=self.dtype,
            backend=self.backend,
            dataset_hash=self.dataset_hash,
            shard_index=plan.index,
            sample_start=plan.sample_start,
            sample_end=plan.sample_end,
        )


@dataclass
class ExtractSummary:
    shards_total: int
    shards_written: int
    shards_skipped: int
    unlisted_rewritten: int  # shard files found without a manifest row, extracted again
    strays_removed: int
    samples_total: int
    tokens_written: int
    seconds: float
    aux_layer_ids: list[int]
    hidden_size: int
    num_workers: int

    def to_dict(self) -> dict:
        return asdict(self)


def target_dims(target_path: str | Path) -> tuple[int, int]:
    """(num_layers, hidden_size) from the target's config.json, without loading its weights."""
    from transformers import AutoConfig

    path = Path(target_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {str(path)!r}: no config.json; expected a Hugging Face model directory")
    with HF_LOAD_LOCK:
        cfg = AutoConfig.from_pretrained(path).get_text_config()
    return int(cfg.num_hidden_layers), int(cfg.hidden_size)


def check_run_meta(store: Storage, current: ExtractRunMeta) -> None:
    """Write `extract.json` for a fresh shard set, or refuse to resume with different parameters."""
    where = f"{store.url}/{RUN_META_NAME}"
    if not store.exists(RUN_META_NAME):
        if read_manifest(store):
            raise ExtractConfigMismatchError(
                f"{store.url}: manifest has rows but {RUN_META_NAME} is missing, so the shards' parameters are "
                f"unknown; move the shards aside and extract again"
            )
        store.put_bytes(RUN_META_NAME, json.dumps(asdict(current), indent=1, sort_keys=True).encode())
        return
    try:
        recorded = json.loads(store.get_bytes(RUN_META_NAME))
    except json.JSONDecodeError as e:
        raise ExtractConfigMismatchError(
            f"{where}: not valid JSON ({e}); the run's parameters are unknown; move {store.url} aside and extract again"
        ) from e
    wanted = asdict(current)
    diffs = [
        f"{k}={recorded.get(k)!r} there, {wanted.get(k)!r} now"
        for k in sorted(set(recorded) | set(wanted))
        if recorded.get(k) != wanted.get(k)
    ]
    if diffs:
        raise ExtractConfigMismatchError(
            f"{where}: the shards there were extracted with other parameters: {'; '.join(diffs)}. "
            f"Resuming would mix shards; use a new shards_dir, or move {store.url} aside to start over"
        )


def check_manifest_against_plan(store: Storage, plan: list[ShardPlan], listing: dict[str, int]) -> set[int]:
    """Indices of finished shards; refuses rows that disagree with the plan or whose file is gone."""
    done = set()
    for row in read_manifest(store):
        p = plan[row.shard_index] if row.shard_index < len(plan) else None
        found = (row.sample_start, row.sample_end, row.num_tokens)
        if p is None or (p.sample_start, p.sample_end, p.num_tokens) != found:
            raise ExtractConfigMismatchError(
                f"{store.url}: manifest row of shard {row.shard_index:05d} (samples {row.sample_start}.."
                f"{row.sample_end}, {row.num_tokens} tokens) disagrees with the plan ({p}); "
                f"move the shards aside and extract again"
            )
        if listing.get(row.file) != row.num_bytes:
            raise FileNotFoundError(
                f"{store.url}/{row.file}: listed in the manifest ({row.num_bytes} bytes) but "
                f"{'missing' if row.file not in listing else f'{listing[row.file]} bytes'} in storage; run "
                f"verification, which quarantines it (eyas.manifest.quarantine_shards), then extract again"
            )
        done.add(row.shard_index)
    return done


def describe_extraction(
    *,
    dataset: TokenizedDataset,
    target_path: str | Path,
    aux_layer_ids: list[int] | None,
    extract_cfg: ExtractConfig,
    target_dtype: str = "float32",
) -> tuple[ExtractRunMeta, list[ShardPlan]]:
    """The run's parameters (what `extract.json` records) and its shard plan, without loading the target."""
    num_layers, hidden = target_dims(target_path)
    aux_ids = resolve_aux_layer_ids(aux_layer_ids, num_layers)
    bpt = bytes_per_token(hidden_size=hidden, num_aux=len(aux_ids), dtype=extract_cfg.dtype)
    plan = plan_shards(dataset.num_tokens, bpt, extract_cfg.shard_bytes)
    run = ExtractRunMeta(
        format_version=FORMAT_VERSION,
        target_fingerprint=target_fingerprint(target_path),
        aux_layer_ids=aux_ids,
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=hidden,
        num_aux=len(aux_ids),
        dtype=extract_cfg.dtype,
        target_dtype=target_dtype,
        backend=extract_cfg.backend,
        dataset_hash=dataset.dataset_hash,
        shard_bytes=extract_cfg.shard_bytes,
        num_shards=len(plan),
    )
    return run, plan


@dataclass
class ResumePlan:
    """What a coordinator found and decided before any worker starts."""

    run: ExtractRunMeta
    plan: list[ShardPlan]
    done: set[int]
    todo: list[int]
    strays_removed: int
    unlisted: int  # shard objects without a manifest row (a crash between write and row): rewritten


def prepare_extraction(
    *,
    store: Storage,
    dataset: TokenizedDataset,
    target_path: str | Path,
    aux_layer_ids: list[int] | None,
    extract_cfg: ExtractConfig,
    target_dtype: str = "float32",
) -> ResumePlan:
    """Check or record the run's parameters, delete leftovers of interrupted writes, fold row files into
    the manifest, and list the shards still to extract."""
    run, plan = describe_extraction(
        dataset=dataset,
        target_path=target_path,
        aux_layer_ids=aux_layer_ids,
        extract_cfg=extract_cfg,
        target_dtype=target_dtype,
    )
    return resume_plan(store, run, plan)


def resume_plan(store: Storage, run: ExtractRunMeta, plan: list[ShardPlan]) -> ResumePlan:
    check_run_meta(store, run)
    strays = store.remove_partial()
    compact_manifest(store)
    listing = store.list()
    done = check_manifest_against_plan(store, plan, listing)
    todo = [p.index for p in plan if p.index not in done]
    unlisted = sum(shard_filename(i) in listing for i in todo)
    return ResumePlan(run, plan, done, todo, len(strays), unlisted)


def finish_extraction(store: Storage, plan: list[ShardPlan]) -> int:
    """Compact the manifest and check that every planned shard has its row; return the tokens listed."""
    rows = compact_manifest(store)
    missing = sorted({p.index for p in plan} - {r.shard_index for r in rows})
    if missing:
        shown = ", ".join(f"{i:05d}" for i in missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise RuntimeError(
            f"{store.url}: {len(missing)} of {len(plan)} planned shards have no manifest row ({shown}); a worker "
            f"failed or was stopped: run extraction again, it extracts only these"
        )
    return sum(r.num_tokens for r in rows)


class ExtractionProgress:
    """Samples and tokens done / total and an ETA, from the shard indices known to be done.

    `poll()` re-reads the manifest's row names from storage (what a monitor of remote workers does);
    `shard_done(p)` counts a shard written by a worker of this process."""

    def __init__(self, store: Storage, plan: list[ShardPlan], done: set[int]):
        self.store, self.plan = store, plan
        self.done = set(done)
        self.lock = threading.Lock()
        self.t0, self.tokens_at_start = time.monotonic(), self._tokens()
        self.samples_total = plan[-1].sample_end if plan else 0
        self.tokens_total = sum(p.num_tokens for p in plan)

    def _tokens(self) -> int:
        return sum(self.plan[i].num_tokens for i in self.done)

    def shard_done(self, p: ShardPlan) -> dict:
        with self.lock:
            self.done.add(p.index)
            return self.snapshot()

    def poll(self) -> dict:
        found = done_shard_indices(self.store)
        with self.lock:
            self.done |= found
            return self.snapshot()

    def snapshot(self) -> dict:
        tokens = self._tokens()
        rate = (tokens - self.tokens_at_start) / max(time.monotonic() - self.t0, 1e-9)
        return {
            "shards_done": len(self.done),
            "shards_total": len(self.plan),
            "samples_done": sum(self.plan[i].sample_end - self.plan[i].sample_start for i in self.done),
            "samples_total": self.samples_total,
            "tokens_done": tokens,
            "tokens_total": self.tokens_total,
            "eta_s": round((self.tokens_total - tokens) / rate, 1) if rate > 0 else None,
        }


@contextmanager
def extraction_lock(store: Storage):
    """One coordinator per local shards directory at a time (the kernel drops the lock if the process dies).
    S3 has no such lock: run one coordinator per prefix."""
    root = store.local_path()
    if root is None:
        yield
        return
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise RuntimeError(
                f"shards dir {root}: another extraction holds {LOCK_NAME}; wait for it to finish or stop it "
                f"(two coordinators would delete each other's temporaries and both write the missing shards)"
            ) from e
        yield


def extract_hidden_states(
    *,
    tokenized_path: str | Path,
    shards_dir: "str | Path | Storage",
    target_path: str | Path,
    aux_layer_ids: list[int] | None,
    extract_cfg: ExtractConfig,
    target_dtype: str = "float32",
    progress: Callable[[dict], None] | None = None,
) -> ExtractSummary:
    """Extract every shard of the plan that the manifest does not list yet, with `extract_cfg.num_workers`
    concurrent workers (threads of this process); return what was done. The target is loaded (once per
    worker) only when some shard is missing."""
    t0 = time.perf_counter()
    store = (
        shards_dir
        if hasattr(shards_dir, "put_bytes")
        else open_storage(shards_dir, endpoint_url=extract_cfg.s3_endpoint_url)
    )
    dataset = TokenizedDataset(Path(tokenized_path))
    with extraction_lock(store):
        rp = prepare_extraction(
            store=store,
            dataset=dataset,
            target_path=target_path,
            aux_layer_ids=aux_layer_ids,
            extract_cfg=extract_cfg,
            target_dtype=target_dtype,
        )
        tracker = ExtractionProgress(store, rp.plan, rp.done)
        report = (lambda p: progress(tracker.shard_done(p))) if progress else None
        if progress:
            progress(tracker.snapshot())
        parts = [part for part in assign_shards(rp.todo, extract_cfg.num_workers) if part]
        work = [
            dict(
                store=store,
                dataset=dataset,
                run_meta=rp.run,
                plan=rp.plan,
                shard_indices=part,
                extract_cfg=extract_cfg,
                target_path=str(target_path),
                worker_index=k,
                on_shard=report,
            )
            for k, part in enumerate(parts)
        ]
        if len(work) <= 1:  # one worker runs in this thread (torch is a few % slower in a pool thread)
            results = [extract_worker(**w) for w in work]
        else:
            with ThreadPoolExecutor(max_workers=len(work)) as pool:
                results = [f.result() for f in [pool.submit(extract_worker, **w) for w in work]]
        finish_extraction(store, rp.plan)
    return ExtractSummary(
        shards_total=len(rp.plan),
        shards_written=sum(len(r.shard_indices) for r in results),
        shards_skipped=len(rp.done),
        unlisted_rewritten=rp.unlisted,
        strays_removed=rp.strays_removed,
        samples_total=len(dataset),
        tokens_written=sum(r.tokens_written for r in results),
        seconds=time.perf_counter() - t0,
        aux_layer_ids=rp.run.aux_layer_ids,
        hidden_size=rp.run.hidden_size,
        num_workers=len(parts),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m eyas.extract", description="extract hidden-state shards (hf)")
    ap.add_argument("--tokenized", required=True, help="tokenized dataset (Parquet) written by eyas.dataset")
    ap.add_argument("--shards", required=True, help="local directory or s3://bucket/prefix")
    ap.add_argument("--target", required=True, help="Hugging Face model directory of the target")
    ap.add_argument("--config", help="JSON of an ExtractConfig (defaults otherwise)")
    ap.add_argument("--num-workers", type=int, help="overrides the config's num_workers")
    args = ap.parse_args(argv)
    cfg = ExtractConfig.model_validate_json(Path(args.config).read_text()) if args.config else ExtractConfig()
    if args.num_workers:
        cfg = cfg.model_copy(update={"num_workers": args.num_workers})
    summary = extract_hidden_states(
        tokenized_path=args.tokenized,
        shards_dir=args.shards,
        target_path=args.target,
        aux_layer_ids=None,
        extract_cfg=cfg,
    )
    print(json.dumps(summary.to_dict()))


if __name__ == "__main__":
    main()
