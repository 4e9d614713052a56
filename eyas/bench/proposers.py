"""Drafters for the reference engine, behind one interface: the trained draft and the n-gram baseline.

    reference_decode(model, DraftProposer(draft), prompt_ids, aux_layer_ids=ids, steps=3, ...)
    reference_decode(model, NgramProposer(max_n=3), prompt_ids, aux_layer_ids=ids, steps=3, ...)

`DraftProposer` drafts with an Eagle3Draft, chain (topk 1) and tree (topk > 1). Alignment is exactly
`Eagle3Draft.unroll`'s: step 0 runs over the pairs (f_t, x_{t+1}) for t = 0..m-1 at positions t; step
k >= 1 runs over the same indices at positions t + k, continuing the same attention cache, with the
drafted token at the last index (other indices carry unroll's tokens and cannot influence the last
index: step k attends to step-0 keys causally and to steps 1..k at its own index). A tree node at
depth d is the chain forced along its ancestors' tokens.

`NgramProposer` (prompt-lookup decoding, the baseline every trained draft must beat) looks for the most
recent earlier occurrence of the sequence's last n tokens (n = max_n down to 1) and proposes the tokens
that followed it; without a match it repeats the last token. It needs no model and ignores the target's
hidden states.
"""

from __future__ import annotations

from typing import Protocol

import torch

from eyas.draft import Eagle3Draft

Node = tuple[int, int]  # (target token id, index of the parent node; -1 = the root)


class Proposer(Protocol):
    def propose(self, seq: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        """`steps` drafted target ids following seq = x_0..x_m, given aux [m, n_aux*H] = f_0..f_{m-1}."""


class TreeProposer(Proposer, Protocol):
    def propose_tree(self, seq: list[int], aux: torch.Tensor, steps: int, topk: int, num_nodes: int) -> list[Node]:
        """At most num_nodes drafted nodes of depth <= steps, each parent listed before its children."""


class DraftProposer:
    """Chain and tree proposals of an Eagle3Draft (target ids, mapped through d2t)."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft

    def _step0(self, seq: list[int], aux: torch.Tensor):
        draft, m = self.draft, len(seq) - 1
        if aux.shape[0] != m:
            raise ValueError(f"draft input: {aux.shape[0]} aux feature rows for {len(seq)} tokens, expected {m}")
        hidden = draft.project(aux[None].to(draft.fc.weight))
        cache = draft.new_cache()
        device = hidden.device
        ids = torch.tensor([seq[1:]], dtype=torch.int64, device=device)
        hidden = draft.step(ids, hidden, torch.arange(m, device=device)[None], cache)
        return hidden, cache

    def _advance(self, seq: list[int], hidden, cache: list, k: int, token: int) -> torch.Tensor:
        """Step k >= 1 with `token` at the last index; returns its hidden [1, m, H] (cache grows)."""
        m, device = len(seq) - 1, hidden.device
        ids = torch.zeros(1, m, dtype=torch.int64, device=device)
        n = max(m - k, 0)
        ids[0, :n] = torch.tensor(seq[k + 1 : k + 1 + n], dtype=torch.int64, device=device)
        ids[0, m - 1] = token
        return self.draft.step(ids, hidden, torch.arange(m, device=device)[None] + k, cache)

    def _path_logits(self, seq: list[int], hidden, cache: list, path: list[int]) -> torch.Tensor:
        """Draft logits [Vd] at the last index after forcing `path` as steps 1..len(path)."""
        cache = [list(layer_cache) for layer_cache in cache]
        for k, token in enumerate(path, start=1):
            hidden = self._advance(seq, hidden, cache, k, token)
        return self.draft.logits(hidden[0, -1])

    @torch.no_grad()
    def chain(self, seq: list[int], aux: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """(drafted target ids, draft logits [Vd] of each step at the last index)."""
        hidden, cache = self._step0(seq, aux)
        tokens, logits = [], []
        for k in range(steps):
            if k:
                hidden = self._advance(seq, hidden, cache, k, tokens[-1])
            lg = self.draft.logits(hidden[0, -1])
            tokens.append(int(self.draft.to_target_ids(lg.argmax(-1))))
            logits.append(lg)
        return tokens, logits

    def propose(self, seq: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        return self.chain(seq, aux, steps)[0]

    @torch.no_grad()
    def propose_tree(self, seq: list[int], aux: torch.Tensor, steps: int, topk: int, num_nodes: int) -> list[Node]:
        """EAGLE-2/3 tree: each depth expands the topk best frontier nodes by their topk children (score =
        summed log-probabilities); the num_nodes best of all candidates form the tree (parents kept first)."""
        hidden0, cache0 = self._step0(seq, aux)
        frontier = [(0.0, [], -1)]  # (score, path of target ids, candidate index)
        candidates: list[tuple[float, int, int, int]] = []  # (score, depth, token, parent candidate)
        for depth in range(steps):
            expanded = []
            for score, path, index in frontier:
                lg = self._path_logits(seq, hidden0, cache0, path)
                logp = torch.log_softmax(lg.double(), -1)
                top = logp.topk(min(topk, logp.numel()))
                for lp, d in zip(top.values.tolist(), top.indices.tolist()):
                    token = int(self.draft.to_target_ids(torch.tensor(d, device=lg.device)))
                    candidates.append((score + lp, depth, token, index))
                    expanded.append((score + lp, path + [token], len(candidates) - 1))
            frontier = sorted(expanded, key=lambda e: -e[0])[:topk]
        return select_tree(candidates, num_nodes)


def select_tree(candidates: list[tuple[float, int, int, int]], num_nodes: int) -> list[Node]:
    """The num_nodes best-scoring candidates whose ancestors are all chosen, as (token, parent) in order."""
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][0], candidates[i][1], i))
    chosen: dict[int, int] = {}  # candidate index -> node index
    nodes: list[Node] = []
    while len(nodes) < num_nodes:
        added = False
        for i in order:
            parent = candidates[i][3]
            if i in chosen or (parent != -1 and parent not in chosen):
                continue
            chosen[i] = len(nodes)
            nodes.append((candidates[i][2], -1 if parent == -1 else chosen[parent]))
            added = True
            break
        if not added:
            break
    return nodes


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
