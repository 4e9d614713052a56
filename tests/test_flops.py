"""eyas.train.flops: the FLOPs of a training token, counted by hand for a small draft, and at the Kimi-K2.5 draft's
shape (the figure MFU is computed with)."""

from __future__ import annotations

import pytest

from eyas.draft import DraftArch
from eyas.train.flops import forward_flops_per_token, train_flops_per_token

KIMI = DraftArch(hidden_size=7168, num_aux=3, target_vocab_size=163840, draft_vocab_size=32000,
                 num_attention_heads=64, num_key_value_heads=64, head_dim=128, intermediate_size=18432)  # fmt: skip


def test_a_small_drafts_flops_counted_by_hand():
    arch = DraftArch(hidden_size=4, num_aux=3, target_vocab_size=10, draft_vocab_size=5, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=2, intermediate_size=6)  # fmt: skip
    parts = forward_flops_per_token(arch, num_ttt_steps=2, mean_length=9)
    # fc 12 -> 4; per step: q/k/v 8 -> 4 + 2 + 2, o 4 -> 4, MLP 3 x 4 <-> 6, lm_head 4 -> 5; attention over 5 keys
    assert parts == {"fc": 96, "layers": 2 * (128 + 32 + 144), "lm_head": 80, "attention": 2 * 2 * 2 * 4 * 5,
                     "teacher": 40}  # fmt: skip
    assert train_flops_per_token(arch, 2, 9) == 3 * (96 + 608 + 80 + 160) + 40


def test_the_kimi_draft_trains_at_about_46_gflop_a_token():
    """7 unroll steps of 2.07 GFLOP of matrix products each at 4K tokens, fc and the teacher: about 46 GFLOP."""
    assert train_flops_per_token(KIMI, 7, 4096) == pytest.approx(46.3e9, rel=0.01)
    assert forward_flops_per_token(KIMI, 7, 4096)["layers"] / 7 == pytest.approx(1.615e9, rel=0.01)
