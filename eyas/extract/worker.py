"""One extraction worker: the shards it is given, through a hidden-state backend, into storage.

    summary = run_worker(extract_cfg, facts, worker_index=0, shard_indices=[0, 2, 4], target_dtype="bfloat16")

A worker writes only its own shards and their manifest row files (eyas.shards.manifest), each row
after its shard is durable, so any number of workers can run at once (threads of one process,
processes, or flow runs on other machines) as long as their shard lists are disjoint
(eyas.extract.plan.assign_shards). A worker skips the shards of its list that already have a row
(written by an earlier attempt), so a retried worker does only what is left.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from eyas.config import ExtractConfig, SGLangEnvConfig
from eyas.dataset.table import TokenizedDataset
from eyas.extract.backends import open_backend
from eyas.extract.backends.base import HiddenStateBackend, check_feature_widths
from eyas.extract.plan import describe_extraction
from eyas.facts import RunFacts
from eyas.shards.encoding import empty_features, encode_aux, encode_teacher, extract_encoding
from eyas.shards.format import ShardMeta, ShardPlan, write_shard
from eyas.shards.manifest import done_shard_indices, record_row
from eyas.shards.shard_set import check_run_meta
from eyas.storage import Storage


@dataclass
class WorkerSummary:
    worker_index: int
    shard_indices: list[int]  # the worker's list, as given
    tokens_written: int
    seconds: float
    shards_already_recorded: int = 0  # of its list, done by an earlier attempt and skipped

    def to_dict(self) -> dict:
        return asdict(self)


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
    enc, num_aux = extract_encoding(extract_cfg), len(aux_layer_ids)
    features = empty_features(enc, plan.num_tokens, num_aux=num_aux, hidden_size=hidden_size)
    for b in range(0, len(lengths), extract_cfg.batch_size):
        idx = range(b, min(b + extract_cfg.batch_size, len(lengths)))
        feats = backend.features([input_ids[offsets[i] : offsets[i + 1]] for i in idx])
        check_feature_widths(
            feats,
            [lengths[i] for i in idx],
            num_aux=num_aux,
            hidden_size=hidden_size,
            source=f"{backend.name} backend, shard {plan.index:05d} from sample {plan.sample_start + b}",
            teacher_topk=enc.teacher_topk,
        )
        for i, (aux, teacher) in zip(idx, feats):
            stored = {**encode_aux(aux, enc, num_aux=num_aux), **encode_teacher(teacher, enc)}
            for name, values in stored.items():
                features[name][offsets[i] : offsets[i + 1]] = values
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        **features,
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
    trust_remote_code: bool = False,
    sglang_env: SGLangEnvConfig = SGLangEnvConfig(),
) -> WorkerSummary:
    """Extract and record each of `shard_indices` (an `ExtractRunMeta` gives the shards' metadata); no check of
    what is already recorded (see `run_worker`)."""
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
        trust_remote_code=trust_remote_code,
        sglang_env=sglang_env,
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


def run_worker(
    cfg: ExtractConfig,
    facts: RunFacts,
    *,
    worker_index: int,
    shard_indices: list[int],
    target_dtype: str = "float32",
    store: Storage | None = None,
    dataset: TokenizedDataset | None = None,
    on_shard: Callable[[ShardPlan], None] | None = None,
) -> WorkerSummary:
    """The worker's entry: extract the shards of `shard_indices` that have no manifest row yet.

    `store` and `dataset` default to the run's (facts); threads of one coordinator pass theirs to share them."""
    store = facts.storage() if store is None else store
    run, plan = describe_extraction(cfg, facts, target_dtype=target_dtype)
    check_run_meta(store, run)  # a worker elsewhere must see the coordinator's parameters
    done = done_shard_indices(store)
    todo = [i for i in shard_indices if i not in done]
    summary = extract_worker(
        store=store,
        dataset=TokenizedDataset(facts.tokenized_path) if dataset is None and todo else dataset,
        run_meta=run,
        plan=plan,
        shard_indices=todo,
        extract_cfg=cfg,
        target_path=facts.target.model_path,
        worker_index=worker_index,
        on_shard=on_shard,
        trust_remote_code=facts.trust_remote_code,
        sglang_env=facts.sglang,
    )
    summary.shard_indices = list(shard_indices)
    summary.shards_already_recorded = len(shard_indices) - len(todo)
    return summary
