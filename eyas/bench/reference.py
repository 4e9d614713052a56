"""The reference engine: speculative decoding with the target through `hf`, greedy verification.

    from eyas.bench.reference import reference_decode, greedy_decode, load_target_float64
    model = load_target_float64("target/")
    r = reference_decode(model, draft, prompt_ids, aux_layer_ids=[2, 4, 5], steps=3,
                         max_new_tokens=64, eos_token_id=0)            # chain (topk 1)
    r = reference_decode(..., topk=4, num_draft_tokens=8)              # tree

The target runs in float64 with a KV cache over the verified prefix (`TargetSession`): plain
greedy decoding feeds one token per forward, a verification round feeds the pending token and the
drafted ones, then crops the cache back to what was accepted. The draft keeps its own KV cache
the same way (DraftProposer, `draft_cache=True`; eyas.bench.proposers says how), and the target's
aux rows of the accepted tokens are written into one buffer that the proposer sees a view of.
Float64 keeps greedy ties from flipping between the two; every benchmark still compares the
outputs token for token (`check_lossless`) and raises `LosslessError` on any difference.

Acceptance length tau = tokens emitted by verification rounds / number of rounds (accepted draft
tokens + the bonus token, after truncation at max_new_tokens or EOS). The first new token comes
from the prefill, not from a round, and is not counted. tau is 1.0 when nothing is accepted and at
most steps + 1. A tree is verified by walking it: from the root, the child equal to the target's
greedy token is accepted, and the target is run on (pending token + a root-to-leaf path) whenever
the accepted path leaves the path it last ran on; exact, never approximate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from eyas.bench.proposers import DraftProposer, Node
from eyas.draft import Eagle3Draft
from eyas.target import load_target_model, target_features


class LosslessError(AssertionError):
    """Speculative decoding produced a different sequence than plain greedy decoding."""


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens after the prompt; tokens[0] comes from the prefill
    steps: int
    accepted_per_step: list[int] = field(default_factory=list)  # draft tokens verification accepted, per round
    emitted_per_step: list[int] = field(default_factory=list)  # tokens each round emitted after truncation

    @property
    def num_verify_steps(self) -> int:
        return len(self.emitted_per_step)

    @property
    def tau(self) -> float | None:
        """Mean emitted tokens per verification round; None when no round ran."""
        return sum(self.emitted_per_step) / self.num_verify_steps if self.num_verify_steps else None


def check_float64(model: torch.nn.Module) -> None:
    dtype = next(model.parameters()).dtype
    if dtype != torch.float64:
        raise ValueError(
            f"target model: dtype {dtype}, expected torch.float64 so that greedy ties cannot flip between "
            "verification and plain decoding; load it with load_target_float64() or pass "
            "copy.deepcopy(model).to(torch.float64)"
        )


def load_target_float64(target_path: str | Path, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """The target model in float64, eval mode (no tokenizer needed); a wrapped target (Kimi-K2.5) as its text
    model, MoE experts run eagerly (eyas.target.load_target_model)."""
    return load_target_model(target_path, "float64", trust_remote_code=trust_remote_code)


def eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


class TargetSession:
    """The float64 target with a KV cache holding the first `length` tokens fed to it."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        check_float64(model)
        self.model, self.aux_layer_ids = model, list(aux_layer_ids)
        self.cache = DynamicCache(config=model.config)
        self.length = 0

    @torch.no_grad()
    def feed(self, tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Run `tokens` after the cached ones: (aux [n, n_aux*H] float32, greedy next token per position)."""
        out = self.model(
            input_ids=torch.tensor([tokens], device=self.model.device),
            cache=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        self.length += len(tokens)
        aux = torch.cat([out.hidden_states[i] for i in self.aux_layer_ids], dim=-1)[0].float()
        return aux, out.logits[0].argmax(-1).tolist()

    def keep(self, length: int) -> None:
        """Drop cached tokens beyond the first `length` (rejected draft tokens)."""
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length


@torch.no_grad()
def greedy_decode(
    target_model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    *,
    use_cache: bool = True,
) -> list[int]:
    """Plain greedy decoding (float64 target): the new tokens, EOS included. With use_cache=False every
    token recomputes the whole sequence (the slow, obviously exact definition the tests compare with)."""
    check_float64(target_model)
    eos, new = eos_set(eos_token_id), []
    if not use_cache:
        seq = list(prompt_ids)
        while len(new) < max_new_tokens and not (new and new[-1] in eos):
            _, _, logits = target_features(target_model, torch.tensor([seq], device=target_model.device), [0])
            new.append(int(logits[0, -1].argmax()))
            seq.append(new[-1])
        return new
    session = TargetSession(target_model, [0])
    pending = list(prompt_ids)
    while len(new) < max_new_tokens and not (new and new[-1] in eos):
        new.append(session.feed(pending)[1][-1])
        pending = [new[-1]]
    return new


def _truncate(emitted: list[int], budget: int, eos: set[int]) -> list[int]:
    emitted = emitted[:budget]
    for i, token in enumerate(emitted):
        if token in eos:
            return emitted[: i + 1]
    return emitted


def _verify_chain(session: TargetSession, proposer, seq, aux, steps) -> tuple[list[int], int, torch.Tensor]:
    """(accepted drafts + bonus, accepted count, aux rows of the fed tokens) for one chain round."""
    drafted = list(proposer.propose(seq, aux, steps))
    if len(drafted) != steps:
        raise ValueError(f"proposer {type(proposer).__name__}: returned {len(drafted)} tokens, expected {steps}")
    fed_aux, greedy = session.feed([seq[-1]] + drafted)  # greedy[i] verifies drafted[i]
    accepted = 0
    while accepted < steps and drafted[accepted] == greedy[accepted]:
        accepted += 1
    return drafted[:accepted] + [greedy[accepted]], accepted, fed_aux


def _deepest_path(nodes: list[Node], children: dict[int, list[int]], start: list[int]) -> list[int]:
    """`start` extended by first children down to a leaf (node indices)."""
    path = list(start)
    while children.get(path[-1] if path else -1):
        path.append(children[path[-1] if path else -1][0])
    return path


def _verify_tree(session: TargetSession, proposer, seq, aux, steps, topk, num_nodes):
    """The tree round: walk the drafted tree along the target's greedy tokens."""
    nodes = list(proposer.propose_tree(seq, aux, steps, topk, num_nodes))
    if not 0 < len(nodes) <= num_nodes or any(not -1 <= p < i for i, (_, p) in enumerate(nodes)):
        raise ValueError(
            f"proposer {type(proposer).__name__}: returned {len(nodes)} tree nodes, expected 1..{num_nodes} "
            "with every parent listed before its children"
        )
    children: dict[int, list[int]] = {}
    for i, (_, parent) in enumerate(nodes):
        children.setdefault(parent, []).append(i)
    base = session.length
    path: list[int] = []
    covered = _deepest_path(nodes, children, path)
    fed_aux, greedy = session.feed([seq[-1]] + [nodes[i][0] for i in covered])
    while True:
        want = greedy[len(path)]
        child = next((c for c in children.get(path[-1] if path else -1, []) if nodes[c][0] == want), None)
        if child is None:
            break
        path.append(child)
        if covered[: len(path)] != path:
            session.keep(base)
            covered = _deepest_path(nodes, children, path)
            fed_aux, greedy = session.feed([seq[-1]] + [nodes[i][0] for i in covered])
    return [nodes[i][0] for i in path] + [greedy[len(path)]], len(path), fed_aux


@torch.no_grad()
def reference_decode(
    target_model: torch.nn.Module,
    draft,
    prompt_ids: list[int],
    *,
    aux_layer_ids: list[int],
    steps: int = 3,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
    topk: int = 1,
    num_draft_tokens: int = 0,
    draft_cache: bool = True,
) -> DecodeResult:
    """Speculative decoding with greedy verification: a chain of `steps` drafted tokens when topk is 1,
    else a tree of num_draft_tokens - 1 drafted nodes (SGLang's count, the root included) of depth <= steps.
    `draft` is an Eagle3Draft (run as DraftProposer(draft, cache=draft_cache): draft_cache=False recomputes the
    draft over the whole sequence every round) or any Proposer. The proposer sees the aux rows as a view of one
    buffer that each round extends by the rows of the emitted tokens."""
    if not prompt_ids or steps < 1 or max_new_tokens < 1 or topk < 1:
        raise ValueError(
            f"reference_decode: prompt of {len(prompt_ids)} tokens, steps={steps}, max_new_tokens={max_new_tokens}, "
            f"topk={topk}; expected a non-empty prompt, steps >= 1, max_new_tokens >= 1 and topk >= 1"
        )
    if topk > 1 and num_draft_tokens < 2:
        raise ValueError(f"reference_decode: topk={topk} needs num_draft_tokens >= 2 (root + drafted nodes)")
    if isinstance(draft, Eagle3Draft):
        draft = DraftProposer(draft, cache=draft_cache)
    elif not draft_cache:
        raise ValueError(
            f"reference_decode: draft_cache=False with a {type(draft).__name__}, expected an Eagle3Draft (the option "
            "applies to it only); pass the Eagle3Draft itself or DraftProposer(draft, cache=False)"
        )
    session = TargetSession(target_model, aux_layer_ids)
    eos, seq = eos_set(eos_token_id), list(prompt_ids)
    prompt_aux, greedy = session.feed(seq)
    aux = prompt_aux.new_empty(len(seq) + max_new_tokens, prompt_aux.shape[1])  # f_0..f_{m-1} in aux[:m]
    aux[: len(seq)] = prompt_aux
    result = DecodeResult(tokens=[greedy[-1]], steps=steps)
    seq.append(greedy[-1])
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in eos:
        m = len(seq) - 1
        if topk == 1:
            emitted, accepted, fed_aux = _verify_chain(session, draft, seq, aux[:m], steps)
        else:
            emitted, accepted, fed_aux = _verify_tree(session, draft, seq, aux[:m], steps, topk, num_draft_tokens - 1)
        emitted = _truncate(emitted, max_new_tokens - len(result.tokens), eos)
        session.keep(m + len(emitted))  # the pending token and the accepted drafts stay cached
        aux[m : m + len(emitted)] = fed_aux[: len(emitted)]
        result.accepted_per_step.append(accepted)
        result.emitted_per_step.append(len(emitted))
        result.tokens += emitted
        seq += emitted
    return result


def check_lossless(speculative: list[int], greedy: list[int], prompt: str) -> None:
    """Raise LosslessError naming the prompt and the first new-token position that differs."""
    if speculative == greedy:
        return
    pos = next((i for i, (a, b) in enumerate(zip(speculative, greedy)) if a != b), min(len(speculative), len(greedy)))
    spec_tok = speculative[pos] if pos < len(speculative) else "<end>"
    greedy_tok = greedy[pos] if pos < len(greedy) else "<end>"
    raise LosslessError(
        f"{prompt}: speculative decoding differs from greedy decoding at new-token position {pos} "
        f"(speculative {spec_tok}, greedy {greedy_tok}; lengths {len(speculative)} and {len(greedy)}); "
        "the decoding loop is not lossless: this is a bug in eyas/bench/reference.py or a nondeterministic target"
    )


def accept_rates(results: list[DecodeResult], steps: int) -> list[float]:
    """Per drafted position i: the fraction of verification rounds that accepted draft token i."""
    accepted = [a for r in results for a in r.accepted_per_step]
    return [sum(a > i for a in accepted) / len(accepted) if accepted else 0.0 for i in range(steps)]


def pooled_tau(results: list[DecodeResult]) -> float:
    """Emitted tokens / verification rounds over all prompts (rounds weigh equally)."""
    rounds = sum(r.num_verify_steps for r in results)
    if not rounds:
        raise ValueError(
            "benchmark: no verification round ran (every prompt ended at its first token); "
            "expected prompts that continue: use max_new_tokens >= 2 and prompts that do not end in EOS"
        )
    return sum(sum(r.emitted_per_step) for r in results) / rounds
