"""The reference speculative decoding loop: lossless, exact acceptance, aligned with training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from draft_fixtures import ARCH, AUX_IDS
from safetensors.torch import save_file

from eyas.bench.acceptance import (
    BENCH_NUM_THREADS,
    BENCHMARK_FIELDS,
    encode_prompts,
    run_benchmark,
    torch_threads,
    write_benchmark_json,
)
from eyas.bench.proposers import CachedSteps, DraftProposer, NgramProposer
from eyas.bench.reference import (
    DecodeResult,
    LosslessError,
    accept_rates,
    check_lossless,
    greedy_decode,
    load_target_float64,
    reference_decode,
)
from eyas.draft import DraftArch, build_draft
from eyas.export.convert import export_sglang
from eyas.target import embed_weight, target_fingerprint

PROMPTS = [[(37 * i + 11 * j) % 2047 + 1 for j in range(6 + 3 * i)] for i in range(3)]


class GreedyOracle:
    """Proposes the target's own greedy tokens; with `wrong_at`, round r spoils token r % (steps + 1)."""

    def __init__(self, model, wrong_at: bool = False):
        self.model, self.wrong_at, self.rounds = model, wrong_at, 0

    def propose(self, seq, aux, steps):
        assert aux.shape == (len(seq) - 1, 3 * 64) and aux.dtype == torch.float32
        tokens = greedy_decode(self.model, seq, steps, None)
        spoil = self.rounds % (steps + 1)
        self.rounds += 1
        if self.wrong_at and spoil < steps:
            tokens[spoil] = (tokens[spoil] + 1) % 2048
        return tokens


def vocab_mapping() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randperm(2048, generator=torch.Generator().manual_seed(0))[:512].sort().values
    t2d = torch.zeros(2048, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(512), t2d


@pytest.fixture(autouse=True)
def benchmark_threads():
    """The torch thread count the benchmark runs with: its tiny ops are slower with more on a busy machine."""
    with torch_threads(BENCH_NUM_THREADS):
        yield


@pytest.fixture(scope="module")
def target(random_target_dir):
    return load_target_float64(random_target_dir)


@pytest.fixture(scope="module")
def random_draft(target):
    return build_draft(ARCH, embed_weight(target).detach().float(), *vocab_mapping(), seed=5).eval()


def decode(target, proposer, prompt, steps=3, max_new_tokens=16, eos=None, **tree) -> DecodeResult:
    return reference_decode(
        target,
        proposer,
        prompt,
        aux_layer_ids=AUX_IDS,
        steps=steps,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        **tree,
    )


def test_random_draft_is_lossless_and_accepts_almost_nothing(target, random_draft):
    results = []
    for prompt in PROMPTS[:2]:
        r = decode(target, random_draft, prompt, max_new_tokens=12)
        check_lossless(r.tokens, greedy_decode(target, prompt, 12, None), prompt="p")
        assert len(r.tokens) == 12
        results.append(r)
    rounds = sum(r.num_verify_steps for r in results)
    tau = sum(sum(r.emitted_per_step) for r in results) / rounds
    assert 1.0 <= tau < 1.25


@pytest.mark.parametrize("steps", [1, 3])
def test_oracle_draft_reaches_steps_plus_one(target, steps):
    max_new_tokens = 1 + 4 * (steps + 1)
    r = decode(target, GreedyOracle(target), PROMPTS[1], steps=steps, max_new_tokens=max_new_tokens)
    assert r.tokens == greedy_decode(target, PROMPTS[1], max_new_tokens, None)
    assert r.tau == steps + 1
    assert r.accepted_per_step == [steps] * 4
    assert accept_rates([r], steps) == [1.0] * steps


def test_partial_acceptance_is_exact_and_lossless(target):
    r = decode(target, GreedyOracle(target, wrong_at=True), PROMPTS[0], steps=3, max_new_tokens=1 + 1 + 2 + 3 + 4)
    assert r.tokens == greedy_decode(target, PROMPTS[0], 11, None)
    assert r.accepted_per_step == [0, 1, 2, 3]
    assert r.emitted_per_step == [1, 2, 3, 4]
    assert accept_rates([r], 3) == [0.75, 0.5, 0.25]


def test_last_round_is_truncated_at_max_new_tokens(target):
    r = decode(target, GreedyOracle(target), PROMPTS[2], steps=3, max_new_tokens=7)
    assert r.tokens == greedy_decode(target, PROMPTS[2], 7, None)
    assert r.accepted_per_step == [3, 3] and r.emitted_per_step == [4, 2]
    assert r.tau == 3.0


def test_eos_stops_speculative_and_greedy_decoding_alike(target, random_draft):
    free = greedy_decode(target, PROMPTS[2], 12, None)
    eos = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    expected = free[: free.index(eos) + 1]
    assert greedy_decode(target, PROMPTS[2], 12, eos) == expected
    for proposer in (GreedyOracle(target), random_draft):
        assert decode(target, proposer, PROMPTS[2], max_new_tokens=12, eos=[eos, 4000]).tokens == expected


def test_draft_proposer_matches_the_training_unroll(random_draft):
    seq = PROMPTS[2]
    m = len(seq) - 1
    aux = torch.randn(m + 2, 192, generator=torch.Generator().manual_seed(0))
    tokens, logits = DraftProposer(random_draft).chain(seq, aux[:m], 3)
    ids = torch.tensor([seq + tokens[:2]])
    with torch.no_grad():
        for k, lg in random_draft.unroll(ids, aux[None], 3):
            torch.testing.assert_close(lg[0, m - 1], logits[k], rtol=1e-5, atol=1e-5)
            assert int(random_draft.to_target_ids(lg[0, m - 1].argmax())) == tokens[k]


def growing_rounds(num_rounds: int, *, start: int = 8, seed: int = 0):
    """(seq, aux) of decoding rounds whose sequence grows by 1..4 tokens a round, as accepted drafts make it."""
    g = torch.Generator().manual_seed(seed)
    seq = [int(t) for t in torch.randint(1, 2048, (start,), generator=g)]
    aux = torch.randn(start + 4 * num_rounds, 192, generator=g)
    for r in range(num_rounds):
        yield list(seq), aux[: len(seq) - 1]
        seq += [int(t) for t in torch.randint(1, 2048, (1 + r % 4,), generator=g)]


def assert_same_proposals(cached: DraftProposer, uncached: DraftProposer, rounds, steps: int = 3) -> int:
    """Every round's chain (tokens, and logits to float rounding) and tree equal between the two; the round count."""
    count = 0
    for count, (seq, aux) in enumerate(rounds, start=1):
        (tokens, logits), (expected, expected_logits) = cached.chain(seq, aux, steps), uncached.chain(seq, aux, steps)
        assert tokens == expected, f"round {count}: cached draft proposed {tokens}, recomputing one {expected}"
        for got, want in zip(logits, expected_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert cached.propose_tree(seq, aux, steps, 2, 6) == uncached.propose_tree(seq, aux, steps, 2, 6)
    return count


@pytest.mark.parametrize(
    "options", [{}, {"num_layers": 2}, {"norm_output": True, "fc_norm": True}, {"norm_before_fc": True}]
)
def test_cached_draft_proposes_what_recomputing_drafts_over_many_rounds(target, options):
    arch = DraftArch(**{**ARCH.to_dict(), **options})
    draft = build_draft(arch, embed_weight(target).detach().float(), *vocab_mapping(), seed=5).eval()
    cached, uncached = DraftProposer(draft), DraftProposer(draft, cache=False)
    assert assert_same_proposals(cached, uncached, growing_rounds(40)) == 40
    # past the cache's first capacity of 256 slots, and a new sequence reusing nothing
    assert assert_same_proposals(cached, uncached, growing_rounds(8, start=250, seed=1)) == 8
    assert cached.steps.kv.capacity > 256


def test_the_cache_comparison_fails_on_a_stale_cache(random_draft, monkeypatch):
    """The comparison above could fail: a cache that trusts matching tokens alone keeps step 0 of changed features."""
    rounds = list(growing_rounds(12))
    g = torch.Generator().manual_seed(2)
    changed = [(seq, torch.randn(aux.shape, generator=g)) for seq, aux in rounds]  # same tokens, other features
    assert_same_proposals(DraftProposer(random_draft), DraftProposer(random_draft, cache=False), rounds + changed)
    monkeypatch.setattr(CachedSteps, "reusable", lambda self, seq, aux: max(min(len(self.seq), len(seq) - 1) - 1, 0))
    with pytest.raises(AssertionError, match=r"round 13: cached draft proposed \[.*\], recomputing one"):
        assert_same_proposals(DraftProposer(random_draft), DraftProposer(random_draft, cache=False), rounds + changed)


@pytest.mark.parametrize("tree", [{}, {"topk": 2, "num_draft_tokens": 5}])
def test_reference_decode_with_and_without_the_draft_cache_agree(target, random_draft, tree):
    for prompt in PROMPTS:
        cached = decode(target, random_draft, prompt, max_new_tokens=10, **tree)
        uncached = decode(target, random_draft, prompt, max_new_tokens=10, draft_cache=False, **tree)
        assert cached.tokens == uncached.tokens == greedy_decode(target, prompt, 10, None)
        assert cached.accepted_per_step == uncached.accepted_per_step


def test_draft_cache_off_is_refused_for_a_proposer_it_does_not_apply_to(target):
    with pytest.raises(
        ValueError, match=r"draft_cache=False with a NgramProposer, expected an Eagle3Draft \(the option applies"
    ):
        decode(target, NgramProposer(3), PROMPTS[0], draft_cache=False)


def test_torch_threads_sets_the_count_inside_and_restores_it():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="inside"):
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("inside")
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match=r"benchmark: num_threads=0, expected >= 1"):
        with torch_threads(0):
            pass


def test_check_lossless_names_prompt_and_first_difference():
    with pytest.raises(LosslessError) as err:
        check_lossless([5, 6, 7, 9], [5, 6, 8, 9], prompt="prompt 3 (trained draft)")
    assert str(err.value) == (
        "prompt 3 (trained draft): speculative decoding differs from greedy decoding at new-token position 2 "
        "(speculative 7, greedy 8; lengths 4 and 4); the decoding loop is not lossless: this is a bug in "
        "eyas/bench/reference.py or a nondeterministic target"
    )
    expected = r"at new-token position 2 \(speculative <end>, greedy 8; lengths 2 and 3\)"
    with pytest.raises(LosslessError, match=expected):
        check_lossless([5, 6], [5, 6, 8], prompt="p")


def test_float32_target_is_refused(random_target_dir, random_draft):
    model = load_target_float64(random_target_dir).float()
    with pytest.raises(ValueError, match=r"target model: dtype torch.float32, expected torch.float64"):
        decode(model, random_draft, PROMPTS[0])


def test_encode_prompts_takes_ids_text_and_conversations(random_target_dir):
    from transformers import AutoTokenizer

    from eyas.dataset.prompts import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(random_target_dir)
    conversation = [{"role": "user", "content": "import os\n"}]
    assert encode_prompts([[3, 4], "def f():", conversation], random_target_dir) == [
        [3, 4],
        tokenizer("def f():")["input_ids"],
        prompt_token_ids(tokenizer, conversation),
    ]
    with pytest.raises(ValueError, match=r"prompt 1: empty after encoding; expected at least one token"):
        encode_prompts([[3], []], random_target_dir)


def write_export(root: Path, target_dir: Path, fingerprint: str) -> Path:
    """A training checkpoint (random draft over the target's embedding), exported to SGLang format."""
    embed = embed_weight(load_target_float64(target_dir)).detach().float()
    draft = build_draft(ARCH, embed, *vocab_mapping(), seed=7)
    ckpt = root / "step-00000001"
    ckpt.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(ckpt / "model.safetensors"))
    meta = {
        "arch": ARCH.to_dict(),
        "aux_layer_ids": AUX_IDS,
        "layer_id_convention": "hf_hidden_states",
        "target_fingerprint": fingerprint,
    }
    (ckpt / "arch.json").write_text(json.dumps(meta))
    (ckpt / "COMPLETE").write_text("")
    return export_sglang(ckpt, root / "export")


def test_run_benchmark_reports_the_schema_and_writes_json(random_target_dir, tmp_path):
    export = write_export(tmp_path, random_target_dir, target_fingerprint(random_target_dir))
    prompts = [PROMPTS[0], "def main():", [{"role": "user", "content": "import os\n"}]]
    calls = []
    with torch_threads(BENCH_NUM_THREADS + 1):
        result = run_benchmark(
            random_target_dir,
            export,
            prompts,
            steps=3,
            max_new_tokens=10,
            compare_uncached_draft=True,
            progress=calls.append,
        )
        assert torch.get_num_threads() == BENCH_NUM_THREADS + 1  # restored after the run
    assert sorted(result) == sorted(BENCHMARK_FIELDS)
    assert result["num_threads"] == BENCH_NUM_THREADS
    assert [(c["pass"], c["prompts_done"], c["prompts_total"]) for c in calls] == [
        ("greedy, trained, random, n-gram, uncached trained", i, 3) for i in range(4)
    ]
    assert calls[0]["eta_s"] is None and calls[-1]["eta_s"] == 0.0 and all(c["eta_s"] >= 0 for c in calls[1:])
    assert result["tau_mean_uncached"] == result["tau_mean"]
    assert result["speedup_vs_greedy_uncached"] == result["wall_s_greedy"] / result["wall_s_speculative_uncached"]
    assert result["lossless"] is True and result["num_prompts"] == 3 and result["aux_layer_ids"] == AUX_IDS
    assert len(result["tau_per_prompt"]) == 3 and len(result["accept_rate_per_position"]) == 3
    assert 1.0 <= result["tau_mean"] <= 4.0 and 1.0 <= result["tau_random"] <= 4.0
    assert (
        1.0 <= result["tau_ngram"] <= 4.0 and result["tau_ratio_vs_ngram"] == result["tau_mean"] / result["tau_ngram"]
    )
    assert result["topk"] == 1 and result["num_draft_tokens"] == 4
    assert result["speedup_vs_greedy"] == result["wall_s_greedy"] / result["wall_s_speculative"]
    path = write_benchmark_json(result, tmp_path / "bench" / "benchmark.json")
    assert json.loads(path.read_text()) == result


def test_run_benchmark_refuses_a_draft_of_another_target(random_target_dir, tmp_path):
    export = write_export(tmp_path, random_target_dir, "0123456789abcdef")
    with pytest.raises(ValueError, match=r"trained for target fingerprint 0123456789abcdef, but target .* has "):
        run_benchmark(random_target_dir, export, [PROMPTS[0]], steps=3, max_new_tokens=4)


class TreeOracle:
    """A tree whose first branch is a wrong token and whose second holds the target's greedy chain."""

    def __init__(self, model):
        self.model = model

    def propose(self, seq, aux, steps):
        raise AssertionError("a tree round must call propose_tree")

    def propose_tree(self, seq, aux, steps, topk, num_nodes):
        greedy = greedy_decode(self.model, seq, steps, None)
        nodes = [((greedy[0] + 1) % 2048, -1), ((greedy[1] + 1) % 2048, 0)]  # a wrong branch, listed first
        for depth, token in enumerate(greedy):
            nodes.append((token, -1 if depth == 0 else len(nodes) - 1))
        return nodes[:num_nodes]


def test_cached_greedy_equals_recomputing_greedy(target):
    for prompt in PROMPTS:
        assert greedy_decode(target, prompt, 12, None) == greedy_decode(target, prompt, 12, None, use_cache=False)


def test_tree_oracle_reaches_steps_plus_one_off_the_first_branch(target):
    r = decode(target, TreeOracle(target), PROMPTS[1], steps=3, max_new_tokens=13, topk=2, num_draft_tokens=6)
    assert r.tokens == greedy_decode(target, PROMPTS[1], 13, None, use_cache=False)
    assert r.accepted_per_step == [3, 3, 3] and r.tau == 4.0


def test_random_draft_tree_is_lossless(target, random_draft):
    r = decode(target, random_draft, PROMPTS[0], steps=2, max_new_tokens=8, topk=2, num_draft_tokens=5)
    assert r.tokens == greedy_decode(target, PROMPTS[0], 8, None, use_cache=False)
    assert r.tau is not None and 1.0 <= r.tau < 1.5


def test_draft_tree_holds_the_chain_and_keeps_parents_first(random_draft):
    seq = PROMPTS[2]
    aux = torch.randn(len(seq) - 1, 192, generator=torch.Generator().manual_seed(1))
    proposer = DraftProposer(random_draft)
    nodes = proposer.propose_tree(seq, aux, 3, 2, 7)
    assert len(nodes) == 7 and all(-1 <= parent < i for i, (_, parent) in enumerate(nodes))
    chain, node = proposer.propose(seq, aux, 3), -1
    for token in chain:  # the greedy chain is the best-scoring path, so it is in the tree
        node = next(i for i, (t, p) in enumerate(nodes) if p == node and t == token)


def test_ngram_proposer_copies_what_followed_the_last_match():
    proposer = NgramProposer(max_n=2)
    assert proposer.propose([5, 6, 7, 8, 9, 6, 7], None, 3) == [8, 9, 6]
    assert proposer.propose([5, 6, 7, 5, 6], None, 3) == [7, 5, 6]
    assert proposer.propose([1, 2, 3], None, 2) == [3, 3]
    assert proposer.propose([4, 9, 4], None, 3) == [9, 4, 4]


def test_ngram_drafter_is_lossless_on_a_repetitive_prompt(target):
    prompt = [7, 8, 9, 10] * 4
    r = decode(target, NgramProposer(3), prompt, steps=3, max_new_tokens=12)
    assert r.tokens == greedy_decode(target, prompt, 12, None, use_cache=False)


def test_bench_config_refuses_draft_tokens_that_do_not_fit_the_shape():
    from pydantic import ValidationError

    from eyas.config import BenchConfig

    assert BenchConfig(prompts_path="p", num_steps=3).draft_tokens == 4
    assert BenchConfig(prompts_path="p", num_steps=3, topk=4, num_draft_tokens=8).draft_tokens == 8
    with pytest.raises(
        ValidationError, match=r"bench.num_draft_tokens=6 with bench.topk=1 .* expected 0 or num_steps \+ 1 = 4"
    ):
        BenchConfig(prompts_path="p", num_steps=3, num_draft_tokens=6)
    with pytest.raises(ValidationError, match=r"bench.topk=2 \(a tree\) needs bench.num_draft_tokens >= 2"):
        BenchConfig(prompts_path="p", topk=2)
