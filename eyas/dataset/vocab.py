"""The dataset stage's second step: the draft vocabulary mapping from loss-masked token frequencies.

    built = build_vocab(config)        # config: RunConfig; writes RUN/dataset/vocab.safetensors

The draft predicts over the `draft_vocab_size` most frequent response tokens (ties broken by the
lower id), kept in ascending id order. `t2d` is a bool mask over the target vocab; `d2t` holds
OFFSETS: draft id i is target id `i + d2t[i]` (the convention of EAGLE-3 and SGLang).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eyas.config import RunConfig
from eyas.dataset.table import read_dataset_hash, token_arrays
from eyas.draft_keys import vocab_mapping_problems
from eyas.fsio import atomic_write_bytes, serialize_safetensors
from eyas.target import embedding_rows


class VocabMappingError(ValueError):
    """d2t / t2d violate the mapping's invariants."""


def count_loss_tokens(input_ids, loss_mask, target_vocab_size: int) -> torch.Tensor:
    """Occurrences of each target id among the loss-masked tokens; ids and mask are flat, aligned arrays."""
    ids, mask = np.asarray(input_ids, dtype=np.int64).ravel(), np.asarray(loss_mask).ravel().astype(bool)
    if ids.shape != mask.shape:
        raise ValueError(f"count_loss_tokens: {ids.size} token ids but {mask.size} mask values; expected one each")
    return torch.from_numpy(np.bincount(ids[mask], minlength=target_vocab_size).astype(np.int64))


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
    """t2d (bool) marks exactly draft_vocab_size ids and d2t (int64) holds offsets: arange + d2t == nonzero(t2d);
    the first problem (eyas.draft_keys.vocab_mapping_problems) is raised, naming `where`."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabMappingError(f"{where}: dtypes d2t {d2t.dtype}, t2d {t2d.dtype}; expected int64 and bool")
    problems = vocab_mapping_problems(d2t.cpu().numpy(), t2d.cpu().numpy(), draft_vocab_size)
    if problems:
        raise VocabMappingError(f"{where}: {problems[0]}")


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, content_hash: str) -> None:
    path = Path(path)
    meta = {"content_hash": content_hash, "draft_vocab_size": str(d2t.numel()), "target_vocab_size": str(t2d.numel())}
    # eyas's own writer: safetensors' save_file orders the metadata keys by hash, so two runs could differ
    atomic_write_bytes(path, bytes(serialize_safetensors({"d2t": d2t, "t2d": t2d}, meta)))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, dict]:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    check_vocab_mapping(d2t, t2d, where=str(path))
    return d2t, t2d, meta


def vocab_sizes(path: str | Path) -> tuple[int, int]:
    """(draft vocab size, target vocab size) of a saved mapping, from its header."""
    with safe_open(path, framework="pt") as f:
        return f.get_slice("d2t").get_shape()[0], f.get_slice("t2d").get_shape()[0]


def ensure_vocab(
    path: str | Path, input_ids, loss_mask, content_hash: str, target_vocab_size: int, draft_vocab_size: int
) -> bool:
    """Build and save the mapping unless one for the same data and sizes exists; input_ids and loss_mask are
    flat arrays of every sample's tokens. Returns True if built."""
    path = Path(path)
    if path.exists():
        _, _, meta = load_vocab(path)
        if meta == {
            "content_hash": content_hash,
            "draft_vocab_size": str(draft_vocab_size),
            "target_vocab_size": str(target_vocab_size),
        }:
            return False
    counts = count_loss_tokens(input_ids, loss_mask, target_vocab_size)
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)
    save_vocab(path, d2t, t2d, content_hash)
    return True


def build_vocab(config: RunConfig) -> dict:
    """The stage entry: the mapping of the run's tokenized table (cached by its content hash and both sizes)."""
    paths = config.paths
    ids, mask = token_arrays(paths.tokenized)
    vocab_size = embedding_rows(config.target.model_path)
    built = ensure_vocab(
        paths.vocab, ids, mask, read_dataset_hash(paths.tokenized), vocab_size, config.dataset.draft_vocab_size
    )
    d2t, t2d, meta = load_vocab(paths.vocab)
    return {
        "built": built,
        "draft_vocab_size": d2t.numel(),
        "target_vocab_size": t2d.numel(),
        "content_hash": meta["content_hash"],
    }
