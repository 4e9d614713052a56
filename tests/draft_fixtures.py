"""Drafts for tests: checkpoints written by the checkpoint writer (eyas.train.checkpoint), and shards and
exported drafts built on the random target, for the export, diagnosis and benchmark tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from eyas.draft import DraftArch, build_draft
from eyas.export.convert import export_sglang
from eyas.layer_ids import LAYER_ID_CONVENTION
from eyas.objective import ttt_loss
from eyas.shards.format import ShardMeta, write_shard
from eyas.shards.manifest import append_manifest_row
from eyas.shards.reader import ShardSamples
from eyas.target import embed_weight, lm_head_weight, target_features
from eyas.train.checkpoint import save_checkpoint
from eyas.train.checkpoint import write_checkpoint as write_training_checkpoint
from eyas.train.data import collate

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


# A smaller draft for checkpoint tests, with a training run around it.
SMALL_ARCH = DraftArch(
    hidden_size=16,
    num_aux=3,
    target_vocab_size=40,
    draft_vocab_size=20,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=32,
)


def vocab_mapping(arch: DraftArch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random valid (d2t offsets, t2d) for the arch's vocab sizes."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(arch.target_vocab_size, generator=g)[: arch.draft_vocab_size].sort().values
    t2d = torch.zeros(arch.target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(arch.draft_vocab_size), t2d


def write_checkpoint(path: Path, arch: DraftArch = ARCH, aux_ids=AUX_IDS, state_edit=None, embed=None) -> Path:
    """A complete training checkpoint at `path`, written by eyas.train.checkpoint.write_checkpoint (norm weights
    perturbed; `state_edit(state)` may damage the state first) and moved there whole; returns `path`."""
    d2t, t2d = vocab_mapping(arch)
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(arch.target_vocab_size, arch.hidden_size, generator=g) if embed is None else embed
    draft = build_draft(arch, embed, d2t, t2d, seed=3)
    state = {k: v.clone().contiguous() for k, v in draft.state_dict().items()}
    for k in state:
        if k.endswith("norm.weight"):
            state[k] = 1 + 0.1 * torch.randn(state[k].shape, generator=g)
    if state_edit:
        state_edit(state)
    scratch = path.parent / f".writing-{path.name}"
    step_dir = write_training_checkpoint(
        scratch,
        10,
        model_state=state,
        optimizer_state={},
        scheduler_state={},
        arch=arch,
        trainer_state={"samples_consumed": 80, "epoch": 0, "world_size": 1, "global_batch_size": 8, "loss": 1.0},
        aux_layer_ids=list(aux_ids),
        target_fingerprint="abc123",
        keep_last=1,
    )
    step_dir.rename(path)
    shutil.rmtree(scratch)
    return path


def make_training(seed: int = 0):
    """A SMALL_ARCH draft with its AdamW optimizer and a scheduler."""
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[::2] = True
    draft = build_draft(SMALL_ARCH, torch.randn(40, 16), torch.arange(20), t2d, seed=seed)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return draft, optimizer, scheduler


def take_step(draft, optimizer, scheduler) -> None:
    draft.fc.weight.sum().backward()
    draft.lm_head.weight.square().sum().backward()
    optimizer.step()
    scheduler.step()


def save(output_dir: Path, step: int, training=None, keep_last: int = 5, trainer_state: dict | None = None) -> Path:
    """Save step `step` of a training run (make_training's by default) with save_checkpoint; `trainer_state`
    adds fields (an "eval" record)."""
    draft, optimizer, scheduler = training or make_training()
    state = {"samples_consumed": 8 * step, "epoch": 0, "world_size": 2, "global_batch_size": 8, "loss": 1.5}
    state.update(trainer_state or {})
    return save_checkpoint(
        output_dir,
        step,
        draft=draft,
        optimizer=optimizer,
        scheduler=scheduler,
        trainer_state=state,
        aux_layer_ids=[2, 5, 8],
        target_fingerprint="abc123",
        keep_last=keep_last,
    )


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
    meta = ShardMeta(fingerprint, tuple(AUX_IDS), LAYER_ID_CONVENTION, 64, 3, "float32", "hf", "h", 0, 0, len(SEQS))
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
    ckpt = write_training_checkpoint(
        root,
        1,
        model_state={k: v.contiguous() for k, v in draft.state_dict().items()},
        optimizer_state={},
        scheduler_state={},
        arch=ARCH,
        trainer_state={"samples_consumed": 0, "epoch": 0, "world_size": 1, "global_batch_size": 4, "loss": None},
        aux_layer_ids=AUX_IDS,
        target_fingerprint=fingerprint,
        keep_last=1,
    )
    return export_sglang(ckpt, root / "export")
