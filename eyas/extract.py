"""Extraction of the target's hidden states into shards (the `hf` backend), resumable.

    from eyas.extract import extract_hidden_states
    summary = extract_hidden_states(tokenized_path=..., shards_dir=..., target_path=...,
                                    aux_layer_ids=None, extract_cfg=ExtractConfig())

Per token it stores the aux hidden states of `n_aux` layers concatenated (width n_aux * H) and the
last hidden state (width H). The shard plan depends only on the dataset and `shard_bytes`, never on
batch size, device or worker count, so a crashed run resumes anywhere: finished shards (manifest
rows) are skipped, stray temporaries deleted, shard files without a manifest row (a crash between
rename and manifest write) rewritten. `extract.json` records the run's parameters; a resume with
different ones is refused. One extraction writes into a directory at a time (`.extract.lock`).
"""

from __future__ import annotations

import fcntl
import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from eyas.config import ExtractConfig
from eyas.fsio import atomic_write_bytes
from eyas.shards import (
    FORMAT_VERSION,
    ShardMeta,
    ShardPlan,
    TokenizedDataset,
    append_manifest_row,
    bytes_per_token,
    plan_shards,
    read_manifest,
    remove_stray_temporaries,
    shard_filename,
    write_shard,
)
from eyas.target import (
    LAYER_ID_CONVENTION,
    Target,
    load_target,
    resolve_aux_layer_ids,
    target_features,
    target_fingerprint,
    torch_dtype,
)

RUN_META_NAME = "extract.json"
LOCK_NAME = ".extract.lock"


class ExtractConfigMismatchError(ValueError):
    """The shards directory holds an extraction made with other parameters."""


class AuxWidthError(ValueError):
    """The backend returned hidden states of the wrong width."""


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

    def to_dict(self) -> dict:
        return asdict(self)


def target_dims(target_path: str | Path) -> tuple[int, int]:
    """(num_layers, hidden_size) from the target's config.json, without loading its weights."""
    from transformers import AutoConfig

    path = Path(target_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {str(path)!r}: no config.json; expected a Hugging Face model directory")
    cfg = AutoConfig.from_pretrained(path).get_text_config()
    return int(cfg.num_hidden_layers), int(cfg.hidden_size)


def check_aux_width(aux_width: int, *, num_aux: int, hidden_size: int, source: str) -> None:
    """Fail when the aux states are not n_aux * H wide (an H-wide input silently bypasses the draft's fc)."""
    expected = num_aux * hidden_size
    if aux_width == expected:
        return
    hint = "it is H: the backend returned one layer's states, not the aux layers'; " if aux_width == hidden_size else ""
    raise AuxWidthError(
        f"{source}: aux_hidden_states width {aux_width}, expected {expected} ({num_aux} layers x {hidden_size}); "
        f"{hint}known causes: (1) aux hidden-state capture is not enabled (SGLang needs "
        f"--enable-return-aux-hidden-states and eagle_config.use_aux_hidden_state not false); "
        f"(2) SGLang runs --speculative-algorithm EAGLE instead of EAGLE3, which returns last-layer states only; "
        f"(3) a wrapper model (multimodal, pipeline stage pp > 1) whose capture hook does not reach the decoder "
        f"layers. Fix the backend and re-run extraction."
    )


def check_run_meta(shards_dir: Path, current: ExtractRunMeta) -> None:
    """Write `extract.json` for a fresh directory, or refuse to resume with different parameters."""
    path = Path(shards_dir) / RUN_META_NAME
    if not path.exists():
        if read_manifest(shards_dir):
            raise ExtractConfigMismatchError(
                f"{shards_dir}: manifest has rows but {RUN_META_NAME} is missing, so the shards' parameters are "
                f"unknown; move the directory aside and extract again"
            )
        atomic_write_bytes(path, json.dumps(asdict(current), indent=1, sort_keys=True).encode())
        return
    try:
        recorded = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExtractConfigMismatchError(
            f"{path}: not valid JSON ({e}); the run's parameters are unknown; move {shards_dir} aside and extract again"
        ) from e
    wanted = asdict(current)
    diffs = [
        f"{k}={recorded.get(k)!r} there, {wanted.get(k)!r} now"
        for k in sorted(set(recorded) | set(wanted))
        if recorded.get(k) != wanted.get(k)
    ]
    if diffs:
        raise ExtractConfigMismatchError(
            f"{path}: the shards there were extracted with other parameters: {'; '.join(diffs)}. "
            f"Resuming would mix shards; use a new shards_dir, or move {shards_dir} aside to start over"
        )


def _check_manifest_against_plan(shards_dir: Path, plan: list[ShardPlan]) -> set[int]:
    """Indices of finished shards; refuses rows that disagree with the plan or whose file is gone."""
    done = set()
    for row in read_manifest(shards_dir):
        p = plan[row.shard_index] if row.shard_index < len(plan) else None
        found = (row.sample_start, row.sample_end, row.num_tokens)
        if p is None or (p.sample_start, p.sample_end, p.num_tokens) != found:
            raise ExtractConfigMismatchError(
                f"{shards_dir}: manifest row of shard {row.shard_index:05d} (samples {row.sample_start}.."
                f"{row.sample_end}, {row.num_tokens} tokens) disagrees with the plan ({p}); "
                f"move the directory aside and extract again"
            )
        file = Path(shards_dir) / row.file
        if not file.is_file() or file.stat().st_size != row.num_bytes:
            raise FileNotFoundError(
                f"{file}: listed in the manifest ({row.num_bytes} bytes) but missing or of another size on disk; "
                f"run verification, which quarantines it (eyas.shards.quarantine_shards), then extract again"
            )
        done.add(row.shard_index)
    return done


def _features(target: Target, samples: list[torch.Tensor], aux_layer_ids: list[int], device: str):
    """Per sample (aux [t, n_aux*H], last [t, H]), from one right-padded forward pass."""
    lengths = [len(s) for s in samples]
    ids = torch.zeros(len(samples), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    attention_mask = None if len(samples) == 1 else mask.to(device)
    aux, last, _ = target_features(target.model, ids.to(device), aux_layer_ids, attention_mask=attention_mask)
    return [(aux[i, :n], last[i, :n]) for i, n in enumerate(lengths)]


def _extract_shard(
    target: Target,
    dataset: TokenizedDataset,
    plan: ShardPlan,
    aux_layer_ids: list[int],
    *,
    extract_cfg: ExtractConfig,
    device: str,
) -> dict[str, torch.Tensor]:
    input_ids, loss_mask = dataset.tokens(plan.sample_start, plan.sample_end)
    lengths = torch.tensor(dataset.num_tokens[plan.sample_start : plan.sample_end], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    hidden, dtype = target.hidden_size, torch_dtype(extract_cfg.dtype)
    aux_out = torch.empty(plan.num_tokens, len(aux_layer_ids) * hidden, dtype=dtype)
    last_out = torch.empty(plan.num_tokens, hidden, dtype=dtype)
    num_samples = plan.sample_end - plan.sample_start
    for b in range(0, num_samples, extract_cfg.batch_size):
        idx = range(b, min(b + extract_cfg.batch_size, num_samples))
        samples = [input_ids[offsets[i] : offsets[i + 1]] for i in idx]
        for i, (aux, last) in zip(idx, _features(target, samples, aux_layer_ids, device)):
            source = f"shard {plan.index:05d} sample {plan.sample_start + i}"
            check_aux_width(aux.shape[-1], num_aux=len(aux_layer_ids), hidden_size=hidden, source=source)
            if last.shape[-1] != hidden:
                raise AuxWidthError(f"{source}: last_hidden_states width {last.shape[-1]}, expected H={hidden}")
            aux_out[offsets[i] : offsets[i + 1]] = aux.to(dtype).cpu()
            last_out[offsets[i] : offsets[i + 1]] = last.to(dtype).cpu()
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "aux_hidden_states": aux_out,
        "last_hidden_states": last_out,
        "sample_offsets": offsets,
        "sample_indices": torch.arange(plan.sample_start, plan.sample_end, dtype=torch.int64),
    }


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


@contextmanager
def _exclusive(shards_dir: Path):
    """One extraction per directory at a time (the kernel drops the lock if the process dies)."""
    with open(shards_dir / LOCK_NAME, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise RuntimeError(
                f"shards dir {shards_dir}: another extraction holds {LOCK_NAME}; wait for it to finish or stop it "
                f"(two writers would delete each other's temporaries and race on the manifest)"
            ) from e
        yield


def _load_target_for(run: ExtractRunMeta, target_path: str | Path, device: str) -> Target:
    target = load_target(target_path, run.target_dtype)
    if target.hidden_size != run.hidden_size:
        raise ValueError(
            f"target {target_path}: loaded model has H={target.hidden_size}, config.json says "
            f"{run.hidden_size}; the model directory changed during the run"
        )
    target.model.to(device)
    return target


def extract_hidden_states(
    *,
    tokenized_path: str | Path,
    shards_dir: str | Path,
    target_path: str | Path,
    aux_layer_ids: list[int] | None,
    extract_cfg: ExtractConfig,
    target_dtype: str = "float32",
    device: str = "cpu",
    progress: Callable[[dict], None] | None = None,
) -> ExtractSummary:
    """Extract every shard of the plan that the manifest does not list yet; return what was done.
    The target is loaded only when some shard is missing."""
    t0 = time.perf_counter()
    shards_dir = Path(shards_dir)
    shards_dir.mkdir(parents=True, exist_ok=True)
    dataset = TokenizedDataset(Path(tokenized_path))
    run, plan = describe_extraction(
        dataset=dataset,
        target_path=target_path,
        aux_layer_ids=aux_layer_ids,
        extract_cfg=extract_cfg,
        target_dtype=target_dtype,
    )
    with _exclusive(shards_dir):
        check_run_meta(shards_dir, run)
        strays = remove_stray_temporaries(shards_dir)
        done = _check_manifest_against_plan(shards_dir, plan)
        todo = [p for p in plan if p.index not in done]
        summary = ExtractSummary(
            shards_total=len(plan),
            shards_written=0,
            shards_skipped=len(done),
            unlisted_rewritten=sum((shards_dir / shard_filename(p.index)).exists() for p in todo),
            strays_removed=len(strays),
            samples_total=len(dataset),
            tokens_written=0,
            seconds=0.0,
            aux_layer_ids=run.aux_layer_ids,
            hidden_size=run.hidden_size,
        )
        report = _progress_reporter(progress, plan, done, len(dataset))
        report(None)
        target = _load_target_for(run, target_path, device) if todo else None
        for p in todo:
            tensors = _extract_shard(target, dataset, p, run.aux_layer_ids, extract_cfg=extract_cfg, device=device)
            append_manifest_row(shards_dir, write_shard(shards_dir, tensors, run.shard_meta(p)))
            summary.shards_written += 1
            summary.tokens_written += p.num_tokens
            report(p)
    summary.seconds = time.perf_counter() - t0
    return summary


def _progress_reporter(progress, plan: list[ShardPlan], done: set[int], samples_total: int):
    """A function called with each finished shard (None at start) that forwards counts to `progress`."""
    state = {
        "shards_done": len(done),
        "samples_done": sum(plan[i].sample_end - plan[i].sample_start for i in done),
        "tokens_done": sum(plan[i].num_tokens for i in done),
    }

    def report(p: ShardPlan | None) -> None:
        if p is not None:
            state["shards_done"] += 1
            state["samples_done"] += p.sample_end - p.sample_start
            state["tokens_done"] += p.num_tokens
        if progress is not None:
            progress(
                {
                    **state,
                    "shards_total": len(plan),
                    "samples_total": samples_total,
                    "shard_index": None if p is None else p.index,
                }
            )

    return report
