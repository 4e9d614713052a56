"""Draft vocabulary mapping from loss-masked token frequencies.

The draft predicts over the `draft_vocab_size` most frequent response tokens (ties broken by the
lower id), kept in ascending id order. `t2d` is a bool mask over the target vocab; `d2t` holds
OFFSETS: draft id i is target id `i + d2t[i]` (the convention of EAGLE-3 and SGLang).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.fsio import commit_temp, temp_path


class VocabMappingError(ValueError):
    """d2t / t2d violate the mapping's invariants."""


def count_loss_tokens(input_ids: list[list[int]], loss_masks: list[list[int]], target_vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        ids_t, mask_t = torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids_t[mask_t], minlength=target_vocab_size)
    return counts


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from token counts."""
    target_vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise VocabMappingError(
            f"dataset.draft_vocab_size={draft_vocab_size}: expected 1..{target_vocab_size} (the target's vocab size)"
        )
    # stable sort on -count keeps ascending ids among equal counts: ties go to the lower id
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    chosen = torch.sort(order).values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(draft_vocab_size)
    check_vocab_mapping(d2t, t2d, "vocab mapping")
    return d2t, t2d


def check_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, where: str, draft_vocab_size: int | None = None) -> None:
    """t2d marks exactly draft_vocab_size ids and d2t holds offsets: arange + d2t == nonzero(t2d)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabMappingError(f"{where}: dtypes d2t {d2t.dtype}, t2d {t2d.dtype}; expected int64 and bool")
    size = d2t.numel() if draft_vocab_size is None else draft_vocab_size
    count = int(t2d.sum())
    if count != size or d2t.numel() != size:
        raise VocabMappingError(
            f"{where}: t2d marks {count} target ids, d2t has {d2t.numel()}, expected draft_vocab_size={size}; "
            "the vocab mapping does not belong to this draft: rebuild it with the same draft_vocab_size"
        )
    ids = t2d.nonzero().flatten()
    mapped = torch.arange(size) + d2t
    if torch.equal(mapped, ids):
        return
    if torch.equal(d2t, ids):
        raise VocabMappingError(
            f"{where}: d2t holds absolute target ids, expected offsets (target_id = i + d2t[i]); "
            "store d2t = target_ids - arange(draft_vocab_size)"
        )
    bad = int(torch.nonzero(mapped != ids).flatten()[0])
    raise VocabMappingError(
        f"{where}: arange + d2t differs from nonzero(t2d) first at draft id {bad} "
        f"(maps to {int(mapped[bad])}, t2d says {int(ids[bad])}); d2t and t2d describe different vocabularies: "
        "rebuild both from the same sorted list of target ids"
    )


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, content_hash: str) -> None:
    path = Path(path)
    tmp = temp_path(path)
    meta = {"content_hash": content_hash, "draft_vocab_size": str(d2t.numel()), "target_vocab_size": str(t2d.numel())}
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, tmp, metadata=meta)
    commit_temp(tmp, path)


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    check_vocab_mapping(d2t, t2d, where=str(path))
    return d2t, t2d, meta


def ensure_vocab(
    path: str | Path, input_ids, loss_masks, content_hash: str, target_vocab_size: int, draft_vocab_size: int
) -> bool:
    """Build and save the mapping unless one for the same data and sizes exists. Returns True if built."""
    path = Path(path)
    if path.exists():
        _, _, meta = load_vocab(path)
        if meta == {
            "content_hash": content_hash,
            "draft_vocab_size": str(draft_vocab_size),
            "target_vocab_size": str(target_vocab_size),
        }:
            return False
    counts = count_loss_tokens(input_ids, loss_masks, target_vocab_size)
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)
    save_vocab(path, d2t, t2d, content_hash)
    return True
