"""Dataset stage: prompts -> target-regenerated responses -> tokenized table -> draft vocab mapping.

Prompts are JSONL rows `{id, conversations: [{role, content}, ...]}` whose last turn is the
user's. The target answers each greedily; a sample is the prompt's tokens (the chat template
applied when the tokenizer has one, the raw text otherwise) followed by the response's tokens,
with loss mask 1 on the response only. Output: `tokenized.parquet` (columns sample_index, id,
input_ids, loss_mask, num_tokens; schema metadata `eyas.content_hash` and `eyas.cache_key`) and
`responses.jsonl` for people to read.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eyas.config import DatasetConfig
from eyas.fsio import atomic_write_bytes, commit_temp, temp_path
from eyas.target import Target, target_fingerprint

ROLES = ("user", "assistant")


class DatasetError(ValueError):
    """The prompts or the tokenized samples are unusable for training."""


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


def read_prompts(path: str | Path, num_samples: int = 0) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            check_conversation(row, f"{path}:{line_no}")
            rows.append(row)
            if num_samples and len(rows) == num_samples:
                break
    if not rows:
        raise DatasetError(f"prompts file {path}: no prompts found; expected JSONL rows {{id, conversations}}")
    return rows


def check_conversation(row: dict, where: str) -> None:
    turns = row.get("conversations")
    if "id" not in row or not isinstance(turns, list) or not turns:
        raise DatasetError(
            f"{where}: expected {{id, conversations: [{{role, content}}, ...]}}, found keys {sorted(row)}"
        )
    if turns[0].get("role") == "system":
        turns = turns[1:]
    roles = [t.get("role") for t in turns]
    expected = [ROLES[i % 2] for i in range(len(roles))]
    if roles != expected or roles[-1] != "user":
        raise DatasetError(
            f"{where} (id {row['id']}): roles {roles}; expected alternating user/assistant ending with "
            f"user (the target writes the next assistant turn); fix the conversation's roles"
        )


def prompt_token_ids(tokenizer, conversation: list[dict]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True))
    return tokenizer("".join(t["content"] for t in conversation), add_special_tokens=False)["input_ids"]


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


def content_hash(ids: list[list[int]], masks: list[list[int]], sample_ids: list[str]) -> str:
    h = hashlib.sha256()
    for sid, x, m in zip(sample_ids, ids, masks, strict=True):
        h.update(sid.encode())
        h.update(np.asarray(x, dtype=np.int32).tobytes())
        h.update(np.asarray(m, dtype=np.uint8).tobytes())
    return h.hexdigest()[:16]


def dataset_cache_key(cfg: DatasetConfig, target_path: str | Path) -> str:
    h = hashlib.sha256(Path(cfg.prompts_path).read_bytes())
    h.update(json.dumps(cfg.model_dump(mode="json", exclude={"prompts_path"}), sort_keys=True).encode())
    h.update(target_fingerprint(target_path).encode())
    return h.hexdigest()[:16]


def read_tokenized_meta(path: Path) -> dict[str, str]:
    meta = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"eyas.")}


def build_dataset(
    cfg: DatasetConfig,
    target_path: str | Path,
    out_dir: str | Path,
    *,
    target_dtype: str = "float32",
    progress: Callable | None = None,
) -> DatasetReport:
    """Regenerate, tokenize and write the table; reuse it when the cache key (prompts, config, target) matches."""
    from eyas.target import load_target

    t0 = time.time()
    out = Path(out_dir)
    table_path = out / "tokenized.parquet"
    key = dataset_cache_key(cfg, target_path)
    if table_path.exists() and read_tokenized_meta(table_path).get("eyas.cache_key") == key:
        report = json.loads((out / "report.json").read_text())
        return DatasetReport(**{**report, "reused": True})

    rows = read_prompts(cfg.prompts_path, cfg.num_samples)
    target = load_target(target_path, target_dtype)
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
    report = _check_and_write(cfg, rows, ids, masks, truncated, key, out, t0)
    _write_responses(out / "responses.jsonl", rows, responses, target.tokenizer)
    return report


def _check_and_write(cfg, rows, ids, masks, truncated, key, out: Path, t0: float) -> DatasetReport:
    empty = sum(1 for m in masks if not any(m))
    if empty > cfg.max_empty_mask_fraction * len(masks):
        raise DatasetError(
            f"dataset: {empty} of {len(masks)} samples have an all-zero loss mask (no response token), "
            f"more than dataset.max_empty_mask_fraction={cfg.max_empty_mask_fraction}; the target answered "
            f"with EOS at once or max_length cuts the responses: check the prompts and the chat template"
        )
    sample_ids = [str(r["id"]) for r in rows]
    chash = content_hash(ids, masks, sample_ids)
    table = pa.table(
        {
            "sample_index": pa.array(range(len(ids)), pa.int64()),
            "id": pa.array(sample_ids, pa.string()),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(x) for x in ids], pa.int32()),
        }
    ).replace_schema_metadata({"eyas.content_hash": chash, "eyas.cache_key": key})
    out.mkdir(parents=True, exist_ok=True)
    report = DatasetReport(
        num_samples=len(ids),
        num_tokens=sum(map(len, ids)),
        num_loss_tokens=sum(map(sum, masks)),
        num_empty_mask=empty,
        num_truncated=truncated,
        content_hash=chash,
        seconds=round(time.time() - t0, 2),
    )
    atomic_write_bytes(out / "report.json", json.dumps(report.to_dict(), indent=2).encode())
    tmp = temp_path(out / "tokenized.parquet")
    pq.write_table(table, tmp)
    commit_temp(tmp, out / "tokenized.parquet")
    return report


def _write_responses(path: Path, rows, responses, tokenizer) -> None:
    lines = []
    for row, r in zip(rows, responses, strict=True):
        turn = {"role": "assistant", "content": tokenizer.decode(r, skip_special_tokens=True)}
        lines.append(json.dumps({"id": row["id"], "conversations": row["conversations"] + [turn]}))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())


def tokenized_num_samples(path: str | Path) -> int:
    """Samples in a tokenized table (from the Parquet footer; reads no rows)."""
    return pq.read_metadata(path).num_rows


def read_tokenized(path: str | Path) -> tuple[list[list[int]], list[list[int]], str]:
    table = pq.read_table(path)
    meta = read_tokenized_meta(Path(path))
    return table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist(), meta["eyas.content_hash"]
