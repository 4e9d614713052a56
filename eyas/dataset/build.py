"""The dataset stage's first step: prompts -> the target's responses -> the tokenized table.

    report = build_dataset(config)          # config: RunConfig; writes RUN/dataset/

The target answers each prompt (eyas.dataset.prompts) greedily; a sample is the prompt's tokens
(the chat template applied when the tokenizer has one, the raw text otherwise) followed by the
response's tokens, with loss mask 1 on the response only. Output: `tokenized.parquet`
(eyas.dataset.table), `report.json`, and `responses.jsonl` for people to read. A table whose cache
key (prompts, dataset config, target) matches is reused.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from eyas.config import DatasetConfig, RunConfig
from eyas.dataset.prompts import DatasetError, prompt_token_ids, read_prompts
from eyas.dataset.table import content_hash, read_tokenized_meta, write_tokenized_table
from eyas.fsio import atomic_write_bytes, read_json_record
from eyas.target import Target, load_target, target_fingerprint

REPORT_FILE = "report.json"
RESPONSES_FILE = "responses.jsonl"


@dataclass
class DatasetReport:
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    num_empty_mask: int
    num_truncated: int
    content_hash: str
    seconds: float
    reused: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def generate_responses(
    target: Target, prompts: list[list[int]], max_new_tokens: int, batch_size: int, progress: Callable | None = None
) -> list[list[int]]:
    """Greedy responses, batched with left padding; each cut after the first EOS (kept)."""
    eos = target.eos_token_id
    pad = eos if eos is not None else 0
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        gen = target.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
        )
        for row in gen[:, width:].tolist():
            if eos is not None and eos in row:
                row = row[: row.index(eos) + 1]
            out.append(row)
        if progress:
            progress({"samples_done": len(out), "samples_total": len(prompts)})
    return out


def dataset_cache_key(cfg: DatasetConfig, target_path: str | Path) -> str:
    h = hashlib.sha256(Path(cfg.prompts_path).read_bytes())
    h.update(json.dumps(cfg.model_dump(mode="json", exclude={"prompts_path"}), sort_keys=True).encode())
    h.update(target_fingerprint(target_path).encode())
    return h.hexdigest()[:16]


def build_dataset(config: RunConfig, *, progress: Callable | None = None) -> DatasetReport:
    """Regenerate, tokenize and write the table; reuse it when the cache key (prompts, config, target) matches."""
    t0 = time.time()
    cfg, target_path, out = config.dataset, config.target.model_path, config.paths.dataset_dir
    table_path = config.paths.tokenized
    key = dataset_cache_key(cfg, target_path)
    if table_path.exists() and read_tokenized_meta(table_path).get("eyas.cache_key") == key:
        report = json.loads((out / REPORT_FILE).read_text())
        return DatasetReport(**{**report, "reused": True})

    rows = read_prompts(cfg.prompts_path, cfg.num_samples)
    target = load_target(target_path, config.target.dtype)
    prompt_ids = [prompt_token_ids(target.tokenizer, r["conversations"]) for r in rows]
    responses = generate_responses(target, prompt_ids, cfg.max_new_tokens, cfg.generate_batch_size, progress)

    ids, masks, truncated = [], [], 0
    for row, p, r in zip(rows, prompt_ids, responses, strict=True):
        full, mask = p + r, [0] * len(p) + [1] * len(r)
        if len(full) > cfg.max_length:
            truncated += 1
            if len(full) - cfg.max_length > len(full) // 2:
                raise DatasetError(
                    f"sample {row['id']}: {len(full)} tokens, truncation to dataset.max_length="
                    f"{cfg.max_length} drops most of it; raise max_length or shorten the prompt"
                )
            full, mask = full[: cfg.max_length], mask[: cfg.max_length]
        ids.append(full)
        masks.append(mask)
    report = _check_and_write(cfg, rows, ids, masks, truncated, key, table_path, t0)
    _write_responses(out / RESPONSES_FILE, rows, responses, target.tokenizer)
    return report


def _check_and_write(cfg, rows, ids, masks, truncated, key, table_path: Path, t0: float) -> DatasetReport:
    empty = sum(1 for m in masks if not any(m))
    if empty > cfg.max_empty_mask_fraction * len(masks):
        raise DatasetError(
            f"dataset: {empty} of {len(masks)} samples have an all-zero loss mask (no response token), "
            f"more than dataset.max_empty_mask_fraction={cfg.max_empty_mask_fraction}; the target answered "
            f"with EOS at once or max_length cuts the responses: check the prompts and the chat template"
        )
    out = table_path.parent
    out.mkdir(parents=True, exist_ok=True)
    sample_ids = [str(r["id"]) for r in rows]
    chash = content_hash(ids, masks, sample_ids)
    report = DatasetReport(
        num_samples=len(ids),
        num_tokens=sum(map(len, ids)),
        num_loss_tokens=sum(map(sum, masks)),
        num_empty_mask=empty,
        num_truncated=truncated,
        content_hash=chash,
        seconds=round(time.time() - t0, 2),
    )
    atomic_write_bytes(out / REPORT_FILE, json.dumps(report.to_dict(), indent=2).encode())
    write_tokenized_table(table_path, sample_ids, ids, masks, dataset_hash=chash, cache_key=key)
    return report


def _write_responses(path: Path, rows, responses, tokenizer) -> None:
    lines = []
    for row, r in zip(rows, responses, strict=True):
        turn = {"role": "assistant", "content": tokenizer.decode(r, skip_special_tokens=True)}
        lines.append(json.dumps({"id": row["id"], "conversations": row["conversations"] + [turn]}))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())


def read_dataset_report(dataset_dir: str | Path) -> dict | None:
    """report.json of a built dataset (DatasetReport's fields), or None when there is none."""
    return read_json_record(Path(dataset_dir) / REPORT_FILE)
