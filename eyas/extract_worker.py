"""One extraction worker: the shards it is given, through a hidden-state backend, into storage.

    summary = extract_worker(store=..., dataset=..., run=..., plan=..., shard_indices=[0, 2, 4],
                             extract_cfg=..., target_path=..., worker_index=0)

A worker writes only its own shards and their manifest row files (eyas.manifest), each row after
its shard is durable, so any number of workers can run at once (threads of one process, processes,
or flow runs on other machines) as long as their shard lists are disjoint (`assign_shards`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from eyas.config import ExtractConfig
from eyas.extract_backends import HiddenStateBackend, check_feature_widths, open_backend
from eyas.manifest import record_row
from eyas.shards import ShardMeta, ShardPlan, TokenizedDataset, write_shard
from eyas.storage import Storage
from eyas.target import torch_dtype


@dataclass
class WorkerSummary:
    worker_index: int
    shard_indices: list[int]
    tokens_written: int
    seconds: float


def assign_shards(todo: list[int], num_workers: int) -> list[list[int]]:
    """Disjoint shard lists, one per worker (round robin: every worker gets early and late shards)."""
    if num_workers < 1:
        raise ValueError(f"num_workers={num_workers}: expected >= 1")
    return [todo[k::num_workers] for k in range(num_workers)]


def worker_device(device: str, worker_index: int) -> str:
    """cpu, or the worker's GPU (worker k on GPU k modulo the GPUs present)."""
    if device == "cpu":
        return "cpu"
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError(f"extract.device={device!r} but no CUDA GPU is visible; set extract.device='cpu'")
    return f"cuda:{worker_index % count}"


def extract_shard_tensors(
    backend: HiddenStateBackend,
    dataset: TokenizedDataset,
    plan: ShardPlan,
    *,
    aux_layer_ids: list[int],
    hidden_size: int,
    extract_cfg: ExtractConfig,
) -> dict[str, torch.Tensor]:
    """The tensors of one shard; batches start at the shard's first sample, so a shard's contents never
    depend on which worker extracts it."""
    input_ids, loss_mask = dataset.tokens(plan.sample_start, plan.sample_end)
    lengths = dataset.num_tokens[plan.sample_start : plan.sample_end]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64).cumsum(0)])
    dtype = torch_dtype(extract_cfg.dtype)
    aux_out = torch.empty(plan.num_tokens, len(aux_layer_ids) * hidden_size, dtype=dtype)
    last_out = torch.empty(plan.num_tokens, hidden_size, dtype=dtype)
    for b in range(0, len(lengths), extract_cfg.batch_size):
        idx = range(b, min(b + extract_cfg.batch_size, len(lengths)))
        feats = backend.features([input_ids[offsets[i] : offsets[i + 1]] for i in idx])
        check_feature_widths(
            feats,
            [lengths[i] for i in idx],
            num_aux=len(aux_layer_ids),
            hidden_size=hidden_size,
            source=f"{backend.name} backend, shard {plan.index:05d} from sample {plan.sample_start + b}",
        )
        for i, (aux, last) in zip(idx, feats):
            aux_out[offsets[i] : offsets[i + 1]] = aux.to(dtype)
            last_out[offsets[i] : offsets[i + 1]] = last.to(dtype)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "aux_hidden_states": aux_out,
        "last_hidden_states": last_out,
        "sample_offsets": offsets,
        "sample_indices": torch.arange(plan.sample_start, plan.sample_end, dtype=torch.int64),
    }


def _store_shard(store: Storage, tensors: dict, meta: ShardMeta, p: ShardPlan, on_shard) -> None:
    """Write the shard durably, then its manifest row; then report it."""
    record_row(store, write_shard(store, tensors, meta))
    if on_shard is not None:
        on_shard(p)


def extract_worker(
    *,
    store: Storage,
    dataset: TokenizedDataset,
    run_meta,
    plan: list[ShardPlan],
    shard_indices: list[int],
    extract_cfg: ExtractConfig,
    target_path: str,
    worker_index: int = 0,
    on_shard: Callable[[ShardPlan], None] | None = None,
) -> WorkerSummary:
    """Extract and record each of `shard_indices` (an `ExtractRunMeta` gives the shards' metadata)."""
    t0 = time.perf_counter()
    summary = WorkerSummary(worker_index, list(shard_indices), 0, 0.0)
    if not shard_indices:
        return summary
    backend = open_backend(
        extract_cfg,
        target_path=str(target_path),
        target_dtype=run_meta.target_dtype,
        aux_layer_ids=run_meta.aux_layer_ids,
        hidden_size=run_meta.hidden_size,
        device=worker_device(extract_cfg.device, worker_index),
    )
    # The file work of shard i (serialize, checksum, write, fsync, row) runs on a writer thread while
    # the backend computes shard i + 1; at most one shard waits, so memory holds two shards at most.
    pending: Future | None = None
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"extract-writer-{worker_index}") as writer:
            for index in shard_indices:
                p = plan[index]
                tensors = extract_shard_tensors(
                    backend,
                    dataset,
                    p,
                    aux_layer_ids=run_meta.aux_layer_ids,
                    hidden_size=run_meta.hidden_size,
                    extract_cfg=extract_cfg,
                )
                if pending is not None:
                    pending.result()
                pending = writer.submit(_store_shard, store, tensors, run_meta.shard_meta(p), p, on_shard)
                summary.tokens_written += p.num_tokens
            if pending is not None:
                pending.result()
    finally:
        backend.close()
    summary.seconds = time.perf_counter() - t0
    return summary
