"""Shards and exported drafts built on the random target, for the diagnosis and benchmark-flow tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eyas.draft import DraftArch, build_draft, ttt_loss
from eyas.export import export_sglang
from eyas.manifest import append_manifest_row
from eyas.shards import ShardMeta, write_shard
from eyas.target import embed_weight, lm_head_weight, target_features

ARCH = DraftArch(
    hidden_size=64,
    num_aux=3,
    target_vocab_size=2048,
    draft_vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
)
AUX_IDS = [2, 4, 5]
SEQS = [[(13 * i + 5 * j * j) % 2047 + 1 for j in range(32)] for i in range(4)]


def write_shards(out: Path, model, fingerprint: str, *, narrow: bool = False) -> None:
    out.mkdir(parents=True)
    ids = torch.tensor(SEQS)
    aux, last, _ = target_features(model, ids, AUX_IDS)
    if narrow:  # the fc bypass: the target sent one H-wide state instead of n_aux * H
        aux = aux[..., : ARCH.hidden_size]
    tensors = {
        "input_ids": ids.flatten(),
        "loss_mask": torch.ones(ids.numel(), dtype=torch.uint8),
        "aux_hidden_states": aux.reshape(ids.numel(), -1).float(),
        "last_hidden_states": last.reshape(ids.numel(), -1).float(),
        "sample_offsets": torch.arange(0, ids.numel() + 1, ids.shape[1]),
        "sample_indices": torch.arange(len(SEQS)),
    }
    meta = ShardMeta(fingerprint, tuple(AUX_IDS), "hf_hidden_states", 64, 3, "float32", "hf", "h", 0, 0, len(SEQS))
    append_manifest_row(out, write_shard(out, tensors, meta))


def vocab_for(model) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft vocab holding every token the target predicts on SEQS, filled up to 512 ids."""
    _, _, logits = target_features(model, torch.tensor(SEQS), AUX_IDS)
    t2d = torch.zeros(2048, dtype=torch.bool)
    t2d[logits.argmax(-1).flatten()] = True
    t2d[torch.arange(2048)[~t2d][: 512 - int(t2d.sum())]] = True
    ids = t2d.nonzero().flatten()
    return ids - torch.arange(512), t2d


def train_and_export(root: Path, model, shards: Path, fingerprint: str, num_steps: int) -> Path:
    """A draft fitted to the shards for num_steps (0 = random), exported to SGLang's format."""
    from eyas.data import ShardSamples, collate

    d2t, t2d = vocab_for(model)
    draft = build_draft(ARCH, embed_weight(model).detach().float(), d2t, t2d, seed=3)
    samples = ShardSamples(shards)
    batch = collate([samples.load_sample(i) for i in range(len(samples))], max_len=64)
    head = lm_head_weight(model).detach().float()[t2d]
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(num_steps):
        loss, *_ = ttt_loss(draft, batch, head, 2, 0.8)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ckpt = root / "step-00000001"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(ckpt / "model.safetensors"))
    meta = {"arch": ARCH.to_dict(), "aux_layer_ids": AUX_IDS, "layer_id_convention": "hf_hidden_states"}
    (ckpt / "arch.json").write_text(json.dumps({**meta, "target_fingerprint": fingerprint}))
    (ckpt / "COMPLETE").write_text("")
    return export_sglang(ckpt, root / "export")
