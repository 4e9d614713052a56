"""eyas.train.smoke: the in-process preflight overfits a learnable tiny set; the module table for the gate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_fixtures import tiny_job, write_tiny_run

from eyas.config import SmokeConfig
from eyas.train.checkpoint import latest_complete, load_draft
from eyas.train.smoke import MODULE_ROWS, module_table, smoke_train


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and the test machine's cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> dict:
    return write_tiny_run(tmp_path_factory.mktemp("smoke-run"), num_samples=12)


def test_smoke_train_overfits_and_saves_a_loadable_checkpoint(tiny_run, tmp_path, one_thread):
    job = tiny_job(tiny_run, tmp_path / "smoke")
    result = smoke_train(job, SmokeConfig(num_samples=8, num_steps=30))
    assert result.passed, result.losses
    assert len(result.losses) == 30
    assert result.first == pytest.approx(sum(result.losses[:5]) / 5)
    assert result.last == pytest.approx(sum(result.losses[-5:]) / 5)
    assert result.last < 0.7 * result.first
    assert (
        Path(result.checkpoint) == latest_complete(tmp_path / "smoke") == tmp_path / "smoke/checkpoints/step-00000030"
    )
    draft, meta = load_draft(result.checkpoint)
    assert meta["aux_layer_ids"] == job.aux_layer_ids
    assert json.loads((tmp_path / "smoke" / "smoke.json").read_text())["passed"] is True


def test_smoke_train_fails_when_the_loss_cannot_drop_enough(tiny_run, tmp_path, one_thread):
    result = smoke_train(tiny_job(tiny_run, tmp_path / "smoke"), SmokeConfig(num_samples=8, num_steps=4, lr=1e-6))
    assert not result.passed


def test_smoke_rerun_replaces_the_previous_smoke_checkpoint(tiny_run, tmp_path, one_thread):
    job = tiny_job(tiny_run, tmp_path / "smoke")
    smoke_train(job, SmokeConfig(num_samples=4, num_steps=6))
    result = smoke_train(job, SmokeConfig(num_samples=4, num_steps=3))
    assert [p.name for p in (tmp_path / "smoke" / "checkpoints").iterdir()] == ["step-00000003"]
    assert latest_complete(tmp_path / "smoke") == Path(result.checkpoint)


def test_smoke_train_refuses_a_dir_holding_real_training_checkpoints(tiny_run, tmp_path, one_thread):
    job = tiny_job(tiny_run, tmp_path / "out")
    result = smoke_train(job, SmokeConfig(num_samples=2, num_steps=2))
    state_file = Path(result.checkpoint) / "trainer_state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "smoke": False}))
    with pytest.raises(ValueError, match="holds training checkpoint step-00000002; the smoke run would mix"):
        smoke_train(job, SmokeConfig(num_samples=2, num_steps=2))


def test_smoke_train_refuses_more_samples_than_the_shards_hold(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="smoke.num_samples=20: the shards hold only 12 samples; lower it"):
        smoke_train(tiny_job(tiny_run, tmp_path / "smoke"), SmokeConfig(num_samples=20))


def test_module_table_marks_embeddings_frozen_and_the_rest_trainable(tiny_run, tmp_path, one_thread):
    result = smoke_train(tiny_job(tiny_run, tmp_path / "smoke"), SmokeConfig(num_samples=2, num_steps=2))
    draft, _ = load_draft(result.checkpoint)
    assert module_table(draft) == result.modules
    rows = {row["module"]: row for row in module_table(draft)}
    assert list(rows) == list(MODULE_ROWS)
    assert rows["embed_tokens"] == {
        "module": "embed_tokens",
        "num_params": 64 * 32,
        "shapes": {"weight": [64, 32]},
        "trainable": False,
    }
    assert rows["fc"]["shapes"] == {"weight": [32, 96]} and rows["lm_head"]["shapes"] == {"weight": [32, 32]}
    for name in MODULE_ROWS[1:]:
        assert rows[name]["trainable"], name
    assert set(rows["midlayer.self_attn"]["shapes"]) == {
        "q_proj.weight",
        "k_proj.weight",
        "v_proj.weight",
        "o_proj.weight",
    }
    assert sum(row["num_params"] for row in rows.values()) == sum(p.numel() for p in draft.parameters())
