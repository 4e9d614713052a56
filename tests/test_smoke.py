"""eyas.train.smoke: the smoke run overfits a learnable tiny set, in this process or in the process a GPU run
starts on its GPU; a GPU run's smoke never trains on the CPU; a CPU smoke whose cost is too high is refused before
it starts; the module table for the gate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from run_fixtures import REPO, tiny_job, write_tiny_run

from eyas.config import SmokeConfig
from eyas.train.checkpoint import latest_complete, load_draft
from eyas.train.modules import MODULE_ROWS, module_table
from eyas.train.smoke import SmokeRunFailed, check_cpu_cost, smoke_on_gpu, smoke_train


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


def test_the_smoke_process_a_gpu_run_starts_trains_where_it_is_told(tiny_run, tmp_path):
    """`python -m eyas.train.smoke --device D` is the process a GPU run's smoke runs in (D = cuda:0); on cpu here,
    the same code: it overfits, records its device, precision, micro-batches and the save's seconds."""
    job = tiny_job(tiny_run, tmp_path / "smoke")
    (tmp_path / "smoke").mkdir()
    job_path, smoke_path = tmp_path / "job.json", tmp_path / "smoke-config.json"
    job_path.write_text(job.model_dump_json())
    smoke_path.write_text(SmokeConfig(num_samples=8, num_steps=30).model_dump_json())
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "eyas.train.smoke", "--job", str(job_path), "--smoke", str(smoke_path)]
    done = subprocess.run([*cmd, "--device", "cpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "smoke" / "smoke.json").read_text())
    assert result["passed"] and result["device"] == "cpu" and result["precision"] == "fp32"
    assert result["micro_batches"] == 1 and result["save_s"] > 0 and result["peak_bytes"] == 0


def test_a_gpu_runs_smoke_never_trains_on_the_cpu(tiny_run, tmp_path):
    """Without a GPU the smoke process of a GPU run fails at once, naming the device; nothing is trained here."""
    job = tiny_job(tiny_run, tmp_path / "smoke")
    (tmp_path / "smoke").mkdir()
    with pytest.raises(SmokeRunFailed, match=r"smoke run on cuda:0 exited with 1; last lines of .*smoke\.log"):
        smoke_on_gpu(job, SmokeConfig(num_samples=8, num_steps=30))
    assert latest_complete(tmp_path / "smoke") is None
    assert "cuda" in (tmp_path / "smoke" / "smoke.log").read_text().lower()


def kimi_on_cpu():
    from eyas.config import load_run_config

    config = load_run_config(REPO / "deployments" / "kimi-k25-8gpu.json")
    train = config.train.model_copy(update={"backend": "gloo", "mixed_precision": "auto", "device_memory_gib": 0})
    facts = SimpleNamespace(target=SimpleNamespace(hidden_size=7168, vocab_size=163840),
                            sample_lengths=lambda: [4096] * 16)  # fmt: skip
    return config.model_copy(update={"train": train}), facts


def test_a_full_shape_smoke_run_on_cpu_is_refused_before_it_starts():
    config, facts = kimi_on_cpu()
    with pytest.raises(ValueError) as refused:
        check_cpu_cost(config, facts, flops_per_s=100e9)
    message = str(refused.value)
    assert "smoke run on CPU: 40 steps on 8 samples (32,768 tokens)" in message
    assert "over smoke.max_cpu_minutes=30" in message and "train.backend='nccl'" in message
    tiny = config.model_copy(update={"smoke": config.smoke.model_copy(update={"num_steps": 2, "num_samples": 1})})
    with pytest.raises(ValueError, match="379.6 TFLOP, about 127 minutes"):  # 2 x 4,096 tokens x 46.3 GFLOP
        check_cpu_cost(tiny.model_copy(update={"smoke": tiny.smoke.model_copy(update={"max_cpu_minutes": 1})}),
                       facts, flops_per_s=100e9)  # fmt: skip


def test_the_tiny_presets_smoke_run_costs_seconds_on_this_host(tiny_target_dir):
    from eyas.config import load_run_config
    from eyas.target import TargetFacts

    config = load_run_config(REPO / "deployments" / "tiny-cpu.json")
    facts = SimpleNamespace(target=TargetFacts.read(tiny_target_dir), sample_lengths=lambda: [120] * 16)
    assert check_cpu_cost(config, facts) < 60
