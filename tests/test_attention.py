"""The training attention (eyas.attention): the fused and blockwise paths against the eager [T, T] reference, in
fp32, through the draft's whole TTT loss (forward and every gradient), for every draft variant, a 2-layer stack,
padded batches and grouped-query heads; activation checkpointing gives the same gradients; and the memory a
training step keeps grows linearly in the sample length where the eager one grows quadratically."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from draft_fixtures import ARCH, vocab_mapping
from run_fixtures import peak_memory_case

from eyas.attention import causal_attention, ttt_attention
from eyas.draft import build_draft
from eyas.objective import ttt_loss

TOLERANCE = 1e-5
VARIANTS = {
    "eagle3": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_before_residual": {"norm_before_residual": True},
    "2-layer stack": {"num_layers": 2},
}
LENGTHS = [40, 33, 12]  # right-padded to 40


def padded_batch(arch, lengths=LENGTHS, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    valid = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
    return {
        "input_ids": torch.randint(0, arch.target_vocab_size, (len(lengths), width), generator=g) * valid,
        "loss_mask": valid.to(torch.uint8),
        "valid": valid,
        "aux_hidden": torch.randn(len(lengths), width, arch.num_aux * arch.hidden_size, generator=g) * valid[..., None],
        "last_hidden": torch.randn(len(lengths), width, arch.hidden_size, generator=g) * valid[..., None],
    }


def loss_and_grads(draft, batch, impl: str, *, checkpointing: bool = False, steps: int = 5):
    draft = copy.deepcopy(draft)
    draft.set_attention(impl)
    g = torch.Generator().manual_seed(1)
    head = torch.randn(draft.arch.draft_vocab_size, draft.arch.hidden_size, generator=g).to(batch["input_ids"].device)
    total, losses, _, _ = ttt_loss(draft, batch, head, steps, 0.8, checkpointing=checkpointing)
    total.backward()
    grads = {n: p.grad for n, p in draft.named_parameters() if p.requires_grad}
    return total.detach(), torch.stack(losses), grads


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach().clamp_min(1e-12))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("impl", ["fused", "blockwise"])
def test_the_training_attention_equals_the_eager_one_in_loss_and_every_gradient(variant, impl):
    arch = replace(ARCH, **VARIANTS[variant])  # 4 query heads over 2 key/value heads
    d2t, t2d = vocab_mapping(arch)
    draft = build_draft(arch, torch.randn(arch.target_vocab_size, arch.hidden_size), d2t, t2d)
    batch = padded_batch(arch)
    eager_total, eager_losses, eager_grads = loss_and_grads(draft, batch, "eager")
    total, losses, grads = loss_and_grads(draft, batch, impl)
    assert relative_error(losses, eager_losses) < TOLERANCE
    assert relative_error(total, eager_total) < TOLERANCE
    assert grads.keys() == eager_grads.keys()
    worst = max(grads, key=lambda n: relative_error(grads[n], eager_grads[n]))
    assert relative_error(grads[worst], eager_grads[worst]) < TOLERANCE, worst


def test_causal_attention_returns_the_log_sum_exp_and_its_gradient():
    """The fused kernel's (out, lse) and their gradients, the lse's included (the merge's D-trick), against autograd
    through the materialized softmax; 4 query heads over 2 key/value heads."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 37, 16, generator=g, requires_grad=True) for _ in range(2))
    scale = 0.25
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf"))
    ref_out, ref_lse = torch.softmax(scores, -1) @ v.repeat_interleave(2, 1), torch.logsumexp(scores, -1)
    grad_out, grad_lse = torch.randn(ref_out.shape, generator=g), torch.randn(ref_lse.shape, generator=g)
    ref = torch.autograd.grad((ref_out * grad_out).sum() + (ref_lse * grad_lse).sum(), (q, k, v))
    for impl in ("fused", "blockwise"):
        out, lse = causal_attention(q, k, v, scale, impl)
        got = torch.autograd.grad((out * grad_out).sum() + (lse * grad_lse).sum(), (q, k, v))
        assert relative_error(out, ref_out) < TOLERANCE and relative_error(lse, ref_lse) < TOLERANCE, impl
        for name, a, b in zip("qkv", got, ref):
            assert relative_error(a, b) < TOLERANCE, (impl, name)


def test_an_unknown_attention_implementation_is_refused():
    d2t, t2d = vocab_mapping(ARCH)
    draft = build_draft(ARCH, torch.randn(ARCH.target_vocab_size, ARCH.hidden_size), d2t, t2d)
    with pytest.raises(ValueError, match=r"draft attention 'flash': expected one of \('fused', 'blockwise', 'eager'\)"):
        draft.set_attention("flash")
    with pytest.raises(ValueError, match="attention implementation 'sdpa'"):
        ttt_attention(torch.zeros(1, 1, 2, 8), [(torch.zeros(1, 1, 2, 8),) * 2], 1.0, None, "sdpa")


@pytest.mark.parametrize("impl", ["fused", "eager"])
def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit(impl):
    arch = replace(ARCH, num_layers=2, fc_norm=True, norm_output=True)
    d2t, t2d = vocab_mapping(arch)
    draft = build_draft(arch, torch.randn(arch.target_vocab_size, arch.hidden_size), d2t, t2d)
    batch = padded_batch(arch)
    total, _, grads = loss_and_grads(draft, batch, impl)
    total_ckpt, _, grads_ckpt = loss_and_grads(draft, batch, impl, checkpointing=True)
    assert torch.equal(total, total_ckpt)
    assert [n for n in grads if not torch.equal(grads[n], grads_ckpt[n])] == []


def activation_peak(case: dict) -> int:
    """The peak of a training step above the state it starts from (eyas.train.peak_memory, a process of its own)."""
    result = peak_memory_case(case)
    return result["measured_bytes"] - result["step_start_bytes"]


def test_a_training_steps_memory_grows_linearly_in_the_sample_length_and_the_eager_ones_does_not():
    """One sample of T = 256, 512, 1024 tokens (4 heads of 64, 2 unroll steps): what a doubling of T adds to a
    step's peak doubles at most 2.2x with the fused attention (linear in T, whatever the constant part), and about
    4x with the eager one (quadratic)."""
    shape = {
        "hidden_size": 256,
        "num_aux": 3,
        "target_vocab_size": 512,
        "draft_vocab_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 512,
        "num_ttt_steps": 2,
        "parallelism": "none",
    }
    growth = {}
    for impl in ("fused", "eager"):
        a, b, c = (activation_peak({**shape, "attention": impl, "lengths": [t]}) for t in (256, 512, 1024))
        growth[impl] = (c - b) / (b - a)
    assert growth["fused"] <= 2.2, growth
    assert growth["eager"] >= 2.6, growth


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_causal_attention_on_cuda_matches_the_float64_softmax(dtype, tolerance):
    """CUDA: FlashAttention-2 in bf16 (with the D-trick's padded backward), the blockwise path in fp32; out, lse
    and the gradients of q, k, v against a float64 materialized softmax."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (2, 8, 300, 128), (2, 4, 300, 128)
    q = torch.randn(shape_q, generator=g, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(shape_kv, generator=g, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    scale = 128**-0.5
    scores = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(300, 300, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref_out, ref_lse = torch.softmax(scores, -1) @ v64.repeat_interleave(2, 1), torch.logsumexp(scores, -1)
    grad_out = torch.randn(ref_out.shape, generator=g, device="cuda", dtype=torch.float64)
    grad_lse = torch.randn(ref_lse.shape, generator=g, device="cuda", dtype=torch.float64)
    ref = torch.autograd.grad((ref_out * grad_out).sum() + (ref_lse * grad_lse).sum(), (q64, k64, v64))
    out, lse = causal_attention(q, k, v, scale)
    got = torch.autograd.grad((out.double() * grad_out).sum() + (lse.double() * grad_lse).sum(), (q, k, v))
    assert relative_error(out.double(), ref_out) < tolerance and relative_error(lse.double(), ref_lse) < tolerance
    for name, a, b in zip("qkv", got, ref):
        assert relative_error(a.double(), b) < tolerance, name


@pytest.mark.gpu
def test_the_bf16_training_loss_on_cuda_follows_the_fp32_one():
    """The whole TTT loss and its gradients under bf16 autocast (fused attention) against fp32 (eager) on CUDA."""
    arch = replace(ARCH, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    d2t, t2d = vocab_mapping(arch)
    draft = build_draft(arch, torch.randn(arch.target_vocab_size, arch.hidden_size), d2t, t2d).cuda()
    batch = {k: v.cuda() for k, v in padded_batch(arch).items()}
    eager_total, _, eager_grads = loss_and_grads(draft, batch, "eager")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        total, _, grads = loss_and_grads(draft, batch, "fused")
    assert relative_error(total, eager_total) < 2e-2
    worst = max(grads, key=lambda n: relative_error(grads[n], eager_grads[n]))
    assert relative_error(grads[worst], eager_grads[worst]) < 1e-1, worst
