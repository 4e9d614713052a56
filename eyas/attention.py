"""The draft's training attention over a TTT unroll, in memory linear in the sample length.

Unroll step k at index t attends to the step-0 keys causally (indices <= t) and to the keys of steps 1..k at its
own index only (eyas.draft). `ttt_attention` computes that without ever forming a [T, T] matrix:

    o0, lse0 = causal attention of the step's queries over the step-0 keys      (a fused kernel, below)
    s_j      = scale * q . k_j  at the query's own index, j = 1..k                ([B, h, T] each)
    L        = logsumexp(lse0, s_1, ..., s_k)
    out      = exp(lse0 - L) * o0 + sum_j exp(s_j - L) * v_j

which is exactly the softmax over the concatenation of both key sets. The fused kernels are PyTorch's own
scaled-dot-product-attention kernels, called at the level that returns the log-sum-exp:

    cpu                 aten._scaled_dot_product_flash_attention_for_cpu   (any dtype, grouped-query heads)
    cuda, bf16 / fp16   aten._scaled_dot_product_flash_attention           (FlashAttention-2)
    cuda, fp32          "blockwise": query blocks of BLOCK_ROWS rows, each recomputed in the backward

Their backward kernels take the gradient of the output only; the gradient that reaches lse0 through the merge
is folded in exactly: a flash backward computes dS = P * (dP - D) with D_i = sum_d dO_id * O_id, and the
log-sum-exp's own gradient g adds P * g. Padding the head dimension with one extra column where O holds -g and
dO holds 1 (q, k and v hold 0 there, so the scores and dP are unchanged) makes D' = D - g.

Padding tokens: a batch is right-padded (eyas.train.data.collate), so causal attention never lets a real token
see a padding key, and the padded positions carry no loss. The fused path therefore needs no mask; the eager
reference (`impl="eager"`, today's materialized softmax, kept for tests and benchmarks) masks padding keys too,
which changes only the padded positions' outputs.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

IMPLEMENTATIONS = ("fused", "blockwise", "eager")
BLOCK_ROWS = 512  # query rows per block of the blockwise path: [B, h, 512, T] scores at a time
aten = torch.ops.aten


def _pad_head(x: torch.Tensor, column: torch.Tensor | None = None, width: int = 1) -> torch.Tensor:
    """x [..., d] with `width` more columns: `column` [...] in the first of them (zeros without), zeros after."""
    extra = x.new_zeros((*x.shape[:-1], width))
    if column is not None:
        extra[..., 0] = column.to(x.dtype)
    return torch.cat([x, extra], dim=-1)


class _FusedCausalAttention(torch.autograd.Function):
    """(out, lse) of causal attention through PyTorch's flash kernels; differentiable in both outputs."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        if q.is_cuda:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale
            )
            ctx.cuda_args = (cum_q, cum_k, max_q, max_k, seed, offset)
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        d = q.shape[-1]
        if grad_lse is not None:  # the D-trick of the module docstring
            width = 8 if q.is_cuda else 1  # flash on CUDA needs head dims in multiples of 8
            ones = grad_out.new_ones(grad_out.shape[:-1])
            q, k, v = (_pad_head(x, width=width) for x in (q, k, v))
            out, grad_out = _pad_head(out, -grad_lse, width), _pad_head(grad_out, ones, width)
        grad_out = grad_out.contiguous()
        if q.is_cuda:
            cum_q, cum_k, max_q, max_k, seed, offset = ctx.cuda_args
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=ctx.scale
            )
        else:
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, True, scale=ctx.scale
            )
        return dq[..., :d], dk[..., :d], dv[..., :d], None


def _block(q_blk: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float):
    """Causal attention of query rows start.. (q_blk [B, h, n, d]) over keys 0..start+n-1: (out, lse)."""
    n, rep = q_blk.shape[2], q_blk.shape[1] // k.shape[1]
    keys = k[:, :, : start + n].repeat_interleave(rep, dim=1)
    values = v[:, :, : start + n].repeat_interleave(rep, dim=1)
    scores = (q_blk.float() @ keys.float().transpose(-1, -2)) * scale
    rows = torch.arange(start, start + n, device=q_blk.device)[:, None]
    scores = scores.masked_fill(torch.arange(start + n, device=q_blk.device) > rows, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]) @ values.float()
    return out.to(q_blk.dtype), lse


def _blockwise_causal_attention(q, k, v, scale: float):
    """(out, lse) of causal attention, BLOCK_ROWS query rows at a time, each block recomputed in the backward:
    at most one block's [n, T] scores exist at once, and nothing of size T x T is kept for the backward."""
    outs, lses = [], []
    for start in range(0, q.shape[2], BLOCK_ROWS):
        q_blk = q[:, :, start : start + BLOCK_ROWS]
        if torch.is_grad_enabled():
            out, lse = checkpoint(_block, q_blk, k, v, start, scale, use_reentrant=False)
        else:
            out, lse = _block(q_blk, k, v, start, scale)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def causal_attention(q, k, v, scale: float, impl: str = "fused") -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, h, T, d], lse [B, h, T] fp32) of causal attention; k, v may have fewer (grouped) heads."""
    if impl == "fused" and (not q.is_cuda or q.dtype in (torch.float16, torch.bfloat16)):
        return _FusedCausalAttention.apply(q, k, v, scale)
    return _blockwise_causal_attention(q, k, v, scale)


def _grouped(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, h, T, d] viewed as [B, kv_heads, h // kv_heads, T, d] (query heads grouped by their key head)."""
    b, h, t, d = x.shape
    return x.view(b, num_kv_heads, h // num_kv_heads, t, d)


def ttt_attention(q: torch.Tensor, cache: list, scale: float, valid: torch.Tensor | None, impl: str = "fused"):
    """Attention of one unroll step's queries q [B, h, T, d] over `cache` = [(k, v) of step 0, ..., of this step]
    ([B, kv_heads, T, d] each, rotary embedding applied to k): [B, h, T, d]. `valid` [B, T] marks real tokens
    (a prefix of each row); see the module docstring."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {impl!r}: expected one of {IMPLEMENTATIONS}")
    if impl == "eager":
        return eager_ttt_attention(q, cache, scale, valid)
    k0, v0 = cache[0]
    out0, lse0 = causal_attention(q, k0, v0, scale, impl)
    if len(cache) == 1:
        return out0
    kv_heads = k0.shape[1]
    qg = _grouped(q, kv_heads).float()
    diag = [(qg * kj.float()[:, :, None]).sum(-1).flatten(1, 2) * scale for kj, _ in cache[1:]]  # [B, h, T] each
    total = torch.logsumexp(torch.stack([lse0.float(), *diag]), dim=0)
    out = torch.exp(lse0.float() - total)[..., None] * out0.float()
    for s_j, (_, vj) in zip(diag, cache[1:]):
        weight = _grouped(torch.exp(s_j - total)[..., None], kv_heads)
        out = out + (weight * vj.float()[:, :, None]).flatten(1, 2)
    return out.to(q.dtype)


def eager_ttt_attention(q: torch.Tensor, cache: list, scale: float, valid: torch.Tensor | None) -> torch.Tensor:
    """The reference: the whole [T, T] score matrix with a dense causal mask (and padding keys masked), the
    diagonal terms concatenated, one softmax. Memory quadratic in T; for tests and benchmarks."""
    rep = q.shape[1] // cache[0][0].shape[1]
    k0, v0 = (t.repeat_interleave(rep, dim=1) for t in cache[0])
    tlen = q.shape[2]
    scores = q @ k0.transpose(-1, -2) * scale  # [B, h, T, T]
    mask = torch.ones(tlen, tlen, dtype=torch.bool, device=q.device).tril()
    if valid is not None:
        mask = mask & valid[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    diag = [(q * kj.repeat_interleave(rep, dim=1)).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    out = probs[..., :tlen] @ v0
    for j, (_, vj) in enumerate(cache[1:]):
        out = out + probs[..., tlen + j : tlen + j + 1] * vj.repeat_interleave(rep, dim=1)
    return out


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
