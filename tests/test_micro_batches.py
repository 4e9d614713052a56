"""Token-budget micro-batches (eyas.train.data.split_micro_batches, eyas.train.step.train_step): real torchrun runs
whose ranks split their share of every global batch into micro-batches end with the weights of one-micro-batch
training (DDP and FSDP2, world size 1 and 2), because each micro-batch's loss is divided by the global batch's
loss tokens; one process and two agree the same way; activation checkpointing leaves the weights bit for bit; the
metric line reports the micro-batches and the padding they computed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from draft_fixtures import ARCH, vocab_mapping
from run_fixtures import run_trainer, tiny_job, write_tiny_run
from safetensors.torch import load_file
from test_attention import padded_batch

from eyas.draft import build_draft
from eyas.train.data import collate, split_micro_batches
from eyas.train.step import TTTObjective, global_token_counts

STEPS = 4
ONE_MICRO_BATCH = 1 << 20  # more than any rank's share: one micro-batch per step
SMALL_BUDGET = 32  # two samples of the tiny run (10 to 16 tokens) at most
WEIGHT_RTOL = 1e-6  # max |a - b| / max |b| per tensor
# AdamW moves every weight by about lr per step whatever its gradient's size, so float32 noise in a near-zero
# gradient element moves that weight by up to lr; at lr 1e-4 the runs stay within 1e-7 of each other, while a wrong
# normalization (a gradient off by more than rounding) moves the weights about 1e-3 apart.
LR = 1e-4


def test_micro_batches_group_samples_of_similar_length_within_the_budget():
    lengths = [12, 40, 13, 39, 11, 38, 12, 40]
    groups = split_micro_batches(lengths, 80)
    assert sorted(i for g in groups for i in g) == list(range(8))
    assert all(len(g) * max(lengths[i] for i in g) <= 80 for g in groups)
    assert groups == [[1, 7], [3, 5], [2, 0, 6, 4]]  # longest first, ties in order
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    in_order = sum(2 * max(lengths[i : i + 2]) for i in range(0, 8, 2))  # the same sizes, without grouping
    assert computed - sum(lengths) == 5 and in_order - sum(lengths) == 109


def test_no_budget_is_one_micro_batch_in_order_and_a_sample_above_the_budget_is_refused():
    assert split_micro_batches([5, 9, 7], 0) == [[0, 1, 2]]
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=8: samples of 9 tokens do not fit"):
        split_micro_batches([5, 9, 7], 8)


def test_micro_batch_gradients_add_up_to_the_whole_batchs():
    """The gradient summed over micro-batches, each divided by the whole batch's loss tokens, is the gradient of
    the whole batch as one (float32 rounding apart)."""
    d2t, t2d = vocab_mapping(ARCH)
    draft = build_draft(ARCH, torch.randn(ARCH.target_vocab_size, ARCH.hidden_size), d2t, t2d)
    head = torch.randn(ARCH.draft_vocab_size, ARCH.hidden_size)
    lengths = [40, 12, 33, 9, 27, 40]
    samples = [
        {k: v[i, :n] for k, v in padded_batch(ARCH, lengths).items() if k != "valid"} for i, n in enumerate(lengths)
    ]
    grads = []
    for groups in ([list(range(6))], split_micro_batches(lengths, 64)):
        objective = TTTObjective(copy.deepcopy(draft), head, num_steps=4, decay=0.8, bf16=False)
        batches = [collate([samples[i] for i in g], 64, min_len=5) for g in groups]
        norm = global_token_counts(batches, objective)
        for batch in batches:
            objective(batch, token_norm=norm)[0].backward()
        grads.append({n: p.grad for n, p in objective.draft.named_parameters() if p.requires_grad})
    assert len(split_micro_batches(lengths, 64)) == 5
    for name, whole in grads[0].items():
        assert float((grads[1][name] - whole).abs().max() / whole.abs().max()) < 1e-6, name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("micro-run"), num_samples=32)


def train(root: Path, run: dict, name: str, nproc: int, **train) -> tuple[dict, list[dict]]:
    out = root / name / "out"
    out.parent.mkdir(parents=True)
    job = tiny_job(
        run,
        out,
        num_processes=nproc,
        max_steps=STEPS,
        global_batch_size=8,
        lr=LR,
        max_grad_norm=1e6,
        save_every_steps=STEPS,
        **train,
    )
    job_path = out.parent / "job.json"
    job_path.write_text(job.model_dump_json())
    _, metrics = run_trainer(job_path, nproc=nproc)
    return load_file(out / "checkpoints" / f"step-{STEPS:08d}" / "model.safetensors"), metrics


def assert_weights_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    worst = {k: float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()) for k in a}
    assert max(worst.values()) <= WEIGHT_RTOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize(("parallelism", "nproc"), [("ddp", 1), ("ddp", 2), ("fsdp2", 1), ("fsdp2", 2)])
def test_micro_batches_train_to_the_weights_of_one_micro_batch(tiny_run, tmp_path, parallelism, nproc):
    whole, whole_metrics = train(
        tmp_path, tiny_run, "whole", nproc, parallelism=parallelism, max_tokens_per_micro_batch=ONE_MICRO_BATCH
    )
    split, split_metrics = train(
        tmp_path, tiny_run, "split", nproc, parallelism=parallelism, max_tokens_per_micro_batch=SMALL_BUDGET
    )
    assert [m["micro_batches"] for m in whole_metrics] == [1] * STEPS
    assert all(m["micro_batches"] >= 8 // nproc // 2 for m in split_metrics)
    assert all(m["padding_waste"] < w["padding_waste"] for m, w in zip(split_metrics, whole_metrics))
    assert [m["loss"] for m in split_metrics] == pytest.approx([m["loss"] for m in whole_metrics], rel=1e-6)
    assert_weights_close(split, whole)


def test_one_process_and_two_train_to_the_same_weights(tiny_run, tmp_path):
    """The loss of every rank's share is divided by the global batch's tokens: the world size changes the
    summation order only."""
    one, _ = train(tmp_path, tiny_run, "one", 1, max_tokens_per_micro_batch=ONE_MICRO_BATCH)
    two, _ = train(tmp_path, tiny_run, "two", 2, max_tokens_per_micro_batch=ONE_MICRO_BATCH)
    assert_weights_close(two, one)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp2"])
def test_activation_checkpointing_trains_to_the_same_weights(tiny_run, tmp_path, parallelism):
    plain, _ = train(tmp_path, tiny_run, "plain", 2, parallelism=parallelism, max_tokens_per_micro_batch=SMALL_BUDGET)
    ckpt, _ = train(
        tmp_path,
        tiny_run,
        "ckpt",
        2,
        parallelism=parallelism,
        max_tokens_per_micro_batch=SMALL_BUDGET,
        activation_checkpointing=True,
    )
    assert [k for k in plain if not torch.equal(plain[k], ckpt[k])] == []
