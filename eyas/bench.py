"""Reference acceptance benchmark: eyas's own speculative decoding loop (chain, greedy, CPU).

    from eyas.bench import run_benchmark, write_benchmark_json
    result = run_benchmark("target/", "run/export", prompts, steps=3, max_new_tokens=64)
    write_benchmark_json(result, "run/bench/benchmark.json")

The draft is loaded from the exported SGLang files (`load_exported_draft`), so the benchmark
measures what the engine will load. The target runs in float64 without a KV cache: every
round recomputes the whole sequence, so that verification and plain greedy decoding agree
exactly; any difference is raised as `LosslessError`, never reported as a number.

Acceptance length tau = tokens emitted by verification rounds / number of verification rounds
(accepted draft tokens + the bonus token, after truncation at max_new_tokens or EOS, as SGLang
counts completion_tokens / spec_verify_ct). The first new token comes from the prefill, not from
a verification round, and is not counted. tau is 1.0 when nothing is accepted, at most steps + 1.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import torch

from eyas.draft import Eagle3Draft, build_draft
from eyas.export import load_exported_draft, read_export_provenance
from eyas.fsio import atomic_write_text
from eyas.target import embed_weight, target_features, target_fingerprint

Prompt = list[int] | str | list[dict]  # token ids, raw text, or a conversation [{role, content}, ...]


class LosslessError(AssertionError):
    """Speculative decoding produced a different sequence than plain greedy decoding."""


class Proposer(Protocol):
    def propose(self, seq: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        """`steps` drafted target ids following seq = x_0..x_m, given aux [m, n_aux*H] = f_0..f_{m-1}."""


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


class DraftProposer:
    """Chain drafting with an Eagle3Draft, aligned exactly as `Eagle3Draft.unroll` trains it.

    Step 0 runs over the pairs (f_t, x_{t+1}) for t = 0..m-1 at positions t; step k >= 1 runs
    over the same indices at positions t + k, continuing the same attention cache, with the
    drafted token at the last index (other indices carry unroll's tokens and cannot influence
    the last index: step k attends to step-0 keys causally and to steps 1..k at its own index).
    """

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft

    @torch.no_grad()
    def chain(self, seq: list[int], aux: torch.Tensor, steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """(drafted target ids, draft logits [Vd] of each step at the last index)."""
        draft, m = self.draft, len(seq) - 1
        if aux.shape[0] != m:
            raise ValueError(f"draft input: {aux.shape[0]} aux feature rows for {len(seq)} tokens, expected {m}")
        dtype = draft.fc.weight.dtype
        tokens_in = torch.tensor(seq, dtype=torch.int64)
        hidden = draft.project(aux[None].to(dtype))
        base = torch.arange(m)[None]
        cache: list = []
        tokens, logits = [], []
        for k in range(steps):
            ids = torch.zeros(1, m, dtype=torch.int64)
            n = max(m - k, 0)
            ids[0, :n] = tokens_in[k + 1 : k + 1 + n]
            if k:
                ids[0, m - 1] = tokens[-1]
            hidden = draft.step(ids, hidden, base + k, cache)
            lg = draft.logits(hidden[0, -1])
            tokens.append(int(draft.to_target_ids(lg.argmax(-1))))
            logits.append(lg)
        return tokens, logits

    def propose(self, seq: list[int], aux: torch.Tensor, steps: int) -> list[int]:
        return self.chain(seq, aux, steps)[0]


def _check_float64(model: torch.nn.Module) -> None:
    dtype = next(model.parameters()).dtype
    if dtype != torch.float64:
        raise ValueError(
            f"target model: dtype {dtype}, expected torch.float64 so that greedy ties cannot flip between "
            "verification and plain decoding; load it with load_target_float64() or pass "
            "copy.deepcopy(model).to(torch.float64)"
        )


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


def _greedy_next(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].argmax(-1)


@torch.no_grad()
def greedy_decode(
    target_model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | Sequence[int] | None
) -> list[int]:
    """Plain greedy decoding without a KV cache (float64 target): the new tokens, EOS included."""
    _check_float64(target_model)
    eos, seq, new = _eos_set(eos_token_id), list(prompt_ids), []
    while len(new) < max_new_tokens and not (new and new[-1] in eos):
        token = int(_greedy_next(target_model, seq)[-1])
        seq.append(token)
        new.append(token)
    return new


def _target_pass(model: torch.nn.Module, ids: list[int], aux_layer_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """(aux features [T, n_aux*H] as float32, greedy next token at every position)."""
    aux, _, logits = target_features(model, torch.tensor([ids]), aux_layer_ids)
    return aux[0].float(), logits[0].argmax(-1).tolist()


def _truncate(emitted: list[int], budget: int, eos: set[int]) -> list[int]:
    emitted = emitted[:budget]
    for i, token in enumerate(emitted):
        if token in eos:
            return emitted[: i + 1]
    return emitted


@torch.no_grad()
def reference_decode(
    target_model: torch.nn.Module,
    draft: Eagle3Draft | Proposer,
    prompt_ids: list[int],
    *,
    aux_layer_ids: list[int],
    steps: int = 3,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None,
) -> DecodeResult:
    """Speculative decoding, chain of `steps` drafted tokens, greedy verification by the target."""
    _check_float64(target_model)
    if not prompt_ids or steps < 1 or max_new_tokens < 1:
        raise ValueError(
            f"reference_decode: prompt of {len(prompt_ids)} tokens, steps={steps}, max_new_tokens={max_new_tokens}; "
            "expected a non-empty prompt, steps >= 1 and max_new_tokens >= 1"
        )
    proposer = DraftProposer(draft) if isinstance(draft, Eagle3Draft) else draft
    eos, seq = _eos_set(eos_token_id), list(prompt_ids)
    aux, greedy = _target_pass(target_model, seq, aux_layer_ids)
    result = DecodeResult(tokens=[greedy[-1]], steps=steps)
    seq.append(greedy[-1])
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in eos:
        drafted = list(proposer.propose(seq, aux, steps))
        if len(drafted) != steps:
            raise ValueError(f"proposer {type(proposer).__name__}: returned {len(drafted)} tokens, expected {steps}")
        last = len(seq) - 1  # logits at `last` verify drafted[0]
        aux_all, greedy = _target_pass(target_model, seq + drafted, aux_layer_ids)
        accepted = 0
        while accepted < steps and drafted[accepted] == greedy[last + accepted]:
            accepted += 1
        emitted = _truncate(drafted[:accepted] + [greedy[last + accepted]], max_new_tokens - len(result.tokens), eos)
        result.accepted_per_step.append(accepted)
        result.emitted_per_step.append(len(emitted))
        result.tokens += emitted
        seq += emitted
        aux = aux_all[: len(seq) - 1]
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
        "the decoding loop is not lossless: this is a bug in eyas/bench.py or a nondeterministic target"
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


def load_target_float64(target_path: str | Path) -> torch.nn.Module:
    """The target model in float64, eval mode (no tokenizer needed)."""
    from transformers import AutoModelForCausalLM

    path = Path(target_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target {path}: no config.json; expected a Hugging Face model directory")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


def encode_prompts(prompts: Sequence[Prompt], target_path: str | Path) -> list[list[int]]:
    """Token-id lists as they are; texts through the target's tokenizer; conversations
    ([{role, content}, ...]) through its chat template exactly as the dataset stage encodes them."""
    tokenizer = None
    encoded = []
    for i, prompt in enumerate(prompts):
        is_conversation = bool(prompt) and not isinstance(prompt, str) and isinstance(prompt[0], dict)
        if isinstance(prompt, str) or is_conversation:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(target_path)
            if is_conversation:
                from eyas.dataset import prompt_token_ids

                prompt = prompt_token_ids(tokenizer, list(prompt))
            else:
                prompt = tokenizer(prompt)["input_ids"]
        if not prompt:
            raise ValueError(f"prompt {i}: empty after encoding; expected at least one token")
        encoded.append([int(t) for t in prompt])
    return encoded


def _check_provenance(export_dir: str | Path, target_path: str | Path) -> None:
    provenance = read_export_provenance(export_dir)
    if provenance is None or not provenance.get("target_fingerprint"):
        return
    actual = target_fingerprint(target_path)
    if provenance["target_fingerprint"] != actual:
        raise ValueError(
            f"export {export_dir}: trained for target fingerprint {provenance['target_fingerprint']}, "
            f"but target {target_path} has {actual}; benchmark the draft against the target it was trained on"
        )


def _decode_all(model, draft, prompts, greedy, *, aux_layer_ids, steps, max_new_tokens, eos, label):
    results = []
    for i, (ids, reference) in enumerate(zip(prompts, greedy)):
        r = reference_decode(
            model, draft, ids, aux_layer_ids=aux_layer_ids, steps=steps, max_new_tokens=max_new_tokens, eos_token_id=eos
        )
        check_lossless(r.tokens, reference, prompt=f"prompt {i} ({label} draft)")
        results.append(r)
    return results


def run_benchmark(
    target_path: str | Path,
    export_dir: str | Path,
    prompts: Sequence[Prompt],
    *,
    steps: int,
    max_new_tokens: int,
    random_draft_seed: int = 0,
) -> dict:
    """tau and per-position acceptance of the exported draft, and of a random draft of the same shape."""
    start = time.perf_counter()
    if not prompts:
        raise ValueError("benchmark: no prompts; expected at least one held-out prompt")
    _check_provenance(export_dir, target_path)
    model = load_target_float64(target_path)
    draft = load_exported_draft(export_dir, embed_weight(model))
    random_draft = build_draft(draft.arch, draft.embed_tokens.weight, draft.d2t, draft.t2d, seed=random_draft_seed)
    random_draft.eval()
    encoded = encode_prompts(prompts, target_path)
    eos = model.config.eos_token_id
    greedy = [greedy_decode(model, ids, max_new_tokens, eos) for ids in encoded]
    common = dict(aux_layer_ids=draft.aux_layer_ids, steps=steps, max_new_tokens=max_new_tokens, eos=eos)
    trained = _decode_all(model, draft, encoded, greedy, label="trained", **common)
    random = _decode_all(model, random_draft, encoded, greedy, label="random", **common)
    return {
        "engine": "reference",
        "tau_mean": pooled_tau(trained),
        "tau_per_prompt": [r.tau for r in trained],
        "accept_rate_per_position": accept_rates(trained, steps),
        "num_verify_steps": sum(r.num_verify_steps for r in trained),
        "tau_random": pooled_tau(random),
        "accept_rate_per_position_random": accept_rates(random, steps),
        "steps": steps,
        "num_prompts": len(encoded),
        "max_new_tokens": max_new_tokens,
        "aux_layer_ids": list(draft.aux_layer_ids),
        "lossless": True,
        "wall_s": time.perf_counter() - start,
    }


def write_benchmark_json(result: dict, path: str | Path) -> Path:
    """Write the result as JSON (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=2, sort_keys=True) + "\n")
    return path
