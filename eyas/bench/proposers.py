"""Drafters for the reference engine, behind one interface: the trained draft and the n-gram baseline.

    reference_decode(model, DraftProposer(draft), prompt_ids, aux_layer_ids=ids, steps=3, ...)
    reference_decode(model, NgramProposer(max_n=3), prompt_ids, aux_layer_ids=ids, steps=3, ...)

`DraftProposer` drafts with an Eagle3Draft, chain (topk 1) and tree (topk > 1). Alignment is exactly
`Eagle3Draft.unroll`'s: step 0 runs over the pairs (f_t, x_{t+1}) for t = 0..m-1 at positions t; step
k >= 1 runs at the last index m-1 at position m-1+k with the token drafted by step k-1, its hidden input being
step k-1's output at that index. Step k attends to step-0 keys causally and to steps 1..k at its own index, so
nothing at another index can influence the last one. A tree node at depth d is the chain forced along its
ancestors' tokens.

With `cache=True` (the default) the proposer keeps a DraftKVCache (eyas.draft) across rounds, in which slot =
position: slots 0..m-1 hold the step-0 keys and values of the verified indices and the drafted steps k >= 1 at
the last index fill slots m..m+k-1 (position m-1+k), i.e. exactly the keys step k attends to. A round
- reuses the step-0 slots of the longest prefix whose tokens x_0..x_{t+1} and aux rows f_0..f_t equal those they
  were computed from (the rows are compared with a copy the proposer keeps), but never the last index m-1;
- crops the cache to that prefix (the drafted slots of the last round go, as TargetSession drops rejected
  tokens), projects only the new aux rows and runs step 0 over the new indices in one causal chunk;
- runs each step k >= 1 on one token at the last index.
In a decoding loop the reused prefix is everything but the newly verified tokens, so a round costs the new
indices plus `steps` - 1 single-token steps (a tree: one single-token step per node of each forced path),
instead of steps x m positions. `cache=False` recomputes every step over all m indices, as `unroll` does (the
definition the cached path is tested against). Their logits differ only in float rounding (attention summed in
another order), so both draft the same tokens unless two draft logits tie to within that rounding.

`NgramProposer` (prompt-lookup decoding, the baseline every trained draft must beat) looks for the most
recent earlier occurrence of the sequence's last n tokens (n = max_n down to 1) and proposes the tokens
that followed it; without a match it repeats the last token. It needs no model and ignores the target's
hidden states.
"""

from __future__ import annotations

from typing import Protocol

import torch

from eyas.draft import DraftKVCache, Eagle3Draft

Node = tuple[int, int]  # (target token id, index of the parent node; -1 = the root)


class Proposer(Protocol):
    def propose(self, seq: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        """`steps` drafted target ids following seq = x_0..x_m, given aux [m, n_aux*H] = f_0..f_{m-1}."""


class TreeProposer(Proposer, Protocol):
    def propose_tree(self, seq: list[int], aux: torch.Tensor, steps: int, topk: int, num_nodes: int) -> list[Node]:
        """At most num_nodes drafted nodes of depth <= steps, each parent listed before its children."""


class RecomputedSteps:
    """Draft steps as `Eagle3Draft.unroll` runs them: every step over all m indices, nothing kept between rounds."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.seq: list[int] = []
        self.cache0: list[list] = []  # per decoder layer: [step-0 (k, v)]
        self.cache: list[list] = []  # per decoder layer: step 0 and the steps of the current path

    def start(self, seq: list[int], aux: torch.Tensor) -> torch.Tensor:
        """Step 0 over all m indices; its hidden [1, m, H]."""
        draft, m = self.draft, len(seq) - 1
        hidden = draft.project(aux[None].to(draft.fc.weight))
        self.seq, self.cache0 = seq, draft.new_cache()
        ids = torch.tensor([seq[1:]], dtype=torch.int64, device=hidden.device)
        hidden = draft.step(ids, hidden, torch.arange(m, device=hidden.device)[None], self.cache0)
        self.rewind()
        return hidden

    def rewind(self) -> None:
        """Back to just after step 0 (the start of another path of a tree)."""
        self.cache = [list(layer_cache) for layer_cache in self.cache0]

    def advance(self, hidden: torch.Tensor, k: int, token: int) -> torch.Tensor:
        """Step k >= 1 with `token` at the last index (unroll's tokens elsewhere); its hidden [1, m, H]."""
        seq, m, device = self.seq, len(self.seq) - 1, hidden.device
        ids = torch.zeros(1, m, dtype=torch.int64, device=device)
        n = max(m - k, 0)
        ids[0, :n] = torch.tensor(seq[k + 1 : k + 1 + n], dtype=torch.int64, device=device)
        ids[0, m - 1] = token
        return self.draft.step(ids, hidden, torch.arange(m, device=device)[None] + k, self.cache)


class CachedSteps:
    """Draft steps through a DraftKVCache kept across rounds (module docstring): step 0 only at the indices not
    already in the cache, each later step at the last index only."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.kv: DraftKVCache | None = None
        self.seq: list[int] = []  # x_0..x_n of the n step-0 slots
        self.aux: torch.Tensor | None = None  # rows 0..n-1: the f_0..f_{n-1} those slots were computed from
        self.m = 0  # step-0 slots of the current round

    def reusable(self, seq: list[int], aux: torch.Tensor) -> int:
        """How many leading step-0 slots hold step 0 of (seq, aux): at most all but the last index."""
        n = min(len(self.seq), len(seq)) - 1
        if n > 0 and seq[: n + 1] != self.seq[: n + 1]:
            n = next(i for i, (a, b) in enumerate(zip(seq, self.seq)) if a != b) - 1
        n = min(n, len(seq) - 2)
        if n > 0 and not torch.equal(aux[:n], self.aux[:n]):
            n = int((aux[:n] != self.aux[:n]).any(-1).nonzero()[0])
        return max(n, 0)

    def start(self, seq: list[int], aux: torch.Tensor) -> torch.Tensor:
        """Step 0 at the indices after the reusable prefix (one causal chunk); its hidden at the last index [1, 1, H]."""
        draft, m = self.draft, len(seq) - 1
        if self.kv is None:
            self.kv = DraftKVCache(draft, capacity=max(256, 2 * m))
        n = self.reusable(seq, aux)
        self.kv.crop(n)
        rows = aux[n:]
        ids = torch.tensor([seq[n + 1 :]], dtype=torch.int64, device=self.kv.weight.device)
        hidden = draft.decode(ids, draft.project(rows[None].to(draft.fc.weight)), self.kv)
        if self.aux is None or self.aux.shape[0] < m:
            grown = rows.new_empty(max(256, 2 * m), rows.shape[1])
            if self.aux is not None:
                grown[:n] = self.aux[:n]
            self.aux = grown
        self.aux[n:m] = rows
        self.seq, self.m = list(seq), m
        return hidden[:, -1:]

    def rewind(self) -> None:
        """Back to just after step 0: the drafted slots are dropped."""
        self.kv.crop(self.m)

    def advance(self, hidden: torch.Tensor, k: int, token: int) -> torch.Tensor:
        """Step k >= 1 with `token` at the last index: slot m-1+k of the cache; its hidden [1, 1, H]."""
        if self.kv.length != self.m + k - 1:
            raise ValueError(
                f"draft cache: step {k} would fill slot {self.kv.length}, expected slot {self.m + k - 1} (m = {self.m}); "
                "call start() each round, then advance steps 1, 2, ... in order, rewind() before each tree path"
            )
        ids = torch.tensor([[token]], dtype=torch.int64, device=hidden.device)
        return self.draft.decode(ids, hidden, self.kv)


class DraftProposer:
    """Chain and tree proposals of an Eagle3Draft (target ids, mapped through d2t); `cache` keeps the draft's
    keys and values across rounds (CachedSteps), else every round recomputes (RecomputedSteps)."""

    def __init__(self, draft: Eagle3Draft, *, cache: bool = True):
        self.draft, self.cache = draft, cache
        self.steps = CachedSteps(draft) if cache else RecomputedSteps(draft)

    def _start(self, seq: list[int], aux: torch.Tensor) -> torch.Tensor:
        if aux.shape[0] != len(seq) - 1:
            raise ValueError(
                f"draft input: {aux.shape[0]} aux feature rows for {len(seq)} tokens, expected {len(seq) - 1}"
            )
        return self.steps.start(seq, aux)

    def _path_logits(self, hidden: torch.Tensor, path: list[int]) -> torch.Tensor:
        """Draft logits [Vd] at the last index after forcing `path` as steps 1..len(path)."""
        self.steps.rewind()
        for k, token in enumerate(path, start=1):
            hidden = self.steps.advance(hidden, k, token)
        return self.draft.logits(hidden[0, -1])

    @torch.no_grad()
    def chain(self, seq: list[int], aux: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """(drafted target ids, draft logits [Vd] of each step at the last index)."""
        hidden = self._start(seq, aux)
        tokens, logits = [], []
        for k in range(steps):
            if k:
                hidden = self.steps.advance(hidden, k, tokens[-1])
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
        hidden0 = self._start(seq, aux)
        frontier = [(0.0, [], -1)]  # (score, path of target ids, candidate index)
        candidates: list[tuple[float, int, int, int]] = []  # (score, depth, token, parent candidate)
        for depth in range(steps):
            expanded = []
            for score, path, index in frontier:
                lg = self._path_logits(hidden0, path)
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
