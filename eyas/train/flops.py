"""Floating-point operations of training a draft, per token: what turns tokens/s into model FLOP utilization, and
what the smoke run's cost is checked with before it runs on a CPU.

    flops = train_flops_per_token(arch, num_ttt_steps=7, mean_length=2048)    # about 46e9 at the Kimi shape

Counted as 2 FLOPs per multiply-add of every matrix product: fc once; per unroll step every layer's q/k/v
projections (from 2H wide in the first layer, H in later ones), o_proj, the MLP's three products and the lm_head
over the draft vocab, and causal attention (QK and PV over (T + 1) / 2 keys on average); the teacher's head
product once (no backward). Training is three times the forward of everything trained (the backward computes the
gradients of inputs and weights); norms, rotary embeddings, softmax and the merge of the unroll steps' own keys
are left out (under 1 %).
"""

from __future__ import annotations

from eyas.draft import DraftArch


def forward_flops_per_token(arch: DraftArch, num_ttt_steps: int, mean_length: float) -> dict[str, float]:
    """The forward's FLOPs per token: fc, the unroll steps' layers, lm_head and attention, and the teacher."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    first_in, later_in = 2 * h, h
    projections = sum(2 * width * (q + 2 * kv) for width in [first_in] + [later_in] * (arch.num_layers - 1))
    layers = projections + arch.num_layers * (2 * q * h + 3 * 2 * h * arch.intermediate_size)
    attention = arch.num_layers * 2 * 2 * q * (mean_length + 1) / 2
    return {
        "fc": 2 * arch.num_aux * h * h,
        "layers": num_ttt_steps * layers,
        "lm_head": num_ttt_steps * 2 * h * arch.draft_vocab_size,
        "attention": num_ttt_steps * attention,
        "teacher": 2 * h * arch.draft_vocab_size,
    }


def train_flops_per_token(arch: DraftArch, num_ttt_steps: int, mean_length: float) -> float:
    """FLOPs of one training token: three forwards of what is trained, one of the teacher."""
    parts = forward_flops_per_token(arch, num_ttt_steps, mean_length)
    return 3 * (parts["fc"] + parts["layers"] + parts["lm_head"] + parts["attention"]) + parts["teacher"]


def matmul_flops_per_s(device=None, size: int = 1024, repeats: int = 3) -> float:
    """The best rate of a size^3 fp32 matrix product on `device` (default CPU), in FLOP/s: what one process of
    this host computes at best."""
    import time

    import torch

    a = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms the library up
        start = time.perf_counter()
        torch.mm(a, a)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
