"""The training objective of an EAGLE-3 draft: soft cross-entropy against the target over a TTT unroll.

    counts = loss_token_counts(batch, t2d, num_steps)            # [K] loss tokens per unroll step
    total, losses, accs, counts = ttt_loss(draft, batch, head_rows, num_steps, decay, token_norm=global_counts)

The teacher (`teacher_probs`) is the target's next-token distribution over the draft vocab, always computed in
fp32 outside autocast. Step k's loss is the sum of its tokens' cross-entropies divided by `token_norm[k]`: the
batch's own count by default, or, for a rank's micro-batch, the loss tokens of step k in the whole global batch
(all ranks, all micro-batches), so that the gradients summed over micro-batches and averaged over ranks equal
those of the global batch as one. `checkpointing` recomputes each unroll step (its layers, logits and
cross-entropy) in the backward instead of keeping its activations.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from eyas.draft import Eagle3Draft, unroll_inputs


def teacher_probs(batch: dict, target_lm_head: torch.Tensor, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution over the draft vocab at every position, [B, L, Vd] fp32, and where it
    has any mass [B, L].

    Dense teacher (batch["last_hidden"] [B, L, H]): softmax of last_hidden @ target_lm_head.T (the lm_head rows of
    the draft vocab). Top-K teacher (batch["topk_ids"], batch["topk_logprobs"] [B, L, K], log-probabilities over
    the full target vocab): the entries whose ids are in the draft vocab (t2d), renormalized to sum to 1; the
    mass outside the top K and outside the draft vocab is dropped, so when the top K holds all of the draft
    vocab's mass this equals the dense teacher. A position none of whose K entries is in the draft vocab has no
    mass and no loss. Computed in fp32 with autocast off, so a bf16 run learns from the same teacher as an fp32 one.
    """
    device = t2d.device.type
    with torch.no_grad(), torch.autocast(device, enabled=False):
        if "topk_ids" not in batch:
            logits = batch["last_hidden"].float() @ target_lm_head.float().T
            return torch.softmax(logits, -1), torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)
        ids, vocab = batch["topk_ids"].long(), t2d.numel()
        _check_topk_ids(ids, vocab)
        inside = t2d[ids]
        draft_index = torch.where(inside, (torch.cumsum(t2d.long(), 0) - 1)[ids], 0)
        p = torch.where(inside, batch["topk_logprobs"].float().exp(), 0.0)
        shape = (*ids.shape[:-1], target_lm_head.shape[0])
        dense = torch.zeros(shape, device=p.device).scatter_add_(-1, draft_index, p)
        mass = dense.sum(-1, keepdim=True)
        return dense / mass.clamp_min(torch.finfo(torch.float32).tiny), mass.squeeze(-1) > 0


def _check_topk_ids(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"top-K teacher ids span {int(ids.min())}..{int(ids.max())}, expected 0..{vocab - 1} (the target's "
            "vocab); the shards were extracted from another target: run eyas verify"
        )


def _has_mass(batch: dict, t2d: torch.Tensor) -> torch.Tensor:
    """Where the teacher has mass [B, L], without forming it: everywhere for a dense teacher, where any top-K id is
    in the draft vocab for a top-K one."""
    if "topk_ids" not in batch:
        return torch.ones(batch["input_ids"].shape, dtype=torch.bool, device=batch["input_ids"].device)
    ids = batch["topk_ids"].long()
    _check_topk_ids(ids, t2d.numel())
    return t2d[ids].any(-1)


def _step_mask(mask: torch.Tensor, k: int) -> torch.Tensor:
    """The positions step k is trained at [B, T - k]: index t learns the teacher at t + k + 1."""
    tlen = mask.shape[1] - 1
    return mask[:, k + 1 : k + 1 + max(tlen - k, 0)]


def loss_token_counts(batch: dict, t2d: torch.Tensor, num_steps: int) -> torch.Tensor:
    """The tokens each unroll step is trained on in this batch, [num_steps] fp64 (what ttt_loss normalizes by)."""
    mask = batch["loss_mask"].bool() & batch["valid"] & _has_mass(batch, t2d)
    return torch.stack([_step_mask(mask, k).sum() for k in range(num_steps)]).double()


def _unroll_step(draft: Eagle3Draft, ids, hidden, positions, cache: list, valid, target, mask):
    """One unroll step and its loss: (hidden out, this step's (k, v) per layer, cross-entropy sum, top-1 hits).
    `cache` is copied, so that a recomputation in the backward (checkpointing) sees the same earlier steps."""
    layer_caches = [list(layer_cache) for layer_cache in cache]
    hidden = draft.step(ids, hidden, positions, layer_caches, valid)
    span = mask.shape[1]
    logits = draft.logits(hidden)[:, :span].float()
    m = mask.float()
    ce = -(target * torch.log_softmax(logits, -1)).sum(-1)
    with torch.no_grad():
        hits = ((logits.argmax(-1) == target.argmax(-1)).float() * m).sum()
    return hidden, [layer_cache[-1] for layer_cache in layer_caches], (ce * m).sum(), hits


def _input_dtype(device: torch.device) -> torch.dtype:
    """The aux input's dtype: autocast's (fc runs in it anyway, so no fp32 copy is made) or fp32."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32


def ttt_loss(
    draft: Eagle3Draft,
    batch: dict,
    target_lm_head: torch.Tensor,
    num_steps: int,
    decay: float,
    *,
    token_norm: torch.Tensor | None = None,
    checkpointing: bool = False,
):
    """Soft cross-entropy against the target's distribution over the draft vocab (teacher_probs), per TTT step.

    batch: input_ids [B,L], loss_mask [B,L], aux_hidden [B,L,nH], valid [B,L], and last_hidden [B,L,H] or
    topk_ids + topk_logprobs [B,L,K].
    target_lm_head: the target's lm_head rows for the draft vocab [Vd, H].
    token_norm: step k's loss is divided by token_norm[k] (clamped to >= 1); None: by this batch's own count.
    Returns (total = sum_k decay^k loss_k, per-step mean losses of this batch, per-step top-1 accuracies, per-step
    token counts); the means and accuracies are over this batch's own tokens.
    """
    ids, valid = batch["input_ids"], batch["valid"]
    target_p, has_mass = teacher_probs(batch, target_lm_head, draft.t2d)  # [B,L,Vd], [B,L]
    mask = batch["loss_mask"].bool() & has_mass & valid
    tlen = ids.shape[1] - 1
    hidden = draft.project(batch["aux_hidden"][:, :tlen].to(_input_dtype(ids.device)))
    cache = draft.new_cache()
    total = torch.zeros((), device=ids.device)
    losses, accs, counts = [], [], []
    for k in range(num_steps):
        step_ids, positions = unroll_inputs(ids, k)
        m = _step_mask(mask, k)
        earlier = [list(layer_cache) for layer_cache in cache]  # this step's view, also when recomputed later
        args = (draft, step_ids, hidden, positions, earlier, valid[:, :tlen], target_p[:, k + 1 : k + 1 + m.shape[1]], m)
        if checkpointing and torch.is_grad_enabled():
            hidden, new_kv, ce_sum, hits = checkpoint(_unroll_step, *args, use_reentrant=False)
        else:
            hidden, new_kv, ce_sum, hits = _unroll_step(*args)
        for layer_cache, kv in zip(cache, new_kv, strict=True):
            layer_cache.append(kv)
        n = m.sum().float()
        norm = (n if token_norm is None else token_norm[k].to(n)).clamp(min=1.0)
        total = total + (decay**k) * (ce_sum / norm)
        losses.append((ce_sum / n.clamp(min=1.0)).detach())
        accs.append(hits / n.clamp(min=1.0))
        counts.append(n)
    return total, losses, accs, counts
