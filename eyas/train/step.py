"""One optimizer step over a rank's share of the global batch, in token-budget micro-batches.

    model = parallelize(TTTObjective(draft, head_rows, num_steps=7, decay=0.8, bf16=True), "fsdp2", device)
    stats = train_step(model, optimizer, scheduler, micro_batches, max_grad_norm=0.5)
    record = reduce_stats(stats, decay=0.8)          # token-weighted over all ranks

A rank's samples are split into micro-batches (eyas.train.data.split_micro_batches); each runs forward and
backward in turn, and only the last one's backward runs the collective gradient sync (DDP `no_sync`, FSDP2
`set_requires_gradient_sync`), so gradients accumulate locally in between. Every micro-batch's loss is divided
by the loss tokens of the whole global batch (one all-reduce of the per-step counts before the first forward)
and multiplied by the world size, which the ranks' gradient averaging divides out: the update is that of the
global batch as one batch, whatever the world size and the split.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from eyas.draft import Eagle3Draft
from eyas.objective import loss_token_counts, ttt_loss
from eyas.train.evaluate import eval_stats
from eyas.train.parallel import local_value


class TTTObjective(nn.Module):
    """The draft plus its loss, so that the wrapper's forward (DDP arms gradient sync, FSDP2 gathers the
    parameters) runs the TTT unroll."""

    def __init__(
        self,
        draft: Eagle3Draft,
        head_rows: torch.Tensor,
        num_steps: int,
        decay: float,
        bf16: bool,
        *,
        checkpointing: bool = False,
    ):
        super().__init__()
        self.draft = draft
        self.head_rows = head_rows  # a plain attribute: constant, neither saved, broadcast nor sharded
        self.num_steps, self.decay, self.bf16, self.checkpointing = num_steps, decay, bf16, checkpointing

    def forward(self, batch: dict, eval_steps: int = 0, chain_steps: int = 0, token_norm: torch.Tensor | None = None):
        """The TTT loss (divided per step by token_norm, when given); with eval_steps > 0 the held-out sums of
        eyas.train.evaluate.eval_stats instead."""
        device = batch["input_ids"].device.type
        # the teacher and the soft cross-entropy are computed in fp32 inside, with autocast off for the teacher
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.bf16):
            if eval_steps:
                return eval_stats(self.draft, batch, self.head_rows, eval_steps, chain_steps)
            return ttt_loss(
                self.draft,
                batch,
                self.head_rows,
                self.num_steps,
                self.decay,
                token_norm=token_norm,
                checkpointing=self.checkpointing,
            )


def unwrapped(model: nn.Module) -> TTTObjective:
    """The TTTObjective inside a DDP wrapper (FSDP2 shards it in place)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def use_bf16(mixed_precision: str, device: torch.device) -> bool:
    """auto: bf16 autocast on CUDA, fp32 on CPU; an explicit bf16 without CUDA is refused."""
    if mixed_precision == "bf16" and device.type != "cuda":
        raise ValueError(
            f"train.mixed_precision='bf16' on {device}: bf16 autocast is for CUDA devices; use 'auto' or 'off' on CPU"
        )
    return device.type == "cuda" and mixed_precision != "off"


def make_optimizer(draft: Eagle3Draft, lr: float, weight_decay: float) -> torch.optim.AdamW:
    trainable = [p for p in draft.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)


def make_scheduler(optimizer, num_warmup_steps: int, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak lr over `num_warmup_steps`, then cosine decay towards 0 at `total_steps`."""

    def factor(step: int) -> float:
        if step < num_warmup_steps:
            return (step + 1) / num_warmup_steps
        progress = (step - num_warmup_steps) / max(1, total_steps - num_warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Forward and backward of one micro-batch, with the collective gradient sync only when `enabled`."""
    if enabled:
        yield
        return
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield  # a plain module: nothing to sync


def global_token_counts(micro_batches: list[dict], objective: TTTObjective) -> torch.Tensor:
    """The loss tokens of each unroll step in the whole global batch: this rank's micro-batches, all ranks."""
    counts = sum(loss_token_counts(b, objective.draft.t2d, objective.num_steps) for b in micro_batches)
    if dist.is_initialized():
        dist.all_reduce(counts)  # on the batch's device: NCCL reduces CUDA tensors only
    return counts


def train_step(model: nn.Module, optimizer, scheduler, micro_batches: list[dict], max_grad_norm: float) -> dict:
    """One optimizer step over this rank's micro-batches; returns this rank's per-step stats (tensors), the
    padded and real tokens it computed, and the lr it used."""
    optimizer.zero_grad(set_to_none=True)
    token_norm = global_token_counts(micro_batches, unwrapped(model))
    world = dist.get_world_size() if dist.is_initialized() else 1
    sums, computed = None, 0
    for i, batch in enumerate(micro_batches):
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            total, losses, accs, counts = model(batch, token_norm=token_norm)
            (total * world).backward()
        sums = add_step_sums(sums, losses, accs, counts)
        computed += batch["valid"].numel()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)  # FSDP2: over all shards (DTensors)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    real = sum(int(b["valid"].sum()) for b in micro_batches)
    return {
        **per_step_means(sums),
        "tokens_real": real,
        "tokens_computed": computed,
        "num_micro_batches": len(micro_batches),
        "grad_norm": float(local_value(grad_norm)),
        "lr": lr,
    }


def add_step_sums(sums: dict | None, losses: list, accs: list, counts: list) -> dict:
    """Running token-weighted sums of per-step losses and accuracies over micro-batches."""
    counts_t = torch.stack(counts).detach().float()
    new = {
        "loss": torch.stack(losses).detach() * counts_t,
        "acc": torch.stack(accs).detach() * counts_t,
        "count": counts_t,
    }
    return new if sums is None else {k: sums[k] + new[k] for k in new}


def per_step_means(sums: dict) -> dict:
    """The stats of train_step from summed micro-batches: per-step mean losses, accuracies and counts (lists)."""
    n = sums["count"].clamp(min=1.0)
    return {"losses": list(sums["loss"] / n), "accs": list(sums["acc"] / n), "counts": list(sums["count"])}


def reduce_stats(stats: dict, decay: float) -> dict:
    """Token-weighted loss and accuracy per TTT step over all ranks; loss = sum_k decay^k loss_k; the share of
    computed tokens that were padding."""
    counts = torch.stack(stats["counts"]).float()
    table = torch.stack([torch.stack(stats["losses"]) * counts, torch.stack(stats["accs"]) * counts, counts])
    table = table.detach().double()  # reduced where it lies: NCCL reduces CUDA tensors only
    tokens = torch.tensor([stats.get("tokens_real", 0), stats.get("tokens_computed", 0)], dtype=torch.float64)
    flat = torch.cat([table.flatten(), tokens.to(table.device)])
    if dist.is_initialized():
        dist.all_reduce(flat)
    flat = flat.cpu()
    table, (real, computed) = flat[: table.numel()].view_as(table), flat[table.numel() :].tolist()
    n = table[2].clamp(min=1.0)
    loss_k, acc_k = (table[0] / n).tolist(), (table[1] / n).tolist()
    return {
        "loss": sum(decay**k * v for k, v in enumerate(loss_k)),
        "loss_k": loss_k,
        "acc_k": acc_k,
        "num_tokens": int(table[2, 0]),
        "padding_waste": round(1 - real / computed, 4) if computed else 0.0,
    }
