"""The memory plan (eyas.train.memory_plan): its peak against the peak measured while training (every torch
allocation, eyas.train.peak_memory) at several shapes on CPU; the Kimi-K2.5 preset's plan per H200; the auto
micro-batch budget; and the refusals a run gets when its facts are resolved, before anything is extracted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from run_fixtures import REPO, peak_memory_case

from eyas.config import load_run_config
from eyas.train.memory_plan import (
    AUTO_MAX_TOKENS,
    GIB,
    TOKEN_GRANULARITY,
    PlanDoesNotFit,
    PlanShape,
    check_run_plan,
    pick_micro_batch_tokens,
    plan_memory,
    run_plan,
)

KIMI_TARGET = SimpleNamespace(hidden_size=7168, vocab_size=163840)  # TargetFacts' two fields the plan reads
H200_GIB = 139.8  # torch's total_memory of an H200
SMALL = {
    "hidden_size": 128,
    "num_aux": 3,
    "target_vocab_size": 2048,
    "draft_vocab_size": 1024,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "num_ttt_steps": 4,
}
CASES = {
    "ddp, one sample": {"lengths": [512], "parallelism": "ddp"},
    "fsdp2, two lengths": {"lengths": [512, 256], "parallelism": "fsdp2"},
    "ddp, 2 layers, eagle3.1": {"lengths": [256, 256], "parallelism": "ddp", "num_layers": 2, "fc_norm": True,
                                "norm_output": True},
    "fsdp2, checkpointing": {"lengths": [256] * 4, "parallelism": "fsdp2", "checkpointing": True},
    "plain, top-K bf16 shards": {"lengths": [768], "parallelism": "none",
                                 "encoding": {"aux_dtype": "bfloat16", "teacher": "topk", "teacher_topk": 16}},
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_the_planned_peak_is_within_20_percent_of_the_measured_one(name):
    result = peak_memory_case({**SMALL, **CASES[name]})
    error = result["planned_bytes"] / result["measured_bytes"] - 1
    assert abs(error) <= 0.20, (name, result["planned_bytes"], result["measured_bytes"])


def kimi(**train):
    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    return config.model_copy(update={"train": config.train.model_copy(update=train)})


def test_the_kimi_preset_plans_each_h200_and_fits_with_room_for_the_allocator():
    plan = check_run_plan(kimi(), KIMI_TARGET)
    rows = {name: size for name, size, _ in plan.rows}
    assert plan.device_bytes == int(H200_GIB * GIB) and plan.fits
    assert plan.micro_batch_tokens == 4096  # the auto budget: one 4K sample, or shorter ones grouped
    assert rows["frozen embedding"] == 163840 * 7168 * 2  # bf16, whole on every rank
    assert rows["parameters (sharded)"] < rows["gathered parameters"] / 2  # fp32 / 8 ranks against bf16 whole
    assert 10 * GIB < rows["activations"] < 30 * GIB  # about 4 MiB a token over 7 unroll steps
    assert plan.peak_bytes < 0.5 * plan.usable_bytes


def test_a_kimi_run_that_cannot_fit_is_refused_with_the_fixes():
    config = kimi(parallelism="ddp", max_tokens_per_micro_batch=32768, device_memory_gib=80)
    with pytest.raises(PlanDoesNotFit) as refused:
        check_run_plan(config, KIMI_TARGET)
    message = str(refused.value)
    assert "training needs" in message and "GiB per device at micro-batches of 32,768 tokens" in message
    assert "activations" in message and "optimizer state" in message
    for fix in ("train.max_tokens_per_micro_batch", "train.activation_checkpointing=true", "train.parallelism='fsdp2'"):
        assert fix in message
    assert check_run_plan(kimi(parallelism="ddp", device_memory_gib=80), KIMI_TARGET).fits  # auto fits


def test_a_micro_batch_smaller_than_a_sample_is_refused():
    with pytest.raises(PlanDoesNotFit, match=r"max_tokens_per_micro_batch=2048 cannot hold a sample of 4096 tokens"):
        check_run_plan(kimi(max_tokens_per_micro_batch=2048), KIMI_TARGET)


def test_a_cuda_run_planned_where_no_gpu_is_visible_is_not_refused_for_want_of_a_device():
    plan = check_run_plan(kimi(device_memory_gib=0), KIMI_TARGET)
    assert plan.device_bytes == 0 and plan.micro_batch_tokens == 4096


def test_the_auto_budget_is_the_largest_that_fits_and_never_more_than_it_needs():
    shape = PlanShape.of_run(kimi(), KIMI_TARGET)
    budget = 40 * GIB
    tokens = pick_micro_batch_tokens(shape, budget)
    assert tokens % TOKEN_GRANULARITY == 0 and tokens >= shape.longest_sample
    assert plan_memory(shape, tokens, budget).fits
    assert pick_micro_batch_tokens(shape, 1000 * GIB) == max(AUTO_MAX_TOKENS, shape.longest_sample)
    assert pick_micro_batch_tokens(shape, 10 * GIB) == 0  # not even one sample fits
    small = run_plan(load_run_config(REPO / "deployments" / "tiny-cpu.json"), SimpleNamespace(hidden_size=64,
                                                                                            vocab_size=512))  # fmt: skip
    assert small.fits and small.micro_batch_tokens >= small.shape.longest_sample
