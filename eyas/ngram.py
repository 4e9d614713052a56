"""Prompt-lookup (n-gram) drafting: the baseline every trained draft must beat.

    from eyas.ngram import NgramProposer
    reference_decode(model, NgramProposer(max_n=3), prompt_ids, aux_layer_ids=ids, steps=3, ...)

The proposer looks for the most recent earlier occurrence of the sequence's last n tokens
(n = max_n down to 1) and proposes the tokens that followed it; without a match it repeats the
last token. It needs no model and ignores the target's hidden states.
"""

from __future__ import annotations

import torch


class NgramProposer:
    """Chain proposals copied from the sequence itself (prompt lookup decoding)."""

    def __init__(self, max_n: int = 3):
        if max_n < 1:
            raise ValueError(f"NgramProposer: max_n={max_n}, expected >= 1")
        self.max_n = max_n

    def propose(self, seq: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == tail:
                    follow = seq[start + n : start + n + steps]
                    return follow + [follow[-1]] * (steps - len(follow))
        return [seq[-1]] * steps
