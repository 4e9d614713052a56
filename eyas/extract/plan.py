"""What an extraction must do: its parameters (extract.json), its shard plan, what is already done.

    run, plan = describe_extraction(cfg, facts, target_dtype="bfloat16")   # no I/O but one table column
    rp = resume_plan(store, run, plan)        # records or checks extract.json, cleans up, lists the missing
    parts = assign_shards(rp.todo, num_workers)                      # or order=: the trainer's first needs
    tokens = finish_extraction(store, plan)   # every planned shard has exactly one row

The shard plan depends only on the dataset and `shard_bytes`, never on batch size, device or worker
count, so a crashed run resumes anywhere: `resume_plan` deletes what interrupted writes left, folds row
files into the manifest and lists the shards without a row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from eyas.config import ExtractConfig
from eyas.facts import RunFacts
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.shards.encoding import extract_encoding
from eyas.shards.format import FORMAT_VERSION, ShardPlan, extraction_plan, shard_filename
from eyas.shards.manifest import compact_manifest, read_manifest
from eyas.shards.retention import released_shards
from eyas.shards.shard_set import ExtractConfigMismatchError, ExtractRunMeta, check_run_meta, quarantine_shards
from eyas.storage import Storage


def describe_extraction(
    cfg: ExtractConfig, facts: RunFacts, *, target_dtype: str = "float32"
) -> tuple[ExtractRunMeta, list[ShardPlan]]:
    """The run's parameters (what `extract.json` records) and its shard plan, without loading the target."""
    enc, plan = extract_encoding(cfg), extraction_plan(cfg, facts)
    run = ExtractRunMeta(
        format_version=FORMAT_VERSION,
        target_fingerprint=facts.target.fingerprint,
        aux_layer_ids=list(facts.aux_layer_ids),
        layer_id_convention=LAYER_ID_CONVENTION,
        hidden_size=facts.hidden_size,
        num_aux=facts.num_aux,
        dtype=cfg.dtype,
        target_dtype=target_dtype,
        backend=cfg.backend,
        dataset_hash=facts.dataset_hash,
        shard_bytes=cfg.shard_bytes,
        num_shards=len(plan),
        aux_dtype=enc.aux_dtype,
        teacher=enc.teacher,
        teacher_topk=enc.teacher_topk,
    )
    return run, plan


def check_shard_order(order: Sequence[int], num_shards: int) -> None:
    """`order` lists each of the plan's `num_shards` shards exactly once."""
    counts = Counter(order)
    missing = [i for i in range(num_shards) if i not in counts]
    duplicated = sorted(i for i, n in counts.items() if n > 1)
    unknown = sorted(i for i in counts if not 0 <= i < num_shards)
    if missing or duplicated or unknown:
        found = [f"{what} {_shown(ids)}" for what, ids in (("missing", missing), ("listed twice", duplicated),
                 ("not in the plan", unknown)) if ids]  # fmt: skip
        raise ValueError(
            f"shard order: {len(order)} entries, expected each of the plan's {num_shards} shards (0..{num_shards - 1}) "
            f"once; {'; '.join(found)}; compute the order over this plan (eyas.train.stream_order)"
        )


def _shown(ids: list[int]) -> str:
    return "[" + ", ".join(f"{i:05d}" for i in ids[:20]) + (" ..." if len(ids) > 20 else "") + "]"


def assign_shards(todo: list[int], num_workers: int, *, order: Sequence[int] | None = None) -> list[list[int]]:
    """Disjoint shard lists, one per worker, dealt round robin (every worker gets early and late shards) from
    `todo` in plan order, or in `order` (every planned shard once, check_shard_order) when given: with the order
    a trainer first needs the shards (eyas.train.stream_order), the first W shards it needs are the first ones
    of the W workers."""
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers}: expected >= 1")
    if order is not None:
        position = {shard: k for k, shard in enumerate(order)}
        absent = [i for i in todo if i not in position]
        if absent:
            raise ValueError(
                f"shard order: {len(absent)} shards to extract are not in it ({_shown(absent)}); expected every "
                f"planned shard once; compute the order over this plan (eyas.train.stream_order)"
            )
        todo = sorted(todo, key=position.__getitem__)
    return [todo[k::num_workers] for k in range(num_workers)]


def check_manifest_against_plan(
    store: Storage, plan: list[ShardPlan], listing: dict[str, int]
) -> tuple[set[int], dict[str, str]]:
    """(indices of finished shards, {file: reason} of rows whose file is gone or has another size, unless the shard
    was released by extract.retention: then it is finished); refuses rows that disagree with the plan (another
    extraction's manifest)."""
    done, damaged, released = set(), {}, released_shards(store)
    for row in read_manifest(store):
        p = plan[row.shard_index] if row.shard_index < len(plan) else None
        found = (row.sample_start, row.sample_end, row.num_tokens)
        if p is None or (p.sample_start, p.sample_end, p.num_tokens) != found:
            raise ExtractConfigMismatchError(
                f"{store.url}: manifest row of shard {row.shard_index:05d} (samples {row.sample_start}.."
                f"{row.sample_end}, {row.num_tokens} tokens) disagrees with the plan ({p}); "
                f"move the shards aside and extract again"
            )
        if listing.get(row.file) != row.num_bytes and row.shard_index not in released:
            now = "missing" if row.file not in listing else f"{listing[row.file]} bytes"
            damaged[row.file] = (
                f"{row.file}: listed in the manifest ({row.num_bytes} bytes) but {now} in storage when an "
                "extraction resumed"
            )
            continue
        done.add(row.shard_index)
    return done, damaged


def set_aside_damaged(store: Storage, damaged: dict[str, str]) -> list[str]:
    """Shards whose file no longer matches its manifest row are quarantined with the reason
    (eyas.shards.shard_set.quarantine_shards: moved aside, row dropped) and extracted again."""
    if damaged:
        quarantine_shards(store, damaged)
    return [damaged[name] for name in sorted(damaged)]


@dataclass
class ResumePlan:
    """What a coordinator found and decided before any worker starts."""

    run: ExtractRunMeta
    plan: list[ShardPlan]
    done: set[int]
    todo: list[int]
    strays_removed: int
    unlisted: int  # shard objects without a manifest row (a crash between write and row): rewritten
    quarantined: list[str]  # reasons of the shards set aside because their file no longer matched its row


def resume_plan(store: Storage, run: ExtractRunMeta, plan: list[ShardPlan]) -> ResumePlan:
    """Check or record the run's parameters, delete leftovers of interrupted writes, fold row files into
    the manifest, and list the shards still to extract."""
    check_run_meta(store, run)
    strays = store.remove_partial()
    compact_manifest(store)
    listing = store.list()
    done, damaged = check_manifest_against_plan(store, plan, listing)
    quarantined = set_aside_damaged(store, damaged)
    listing = store.list() if damaged else listing
    todo = [p.index for p in plan if p.index not in done]
    unlisted = sum(shard_filename(i) in listing for i in todo)
    return ResumePlan(run, plan, done, todo, len(strays), unlisted, quarantined)


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
