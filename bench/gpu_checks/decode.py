"""The draft's KV-cached decoding on the device against the uncached path (eyas.bench.proposers), with the
repository's own comparison (tests/test_bench.py: growing_rounds, assert_same_proposals): fp32 cached = uncached
over many rounds and past the cache's first capacity; the device's fp32 proposals = the CPU's; bf16 cached
against uncached (agreement reported); and the reference engine on the device (the tiny target in float64)
against greedy decoding."""

from __future__ import annotations

import copy
import sys

import torch

from gpu_checks.runner import CheckContext
from gpu_checks.shapes import REPO

sys.path.insert(0, str(REPO / "tests"))

from draft_fixtures import ARCH, vocab_mapping  # noqa: E402
from test_bench import assert_same_proposals, growing_rounds  # noqa: E402

from eyas.bench.proposers import DraftProposer  # noqa: E402
from eyas.draft import DraftArch, build_draft  # noqa: E402

TINY_TARGET = REPO / "fixtures" / "tiny-target"
TARGET_AUX_IDS = [2, 4, 5]
PROMPTS = [[(37 * i + 11 * j) % 2047 + 1 for j in range(6 + 3 * i)] for i in range(3)]


def random_draft(arch: DraftArch):
    embed = torch.randn(arch.target_vocab_size, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    return build_draft(arch, embed, *vocab_mapping(arch), seed=5).eval()


def rounds(quick: bool, num_rounds: int) -> list:
    """Rounds of a growing sequence, then a new one past the cache's first capacity of 256 slots."""
    return list(growing_rounds(num_rounds)) + list(growing_rounds(4 if quick else 8, start=250, seed=1))


def compare(a: DraftProposer, b: DraftProposer, all_rounds: list, steps: int = 3) -> dict:
    """Chains of two proposers (on any devices): rounds whose tokens differ, and the largest logit difference."""
    differ, worst = [], 0.0
    for number, (seq, aux) in enumerate(all_rounds, start=1):
        (tokens, logits), (other, other_logits) = a.chain(seq, aux, steps), b.chain(seq, aux, steps)
        if tokens != other:
            differ.append(number)
        for x, y in zip(logits, other_logits, strict=True):
            worst = max(worst, float((x.float().cpu() - y.float().cpu()).abs().max()))
    return {"rounds": len(all_rounds), "rounds_differing": differ, "max_logit_diff": worst}


def decode(ctx: CheckContext) -> dict:
    device, failures, figures = torch.device(ctx.device), [], {}
    num_rounds = 6 if ctx.quick else 40
    on_cpu = random_draft(ARCH)
    draft = copy.deepcopy(on_cpu).to(device)
    cached = DraftProposer(draft)
    try:
        count = assert_same_proposals(cached, DraftProposer(draft, cache=False), rounds(ctx.quick, num_rounds))
        figures["fp32_cached_equals_uncached_rounds"] = count
        if cached.steps.kv.capacity <= 256:
            failures.append(f"the draft cache's capacity stayed {cached.steps.kv.capacity}; expected growth past 256")
    except AssertionError as err:
        failures.append(f"fp32 on {device}: cached and uncached proposals differ: {err}")
    vs_cpu = compare(DraftProposer(draft), DraftProposer(on_cpu), rounds(ctx.quick, num_rounds))
    figures["fp32_device_vs_cpu"] = vs_cpu
    if vs_cpu["rounds_differing"]:
        failures.append(f"fp32 on {device} against the CPU: rounds {vs_cpu['rounds_differing']} drafted other tokens")
    bf16 = copy.deepcopy(on_cpu).to(device, torch.bfloat16)
    figures["bf16_cached_vs_uncached"] = compare(DraftProposer(bf16), DraftProposer(bf16, cache=False),
                                                 rounds(ctx.quick, num_rounds))  # fmt: skip
    figures["reference_decode"] = reference_on_device(device, failures)
    ctx.log(f"  {figures}")
    return {**figures, "failures": failures}


def reference_on_device(device: torch.device, failures: list) -> dict:
    """The reference engine (float64 tiny target, cached and uncached draft) against greedy decoding."""
    from eyas.bench.reference import greedy_decode, load_target_float64, reference_decode
    from eyas.target import embed_weight

    target = load_target_float64(TINY_TARGET).to(device)
    hidden, vocab = embed_weight(target).shape[1], embed_weight(target).shape[0]
    arch = DraftArch(hidden_size=hidden, num_aux=len(TARGET_AUX_IDS), target_vocab_size=vocab, draft_vocab_size=512,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256)  # fmt: skip
    draft = build_draft(arch, embed_weight(target).detach().float().cpu(), *vocab_mapping(arch), seed=5)
    draft = draft.eval().to(device)
    mismatches = []
    for number, prompt in enumerate(PROMPTS):
        greedy = greedy_decode(target, prompt, 10, None)
        for cache in (True, False):
            result = reference_decode(target, draft, prompt, aux_layer_ids=TARGET_AUX_IDS, steps=3, max_new_tokens=10,
                                      eos_token_id=None, draft_cache=cache)  # fmt: skip
            if result.tokens != greedy:
                mismatches.append({"prompt": number, "draft_cache": cache, "tokens": result.tokens, "greedy": greedy})
    if mismatches:
        failures.append(f"the reference engine on {device} is not lossless against greedy decoding: {mismatches}")
    return {"prompts": len(PROMPTS), "mismatches": len(mismatches)}
