"""eyas.train.parallel: FSDP2's full state dicts are exactly the unsharded draft's (one gloo process, in-process);
the multi-process runs are in test_train_fsdp2.py."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from draft_fixtures import SMALL_ARCH as ARCH

from eyas.draft import build_draft
from eyas.train.parallel import (
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_full_model_state,
    load_full_optimizer_state,
    parallelize,
)
from eyas.train.step import TTTObjective, make_optimizer, make_scheduler, train_step

CPU = torch.device("cpu")


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_training(parallelism: str | None):
    """(draft, model, optimizer, scheduler): a draft wrapped for `parallelism`, or bare when None."""
    t2d = torch.zeros(40, dtype=torch.bool)
    t2d[::2] = True
    embed = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    draft = build_draft(ARCH, embed, torch.arange(20), t2d, seed=0)
    head_rows = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    model = TTTObjective(draft, head_rows, num_steps=2, decay=0.8, bf16=False)
    if parallelism:
        model = parallelize(model, parallelism, CPU)
    optimizer = make_optimizer(draft, lr=1e-2, weight_decay=0.01)
    return draft, model, optimizer, make_scheduler(optimizer, num_warmup_steps=1, total_steps=10)


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 40, (2, 6), generator=g),
        "loss_mask": torch.ones(2, 6, dtype=torch.long),
        "aux_hidden": torch.randn(2, 6, 48, generator=g),
        "last_hidden": torch.randn(2, 6, 16, generator=g),
        "valid": torch.ones(2, 6, dtype=torch.bool),
    }


def train(training, seeds) -> None:
    _, model, optimizer, scheduler = training
    for seed in seeds:
        train_step(model, optimizer, scheduler, [batch(seed)], max_grad_norm=0.5)


def assert_same_optimizer_state(found: dict, expected: dict) -> None:
    assert found["param_groups"] == expected["param_groups"]
    assert found["state"].keys() == expected["state"].keys()
    for i, state in expected["state"].items():
        assert found["state"][i].keys() == state.keys()
        for name, value in state.items():
            assert torch.equal(found["state"][i][name], value), (i, name)


def test_fsdp2_gathers_the_unsharded_model_and_optimizer_state(one_process_group):
    plain, sharded = make_training(None), make_training("fsdp2")
    assert is_sharded(sharded[0]) and not is_sharded(plain[0])
    train(plain, [0, 1])
    train(sharded, [0, 1])
    model_state = full_model_state(sharded[0])
    assert model_state.keys() == plain[0].state_dict().keys()
    assert all(torch.equal(model_state[k], v) for k, v in plain[0].state_dict().items())
    assert_same_optimizer_state(full_optimizer_state(sharded[0], sharded[2]), plain[2].state_dict())


def test_fsdp2_resumes_from_an_unsharded_state_and_trains_on_identically(one_process_group):
    plain, sharded = make_training(None), make_training("fsdp2")
    train(plain, [0, 1])
    # copies, as read from a checkpoint: torch's load_state_dict keeps the tensors it is given
    load_full_model_state(sharded[0], copy.deepcopy(full_model_state(plain[0])))
    load_full_optimizer_state(sharded[0], sharded[2], copy.deepcopy(plain[2].state_dict()))
    sharded[3].load_state_dict(plain[3].state_dict())
    assert_same_optimizer_state(full_optimizer_state(sharded[0], sharded[2]), plain[2].state_dict())
    train(plain, [2])
    train(sharded, [2])
    model_state = full_model_state(sharded[0])
    assert all(torch.equal(model_state[k], v) for k, v in plain[0].state_dict().items())


def test_an_optimizer_state_of_another_model_is_refused(one_process_group):
    plain, sharded = make_training(None), make_training("fsdp2")
    train(plain, [0])
    state = plain[2].state_dict()
    state["param_groups"][0]["params"].append(13)
    message = "optimizer state: parameter ids [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], expected 0..12"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_full_optimizer_state(sharded[0], sharded[2], state)
